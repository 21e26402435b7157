"""One answer per input: float32 products that do not depend on the batch or the thread count.

PyTorch's float32 linear layers on x86 are MKL's ``sgemm``. Left to itself, MKL picks its kernel by
the shape and the threads: on a 2-core Intel Xeon with AVX-512 VNNI and AMX (measured there),
one row of a (1, 512) x (512, 512) product came out ~1e-6 relative away from the same row computed
among 2-15 others, again different among 16 or more, and a (64, 2048) x (2048, 512) product
differed between 1 and 2 threads (K split across the threads). Continuous batching adds and
removes neighbours at every step, and a lone worker runs on its idle neighbours' cores
(``app.serving.cores``): with such kernels a float32 translation could depend on who else was
translating, or on whether the machine happened to be idle.

MKL's *strict conditional numerical reproducibility* (CNR) fixes the kernels' reduction order
whatever the row count and the thread count (``?gemm`` on its AVX2 and AVX-512 code branches:
oneMKL's "Reproducibility Conditions"); measured there, every row of those products is bit for bit
the same alone and among 2-64 rows, on 1 or 2 threads. Its price is in the one- to three-row
products, which MKL otherwise runs as matrix-vector kernels (BENCHMARKS.md, "One answer per input").

The mode must be chosen before MKL's first call in the process, so ``model.layers`` calls
``ensure_strict`` when it is imported (every module that computes with the model imports it
first). The branch is MKL's own choice for this CPU (AVX-512 on those Xeons) where that choice is
one strict mode supports, and AVX2 otherwise (MKL's automatic choice on a non-Intel CPU may be an
older one, where strict mode does not apply). A user's own ``MKL_CBWR`` is left as set.

int8 products run in oneDNN (``model.runtime.prepack``), whose own kernels give each row the
same bits alone and among others (``tests/test_determinism.py``); GPUs have no MKL.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)

# mkl_cbwr.h
CBWR_ALL = -1  # ~0: the whole setting, branch and flags
CBWR_STRICT = 0x10000
CBWR_AUTO = 2
CBWR_AVX2 = 10
CBWR_MIC = (11, 13)  # Xeon Phi branches: not the AVX2 / AVX-512 kind that strict mode supports
CBWR_ERRORS = {-1: "invalid settings", -3: "unsupported branch", -8: "MKL in use already"}


@dataclass(frozen=True)
class Reproducibility:
    """What MKL was asked for and what it does."""

    mkl: bool  # torch's CPU library carries MKL (x86 builds do)
    strict: bool  # strict CNR in force: bits independent of rows and threads
    branch: int  # the code branch in force (mkl_cbwr.h: 10 AVX2, 12 AVX512, 14 AVX512_E1, ...)
    why: str = ""  # why strict mode is not in force, where it is not


def _mkl() -> ctypes.CDLL | None:
    """torch's CPU library, where MKL is linked in (its ``mkl_serv_cbwr_*`` functions)."""
    import torch

    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        lib.mkl_serv_cbwr_get  # noqa: B018 - raises AttributeError where MKL is absent
    except (OSError, AttributeError):
        return None
    return lib


def _supports_strict(branch: int) -> bool:
    return branch >= CBWR_AVX2 and branch not in CBWR_MIC


@cache
def ensure_strict() -> Reproducibility:
    """Put MKL in strict CNR mode, once per process, before its first product; say what holds."""
    lib = _mkl()
    if lib is None:
        return Reproducibility(mkl=False, strict=False, branch=0, why="no MKL in this torch")
    if "MKL_CBWR" not in os.environ:
        import torch

        auto = lib.mkl_serv_cbwr_get_auto_branch()
        has_avx2 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
        branch = CBWR_AUTO if _supports_strict(auto) else CBWR_AVX2 if has_avx2 else 0
        if branch:
            code = lib.mkl_serv_cbwr_set(branch | CBWR_STRICT)
            if code != 0:
                log.warning("MKL's strict mode could not be set: %s", CBWR_ERRORS.get(code, code))
    setting = lib.mkl_serv_cbwr_get(CBWR_ALL)
    branch = setting & 0xFFFF
    if branch == CBWR_AUTO:
        branch = lib.mkl_serv_cbwr_get_auto_branch()
    strict = bool(setting & CBWR_STRICT) and _supports_strict(branch)
    why = "" if strict else f"MKL's setting is {setting:#x} (MKL_CBWR={os.environ.get('MKL_CBWR', 'unset')})"
    if not strict:
        log.warning("float32 products may depend on the batch and the thread count: %s", why)
    return Reproducibility(mkl=True, strict=strict, branch=branch, why=why)
