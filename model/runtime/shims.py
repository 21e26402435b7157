"""C shims of the opaque operators a compiled graph calls: ``csrc/shims.cpp``, built into a small
shared library beside the packages that call it.

A package calls an operator TorchInductor has no C function for (``nmt::layer_norm``, the encoder's
LayerNorm kept as ATen's kernel: ``model.runtime.encoder``) through torch's proxy executor, which
calls the operator's Python implementation back, under the GIL; and only torch's own binding of the
package has a proxy executor, so such a package cannot run through its C interface
(``model.runtime.native``). Given a C function of the operator's (``DECLARATIONS``, TorchInductor's
``aot_inductor.custom_ops_to_c_shims``), the package calls it directly, as it calls its aten
operators' shims: no Python, no GIL, and the decoding threads of a process encode while the others
decode. The function calls the same ATen kernel as the Python implementation: the same bits.

The library is built once per source and torch (``library``: the C++ compiler the packages are
compiled with, ~4 s on our 2-vCPU AMD EPYC, avx512_vnni), by the process that compiles a package
calling it, and loaded into the global symbol scope (``load``) before any such package: the
package's library leaves the function's symbol to be found there. Where it cannot be built,
neither can a package (the same compiler, the same headers): the caller keeps its eager path.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import os
import subprocess
import threading
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "csrc" / "shims.cpp"

# Each operator's C function, declared as the generated code calls it (TorchInductor's C ABI:
# tensors as handles, an optional tensor as a pointer to one (null: None), an int list as a
# pointer and a length, a bool as int32, the result through a pointer to a new handle). The name is
# TorchInductor's for the operator: aoti_torch_<device>_<name>.
DECLARATIONS = {
    "nmt::layer_norm": (
        "AOTITorchError aoti_torch_cpu_layer_norm(AtenTensorHandle input, const int64_t* normalized_shape,"
        " int64_t normalized_shape_len_, AtenTensorHandle* weight, AtenTensorHandle* bias, double eps,"
        " int32_t cudnn_enable, AtenTensorHandle* ret0)"
    ),
}

BUILD_TIMEOUT_S = 600

_loaded: set[Path] = set()
_lock = threading.Lock()


def digest() -> str:
    """What the library is built from: its source and torch's version (its headers, its ABI)."""
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(torch.__version__.encode())
    return h.hexdigest()[:16]


def path(cache_dir: Path) -> Path:
    """Where the library is kept in ``cache_dir``."""
    return cache_dir / f"shims-{digest()}.so"


def library(cache_dir: Path) -> Path:
    """The library in ``cache_dir``, built unless it is there (under a lock: processes starting
    together build it once; written under a temporary name and renamed whole). Raises
    RuntimeError where it cannot be built."""
    target = path(cache_dir)
    if target.exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(target.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        if target.exists():
            return target
        tmp = target.with_suffix(f".{os.getpid()}.tmp.so")
        try:
            done = subprocess.run(
                _command(tmp), capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False
            )
            if done.returncode != 0:
                raise RuntimeError(f"building {SOURCE.name} failed: {done.stderr.strip()[-2000:]}")
            os.replace(tmp, target)
        except (OSError, subprocess.SubprocessError) as e:
            raise RuntimeError(f"building {SOURCE.name} failed: {e}") from e
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
    return target


def _command(output: Path) -> list[str]:
    """The compiler's command line: the compiler TorchInductor uses, torch's headers and libraries."""
    from torch._inductor.cpp_builder import get_cpp_compiler  # (imported where packages are compiled)

    root = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        get_cpp_compiler(),
        *("-O2", "-std=c++20", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"),
        f"-I{root / 'include'}",
        f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
        str(SOURCE),
        f"-L{root / 'lib'}",
        "-ltorch_cpu",
        "-lc10",
        f"-Wl,-rpath,{root / 'lib'}",
        "-o",
        str(output),
    ]


def load(library: Path) -> None:
    """Load the library into the process's global symbol scope (once): the packages that call its
    functions find them there when they are loaded. Raises RuntimeError where torch's own library
    defines a function of the same name (a later torch's shim of its own: which one a package would
    call is then not ours to say)."""
    with _lock:
        if library in _loaded:
            return
        torch_cpu = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        if taken := [name for name in functions() if hasattr(torch_cpu, name)]:
            raise RuntimeError(f"torch defines {', '.join(taken)} itself: the shims are not loaded")
        ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
        _loaded.add(library)


def functions() -> list[str]:
    """The names of the library's functions, as ``DECLARATIONS`` declare them."""
    return [declaration.split("(")[0].split()[-1] for declaration in DECLARATIONS.values()]


def inductor_configs() -> dict[str, object]:
    """TorchInductor's settings for a package that calls the shims directly."""
    ops = {name: getattr(torch.ops.nmt, name.split("::")[1]).default for name in DECLARATIONS}
    return {"aot_inductor.custom_ops_to_c_shims": {ops[name]: [decl] for name, decl in DECLARATIONS.items()}}
