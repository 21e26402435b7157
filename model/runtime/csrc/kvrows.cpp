// The KV cache's row copies on the CPU (model.cache.KVCache, through model.runtime.kvrows): a
// step's new keys/values written at each row's next position, and rows taking other rows'
// decoded prefixes (beams that change parents, rows moving into the places of rows that left).
// Without torch: plain bytes, called through ctypes (which releases the GIL for the call).
//
// The cache's self-attention buffer is (rows, blocks, positions, vector) and contiguous: row r's
// block b (one layer's keys or values of one head) starts at kv + r * row_bytes + b * block_bytes,
// and its positions follow one another, vector_bytes each. From Python, each of these was a
// strided copy_ per row (or ATen's index_copy_, which writes such vectors an element at a time).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

extern "C" {

// Row r (r < rows) writes new_kv's vectors (rows, blocks, vector), contiguous, at its position
// lengths[r] of each block.
void nmt_kv_write_next(char* kv, int64_t row_bytes, int64_t block_bytes, int64_t blocks,
                       int64_t vector_bytes, int64_t rows, const char* new_kv,
                       const int64_t* lengths) {
  for (int64_t r = 0; r < rows; ++r) {
    char* row = kv + r * row_bytes + lengths[r] * vector_bytes;
    const char* from = new_kv + r * blocks * vector_bytes;
    for (int64_t b = 0; b < blocks; ++b)
      std::memcpy(row + b * block_bytes, from + b * vector_bytes, vector_bytes);
  }
}

// Row dst[i] takes the first lengths[src[i]] positions of each block of row src[i], as they were
// before any of the copies (each dst at most once; pairs with dst == src are no copy). A copy
// waits until the rows that read its destination have been copied; a row in a cycle of
// exchanges (a <- b, b <- a) is copied aside first and read from there.
void nmt_kv_take_prefixes(char* kv, int64_t row_bytes, int64_t block_bytes, int64_t blocks,
                          int64_t vector_bytes, int64_t pairs, const int64_t* dst,
                          const int64_t* src, const int64_t* lengths) {
  int64_t rows = 0;
  for (int64_t i = 0; i < pairs; ++i) rows = std::max(rows, std::max(dst[i], src[i]) + 1);
  std::vector<int64_t> readers(rows, 0);  // pending copies that read row r
  std::vector<int64_t> writer(rows, -1);  // the pending copy into row r
  std::vector<const char*> from(rows, nullptr);  // where row r's prefix is read (aside or in place)
  for (int64_t i = 0; i < pairs; ++i) {
    if (dst[i] == src[i]) continue;
    ++readers[src[i]];
    writer[dst[i]] = i;
  }
  for (int64_t r = 0; r < rows; ++r) from[r] = kv + r * row_bytes;
  std::vector<int64_t> ready;  // copies whose destination nobody still reads
  for (int64_t i = 0; i < pairs; ++i)
    if (dst[i] != src[i] && readers[dst[i]] == 0) ready.push_back(i);
  std::vector<std::unique_ptr<char[]>> aside;
  int64_t done = 0, moving = 0;
  for (int64_t i = 0; i < pairs; ++i) moving += dst[i] != src[i];
  int64_t scan = 0;  // where to look for a cycle's first copy
  while (done < moving) {
    if (ready.empty()) {  // only cycles are left: set one of their destinations aside
      while (writer[dst[scan]] != scan || dst[scan] == src[scan]) ++scan;
      int64_t r = dst[scan];
      int64_t n = lengths[r] * vector_bytes;
      aside.emplace_back(new char[n * blocks > 0 ? n * blocks : 1]);
      char* copy = aside.back().get();
      for (int64_t b = 0; b < blocks; ++b) std::memcpy(copy + b * n, from[r] + b * block_bytes, n);
      from[r] = copy;  // its readers read the copy (blocks n bytes apart: see below)
      readers[r] = 0;
      ready.push_back(scan);
      continue;
    }
    int64_t i = ready.back();
    ready.pop_back();
    int64_t s = src[i], d = dst[i];
    int64_t n = lengths[s] * vector_bytes;
    bool set_aside = from[s] != kv + s * row_bytes;
    int64_t stride = set_aside ? n : block_bytes;
    for (int64_t b = 0; b < blocks; ++b)
      std::memcpy(kv + d * row_bytes + b * block_bytes, from[s] + b * stride, n);
    writer[d] = -1;
    ++done;
    if (--readers[s] == 0 && !set_aside && writer[s] >= 0) ready.push_back(writer[s]);
  }
}

}  // extern "C"
