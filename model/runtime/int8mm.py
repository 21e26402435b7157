"""Which int8 product a linear layer calls: our own kernel (``nmt::int8_mm``, ``csrc/int8mm.cpp``)
wherever its library is loaded (``ensure``), else oneDNN's BLAS-like ``gemm_s8s8s32``
(``torch._int_mm``) where it is exact on this CPU and pays, else oneDNN's matmul primitive
(``torch.ops.onednn.qlinear_pointwise``).

Our kernel sums the same integers exactly (on every x86-64 CPU: VNNI, AVX2 or plain C++), so a
layer computes the same bits through it. It reads its weight in a blocked layout of its own
(``blocked``), with no per-call setup: for a decoding step's few rows it runs at the memory's
speed where oneDNN's primitive spent ~20 us per call building its descriptor and ``gemm_s8s8s32``
packs its weight at every call (2-vCPU AMD EPYC, avx512_vnni, one thread, eager calls, weights in
cache: 512 x 2,048 at 3 rows 29 us against 46 and 61; at 64 rows 322 against 333 and 353; the
512 x 58,101 output projection 1.60 ms against 1.98 and 4.42 at 3 rows, 11.7 against 11.0 at 64).

Both sum the same integers exactly in int32 and then multiply each sum by its weight's scale once,
so a layer computes the same bits through either (``Int8Linear``; tested). What differs is the cost
of a call: ``qlinear_pointwise`` builds oneDNN's primitive descriptor at every call (~20 us on our
2-vCPU AMD EPYC, avx512_vnni), which was most of a decoding step for one sentence on the shipped
model (19 such calls a step); ``gemm_s8s8s32`` takes the plain int8 weight and starts at once
(one thread, 256 x 256 weight: 2.3 us against 26 for one row, 14 against 35 for 32 rows). It is
slower where the weight is large (512 x 58,101: 2.1 against 1.2 ms for one row; 2,048 x 512:
4x for 4 rows): hence ``SMALL_WEIGHT``.

Exact only where the CPU sums u8 x s8 products without an int16 step. oneDNN makes signed
activations unsigned by adding 128; on a CPU without VNNI (AVX2 only, or AVX-512 without VNNI) it
then multiplies with ``vpmaddubsw``, whose int16 pair sums overflow for 7-bit activations
(191 x 127 x 2 > 32,767), and its one-row kernel does so whichever operand comes first. So every
shape is checked once per process (``exact``) on the sums that would overflow, for one row and for
several (oneDNN's one-row and many-row kernels differ): where any sum is off, the layer keeps
``qlinear_pointwise``, whose unsigned 7-bit activations never overflow (``prepack.ACT_LEVELS``).
"""

from __future__ import annotations

import ctypes
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from model.runtime import shims

# The kernel's layout: 16 output features per block, 4 inputs per 32-bit lane (csrc/int8mm.cpp).
FEATURES, GROUP = 16, 4

# A layer of (out, in) features calls ``gemm_s8s8s32`` where in x out <= SMALL_WEIGHT, or in <=
# SMALL_IN and out <= SMALL_OUT (and where it is exact). Unlike the primitive, it packs its weight at
# every call of more than one row: cheap for a weight that stays in cache, not for a large one.
# Measured on the AMD EPYC (avx512_vnni): every layer of the shipped model (256 wide: 256 x 256 to
# 256 x 8,000 and 1,024 x 256) was faster at 1 row (2.3 against 26 us at 256 x 256) and as fast or
# faster at 32 and 64; with OPUS-MT's 512 x 1,536 and 512 x 2,048 layers too, the service decoded
# 6.6% fewer sentences/s under load (86.8 against 92.9, greedy, ``benchmarks.opus_size`` back to
# back), so of that size only its 512 x 512 layers call it (91 against 123 us at 32 rows, 28
# against 68 at one).
SMALL_WEIGHT = 512 * 512
SMALL_IN, SMALL_OUT = 256, 8192  # the shipped model's output projection, measured (256 x 8,000)

# Row counts whose sums are checked: one (oneDNN's vector kernel) and more (its matrix kernels).
CHECKED_ROWS = (1, 2, 3, 8, 33, 64)


def serves(in_features: int, out_features: int) -> bool:
    """Whether a layer of this shape calls ``torch._int_mm``: a small one (``SMALL_WEIGHT``,
    ``SMALL_IN`` and ``SMALL_OUT``), where it is exact."""
    small = in_features * out_features <= SMALL_WEIGHT
    small |= in_features <= SMALL_IN and out_features <= SMALL_OUT
    return small and exact(in_features, out_features)


@cache
def exact(in_features: int, out_features: int) -> bool:
    """Whether ``torch._int_mm(q, w.t())`` sums 7-bit activations ``q`` (rows, in) times 8-bit
    weights ``w`` (out, in) exactly on this CPU, for every row count of ``CHECKED_ROWS``: the
    activations at +63 (unsigned, 191: the largest pair sums) against weights at +127 and at -127,
    and random ones, against float64 sums (exact: every partial sum is an integer below 2**53)."""
    if not torch.backends.mkldnn.is_available():  # ATen's fallback is exact, and far too slow
        return False
    g = torch.Generator().manual_seed(0)
    shape = (out_features, in_features)
    with torch.inference_mode():
        # The weights once for every row count: the shipped model's shapes take
        # ~0.1 s (AMD EPYC avx512_vnni).
        highest_w = torch.full(shape, 127, dtype=torch.int8)
        random_w = torch.randint(-127, 128, shape, dtype=torch.int8, generator=g)
        for rows in CHECKED_ROWS:
            highest = torch.full((rows, in_features), 63, dtype=torch.int8)
            random_q = torch.randint(-63, 64, (rows, in_features), dtype=torch.int8, generator=g)
            for q, w in ((highest, highest_w), (highest, -highest_w), (random_q, random_w)):
                try:
                    got = torch._int_mm(q, w.t())
                except RuntimeError:  # a build or shape it refuses
                    return False
                if not torch.equal(got.double(), q.double() @ w.double().t()):
                    return False
    return True


def blockable(in_features: int) -> bool:
    """Whether our kernel takes a layer of ``in_features`` inputs (whole groups of ``GROUP``)."""
    return in_features % GROUP == 0


def blocked(qweight: Tensor, zero: int) -> tuple[Tensor, Tensor]:
    """``qweight`` (out, in) int8 in our kernel's layout, (ceil(out / 16), in / 4, 16, 4), the
    features past ``out`` zero; and ``zero`` x each feature's weight sum, int32 (ceil(out / 16) x
    16): what the kernel subtracts from its sums of activations held ``zero`` above their value."""
    out, inputs = qweight.shape
    blocks = -(-out // FEATURES)
    padded = qweight.new_zeros(blocks * FEATURES, inputs)
    padded[:out] = qweight
    layout = padded.view(blocks, FEATURES, inputs // GROUP, GROUP).permute(0, 2, 1, 3).contiguous()
    return layout, padded.sum(dim=1, dtype=torch.int32).mul_(zero)


def rows_of(layout: Tensor, ids: Tensor) -> Tensor:
    """The rows ``ids`` (any shape) of the (out, in) int8 weight held in ``layout`` (``blocked``):
    (*ids.shape, in), read where they lie (an embedding lookup on the output projection's copy)."""
    picked = layout[ids // FEATURES, :, ids % FEATURES]  # (*ids.shape, in / 4, 4)
    return picked.reshape(*ids.shape, layout.size(1) * GROUP)


# Our kernel (csrc/int8mm.cpp), built alone into a small library without torch's headers (~1.2 s,
# 2-vCPU AMD EPYC avx512_vnni: a first start waits for it less than for the shims' library, ~6 s,
# which compiled graphs need and which is built beside their compiling), called through ctypes by
# the operator's eager implementation (ctypes releases the GIL for the call). A compiled graph
# calls the shims' library's own copy of the kernel through its C shim.
KERNEL_SOURCE = Path(__file__).parent / "csrc" / "int8mm.cpp"

# An eager call is shared between torch's threads where it sums at least this many products.
PARALLEL_PRODUCTS = 1 << 22

_kernel: Any = None  # the library's nmt_int8_mm_blocks (a ctypes function), once loaded
_pool: ThreadPoolExecutor | None = None
_pool_threads = 0  # how many threads _pool has


def _declare(library: ctypes.CDLL) -> None:
    global _kernel
    function = library.nmt_int8_mm_blocks
    function.restype = None
    function.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 5
    _kernel = function


_LIBRARY = shims.Standalone(
    "int8mm",
    KERNEL_SOURCE,
    what="our int8 kernel",
    instead="int8 layers run on oneDNN's kernels",
    loaded=_declare,
)


def kernel_path(cache_dir: Path) -> Path:
    """Where the kernel's library is kept in ``cache_dir`` (named by its source and how it is built)."""
    return _LIBRARY.path(cache_dir)


def ensure(cache_dir: Path) -> bool:
    """Build the kernel's library into ``cache_dir`` unless it is there, and load it (once per
    process: a second caller waits for the first); whether that worked. Where it did not (no
    compiler, an unwritable cache), says why once: int8 layers then keep oneDNN's kernels."""
    return _LIBRARY.ensure(cache_dir)


def ensure_beside(cache_dir: Path) -> threading.Thread:
    """``ensure`` on a thread of its own, started: a first start builds the library while the
    caller reads a model's weights."""
    return _LIBRARY.ensure_beside(cache_dir)


def loaded() -> bool:
    """Whether our kernel is loaded into this process (int8 layers prepared now take it)."""
    return _kernel is not None


def runs_ours(model: torch.nn.Module) -> bool:
    """Whether any of ``model``'s int8 layers runs our kernel (``prepack.Int8Linear.kernel``): a
    graph compiled from it then calls the shims' library (``model.runtime.shims``)."""
    return any(getattr(m, "kernel", None) == "ours" for m in model.modules())


def _int8_mm(x: Tensor, w: Tensor, comp: Tensor, out: int) -> Tensor:
    """``nmt::int8_mm`` called eagerly: (rows, out) int32, the sums of ``x`` (rows, in) uint8,
    1..127 (the activations + 64) times the weight held in ``w`` (``blocked``), less ``comp``."""
    kernel = _kernel
    if kernel is None:
        raise RuntimeError("nmt::int8_mm: our int8 kernel is not loaded (model.runtime.int8mm.ensure)")
    rows, inputs = x.shape
    blocks = w.size(0)
    if (
        x.dtype != torch.uint8
        or w.dtype != torch.int8
        or comp.dtype != torch.int32
        or w.shape[1:] != (inputs // GROUP, FEATURES, GROUP)
        or inputs % GROUP
        or comp.numel() != blocks * FEATURES
        or not (blocks - 1) * FEATURES < out <= blocks * FEATURES
    ):
        raise ValueError(
            "nmt::int8_mm: x (rows, in) uint8, w (ceil(out / 16), in / 4, 16, 4) int8, comp int32"
        )
    x, w, comp = x.contiguous(), w.contiguous(), comp.contiguous()
    y = torch.empty((rows, out), dtype=torch.int32)
    if rows == 0 or out == 0:
        return y
    args = (x.data_ptr(), w.data_ptr(), comp.data_ptr(), y.data_ptr(), rows, inputs, out)
    threads = torch.get_num_threads()
    if threads > 1 and rows * inputs * out >= PARALLEL_PRODUCTS and blocks > 4:
        # Whole groups of 4 blocks per thread (the kernel's unit), as at::parallel_for shares them.
        groups = -(-blocks // 4)
        edges = [min(blocks, 4 * (groups * i // threads)) for i in range(threads + 1)]
        list(_threads().map(lambda i: kernel(*args, edges[i], edges[i + 1]), range(threads)))
    else:
        kernel(*args, 0, blocks)
    return y


def _threads() -> ThreadPoolExecutor:
    """A pool of at least torch's thread count (a larger one where that grew since)."""
    global _pool, _pool_threads
    wanted = torch.get_num_threads()
    if _pool is None or _pool_threads < wanted:
        _pool, _pool_threads = ThreadPoolExecutor(wanted, thread_name_prefix="int8mm"), wanted
    return _pool


shims.LIBRARY.impl("int8_mm", _int8_mm, "CPU")


@torch.library.register_fake("nmt::int8_mm", lib=shims.LIBRARY)
def _(x: Tensor, w: Tensor, comp: Tensor, out: int) -> Tensor:
    return x.new_empty((x.shape[0], out), dtype=torch.int32)
