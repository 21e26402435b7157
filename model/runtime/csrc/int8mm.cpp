// nmt::int8_mm (model.runtime.int8mm): the int32 sums of 7-bit activations times int8 weights held
// in a blocked layout of our own, for every row count, on one layout, with no per-call setup.
//
// The weight (out, in) is kept as (ceil(out / 16), in / 4, 16, 4) int8: for 16 output features at a
// time, the 4 consecutive inputs of each feature side by side (64 bytes), rows past `out` zero. So
// one 32-bit broadcast of four activations times one 64-byte load gives 16 features' partial sums
// in one instruction (AVX-512 VNNI's vpdpbusd), with no horizontal sum at the end: the layout
// oneDNN's own int8 kernels use, here with a fixed format we can read from anywhere (the embedding
// lookups read the same rows). A tile of rows times feature blocks is summed in registers; the
// features' weights (BLOCKS blocks) stay in cache while every row passes over them.
//
// Exact on every x86-64 CPU, hence the same bits on each: activations arrive unsigned (q + 64,
// 1..127, as oneDNN's primitive takes them), the products are summed in int32 (VNNI: exact; AVX2:
// vpmaddubsw's int16 pair sums stay below 32,767 for 7-bit activations, 127 x 127 x 2 = 32,258,
// then vpmaddwd to int32), and 64 x the sum of each feature's weights (`comp`, computed once) is
// subtracted: the int32 sums of the signed activations, the same integers oneDNN's kernels give.
//
// No torch header here: built alone into a small library in ~1.2 s (2-vCPU AMD EPYC avx512_vnni),
// which the operator's eager implementation calls through ctypes (model.runtime.int8mm), and into
// the shims' library beside shims.cpp, whose C shim checks the tensors and shares the work between
// torch's threads for compiled graphs. nmt_int8_mm_blocks below is all it exports.
#include <immintrin.h>

#include <algorithm>

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace {

constexpr int64_t FEATURES = 16;  // output features per block
constexpr int64_t GROUP = 4;      // inputs per 32-bit lane
constexpr int64_t BLOCKS = 4;     // feature blocks whose weights stay in cache together (64 features)

enum class Isa { scalar, avx2, vnni };

struct Problem {
  const uint8_t* x;     // (rows, in)
  const int8_t* w;      // (blocks, in / 4, 16, 4)
  const int32_t* comp;  // (blocks * 16): 64 x the sum of each feature's weights
  int32_t* y;           // (rows, out)
  int64_t rows, in, out;
};

// Store 16 sums of feature block `b` for row `m`, less `comp`, the part past `out` left out.
inline void store_scalar(const Problem& p, int64_t m, int64_t b, const int32_t* sums) {
  for (int64_t j = 0; j < FEATURES; ++j) {
    int64_t n = b * FEATURES + j;
    if (n < p.out) p.y[m * p.out + n] = sums[j] - p.comp[n];
  }
}

template <int R, int B>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void tile_vnni(
    const Problem& p, int64_t m0, int64_t b0) {
  __m512i acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_si512();
  const int64_t groups = p.in / GROUP;
  const int8_t* w = p.w + b0 * groups * FEATURES * GROUP;
  const int64_t block_stride = groups * FEATURES * GROUP;
  // The first rows' tile asks for the next feature blocks' weights meanwhile: the weights are read
  // from memory once, ahead of need (the hardware's prefetcher alone left the output projection
  // at 19 GB/s for 3 rows, 38 with this: 2-vCPU AMD EPYC avx512_vnni), and where more rows follow
  // they are summed against each further row tile from cache.
  const int64_t blocks = (p.out + FEATURES - 1) / FEATURES;
  const int8_t* ahead = m0 == 0 && b0 + BLOCKS + B <= blocks ? w + BLOCKS * block_stride : nullptr;
  for (int64_t g = 0; g < groups; ++g) {
    __m512i wv[B];
    for (int b = 0; b < B; ++b)
      wv[b] = _mm512_loadu_si512(w + b * block_stride + g * FEATURES * GROUP);
    if (ahead != nullptr)
      for (int b = 0; b < B; ++b)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + b * block_stride + g * FEATURES * GROUP), _MM_HINT_T1);
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, p.x + (m0 + r) * p.in + g * GROUP, sizeof four);
      const __m512i xv = _mm512_set1_epi32(four);
      for (int b = 0; b < B; ++b) acc[r][b] = _mm512_dpbusd_epi32(acc[r][b], xv, wv[b]);
    }
  }
  for (int b = 0; b < B; ++b) {
    const int64_t n0 = (b0 + b) * FEATURES;
    const __m512i comp = _mm512_loadu_si512(p.comp + n0);
    const int64_t left = p.out - n0;
    const __mmask16 mask = left >= FEATURES ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    for (int r = 0; r < R; ++r)
      _mm512_mask_storeu_epi32(p.y + (m0 + r) * p.out + n0, mask, _mm512_sub_epi32(acc[r][b], comp));
  }
}

template <int R, int B>
__attribute__((target("avx2"))) void tile_avx2(const Problem& p, int64_t m0, int64_t b0) {
  // Each 16-feature block as two halves of 8 features (32 bytes each).
  __m256i acc[R][B][2];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b][0] = acc[r][b][1] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t groups = p.in / GROUP;
  const int8_t* w = p.w + b0 * groups * FEATURES * GROUP;
  const int64_t block_stride = groups * FEATURES * GROUP;
  for (int64_t g = 0; g < groups; ++g) {
    __m256i wv[B][2];
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < 2; ++h)
        wv[b][h] = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(w + b * block_stride + g * FEATURES * GROUP + h * 32));
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, p.x + (m0 + r) * p.in + g * GROUP, sizeof four);
      const __m256i xv = _mm256_set1_epi32(four);
      for (int b = 0; b < B; ++b)
        for (int h = 0; h < 2; ++h) {
          // u8 x s8 pairs summed in int16 (exact for 7-bit activations), then pairs of those in int32
          const __m256i pairs = _mm256_maddubs_epi16(xv, wv[b][h]);
          acc[r][b][h] = _mm256_add_epi32(acc[r][b][h], _mm256_madd_epi16(pairs, ones));
        }
    }
  }
  alignas(32) int32_t sums[FEATURES];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) {
      _mm256_store_si256(reinterpret_cast<__m256i*>(sums), acc[r][b][0]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(sums + 8), acc[r][b][1]);
      store_scalar(p, m0 + r, b0 + b, sums);
    }
}

template <int R, int B>
void tile_scalar(const Problem& p, int64_t m0, int64_t b0) {
  const int64_t groups = p.in / GROUP;
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) {
      int32_t sums[FEATURES] = {};
      const int8_t* w = p.w + (b0 + b) * groups * FEATURES * GROUP;
      const uint8_t* x = p.x + (m0 + r) * p.in;
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t j = 0; j < FEATURES; ++j)
          for (int64_t i = 0; i < GROUP; ++i)
            sums[j] += int32_t(x[g * GROUP + i]) * int32_t(w[(g * FEATURES + j) * GROUP + i]);
      store_scalar(p, m0 + r, b0 + b, sums);
    }
}

// The instructions used: the best this CPU has, or fewer where NMT_INT8_ISA says so (tests run
// every kind on one machine: "vnni", "avx2", "scalar").
Isa chosen_isa() {
  static const Isa isa = [] {
    __builtin_cpu_init();
    Isa best = Isa::scalar;
    if (__builtin_cpu_supports("avx2")) best = Isa::avx2;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vnni"))
      best = Isa::vnni;
    const char* asked = std::getenv("NMT_INT8_ISA");
    if (asked != nullptr) {
      if (std::strcmp(asked, "scalar") == 0) return Isa::scalar;
      if (std::strcmp(asked, "avx2") == 0 && best != Isa::scalar) return Isa::avx2;
    }
    return best;
  }();
  return isa;
}

// The tiles of one kind of instructions: up to MAX_R rows by MAX_B blocks, as many as its registers
// hold (AVX-512: 32 registers, here 16 sums, 4 weights, 1 broadcast: tiles of 24 sums were twice as
// slow, 2-vCPU AMD EPYC avx512_vnni; AVX2: 16 registers, here 8 sums, 2 weights, 1 broadcast).
template <Isa I, int R, int B>
void tile(const Problem& p, int64_t m0, int64_t b0) {
  if constexpr (I == Isa::vnni) tile_vnni<R, B>(p, m0, b0);
  else if constexpr (I == Isa::avx2) tile_avx2<R, B>(p, m0, b0);
  else tile_scalar<R, B>(p, m0, b0);
}

template <Isa I, int R, int B>
void tile_blocks(const Problem& p, int64_t m0, int64_t b0, int64_t blocks) {
  if constexpr (B > 1) {
    if (blocks < B) return tile_blocks<I, R, B - 1>(p, m0, b0, blocks);
  }
  tile<I, R, B>(p, m0, b0);
}

template <Isa I, int R, int B>
void tile_rows(const Problem& p, int64_t m0, int64_t rows, int64_t b0, int64_t blocks) {
  if constexpr (R > 1) {
    if (rows < R) return tile_rows<I, R - 1, B>(p, m0, rows, b0, blocks);
  }
  tile_blocks<I, R, B>(p, m0, b0, blocks);
}

// Feature blocks [first, last) for every row: BLOCKS blocks at a time (their weights stay in cache
// while the rows pass over them), MAX_R rows by MAX_B blocks per tile.
template <Isa I, int MAX_R, int MAX_B>
void run(const Problem& p, int64_t first, int64_t last) {
  for (int64_t g0 = first; g0 < last; g0 += BLOCKS) {
    const int64_t g1 = std::min<int64_t>(g0 + BLOCKS, last);
    for (int64_t m0 = 0; m0 < p.rows; m0 += MAX_R)
      for (int64_t b0 = g0; b0 < g1; b0 += MAX_B)
        tile_rows<I, MAX_R, MAX_B>(p, m0, std::min<int64_t>(MAX_R, p.rows - m0), b0,
                                   std::min<int64_t>(MAX_B, g1 - b0));
  }
}

}  // namespace

// The sums of feature blocks [first, last) of the problem (x: (rows, in) uint8, 1..127; w: (blocks,
// in / 4, 16, 4) int8; comp: (blocks * 16) int32; y: (rows, out) int32), `in` a multiple of 4.
extern "C" void nmt_int8_mm_blocks(const uint8_t* x, const int8_t* w, const int32_t* comp, int32_t* y,
                                   int64_t rows, int64_t in, int64_t out, int64_t first, int64_t last) {
  const Problem p{x, w, comp, y, rows, in, out};
  switch (chosen_isa()) {
    case Isa::vnni: return run<Isa::vnni, 4, 4>(p, first, last);
    case Isa::avx2: return run<Isa::avx2, 4, 1>(p, first, last);
    default: return run<Isa::scalar, 1, 1>(p, first, last);
  }
}
