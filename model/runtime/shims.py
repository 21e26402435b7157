"""The shims' library: C shims of the opaque operators a compiled graph calls (``csrc/shims.cpp``)
and our int8 product's kernel (``csrc/int8mm.cpp``, ``nmt::int8_mm``: ``model.runtime.int8mm``),
built into a small shared library beside the packages that call them.

A package calls an operator TorchInductor has no C function for (``nmt::layer_norm``, the encoder's
LayerNorm kept as ATen's kernel: ``model.runtime.encoder``; ``nmt::int8_mm``) through torch's proxy
executor, which calls the operator back through Python, under the GIL; and only torch's own binding
of the package has a proxy executor, so such a package cannot run through its C interface
(``model.runtime.native``). Given a C function of the operator's (``DECLARATIONS``, TorchInductor's
``aot_inductor.custom_ops_to_c_shims``), the package calls it directly, as it calls its aten
operators' shims: no Python, no GIL, and the decoding threads of a process encode while the others
decode. The function calls the same kernel as an eager call of the operator: the same bits.

The library is built once per source and torch (``library``: the C++ compiler the packages are
compiled with, its two sources side by side, ~6 s on our 2-vCPU AMD EPYC, avx512_vnni), by the
process that compiles a package calling it (the step's, beside its compiling; the encoder's), and
loaded into the global symbol scope (``load``) before any such package: the package's library
leaves the functions' symbols to be found there. Where it cannot be built, neither can a package
(the same compiler, the same headers): the caller keeps its eager path. (``build`` also makes our
small libraries without torch, ``Standalone``: the int8 kernel's own, ``model.runtime.int8mm``, and
the KV cache's row copies, ``model.runtime.kvrows``.)
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
# The library's sources, compiled side by side (one compiler process each) and linked: shims.cpp,
# and int8mm.cpp (our int8 product's kernel: the library's own copy, which its C shim calls).
SOURCES = (_CSRC / "shims.cpp", _CSRC / "int8mm.cpp")

# The operators of the ``nmt`` namespace: ``layer_norm`` (implemented by ``model.runtime.encoder``)
# and ``int8_mm`` (by ``model.runtime.int8mm``). Defined
# through the plain library API: ``torch.library.custom_op`` wraps its kernel in a guard that
# imports TorchDynamo (and TorchInductor's configuration, sympy) at the first call, 70 MiB more
# in a worker that compiles nothing.
LIBRARY = torch.library.Library("nmt", "DEF")
LIBRARY.define(
    "layer_norm(Tensor input, SymInt[] normalized_shape, Tensor? weight=None, Tensor? bias=None,"
    " float eps=1e-05, bool cudnn_enable=True) -> Tensor"
)
LIBRARY.define("int8_mm(Tensor x, Tensor w, Tensor comp, SymInt out) -> Tensor")


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
    "nmt::int8_mm": (
        "AOTITorchError aoti_torch_cpu_int8_mm(AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle comp,"
        " int64_t out, AtenTensorHandle* ret0)"
    ),
}

BUILD_TIMEOUT_S = 600

_loaded: set[Path] = set()
_lock = threading.Lock()


def digest() -> str:
    """What the library is built from: its sources, how (this module) and torch's version (its
    headers, its ABI)."""
    h = hashlib.sha256()
    for source in (*SOURCES, Path(__file__)):
        h.update(source.read_bytes())
    h.update(torch.__version__.encode())
    return h.hexdigest()[:16]


def path(cache_dir: Path) -> Path:
    """Where the library is kept in ``cache_dir``."""
    return cache_dir / f"shims-{digest()}.so"


def library(cache_dir: Path) -> Path:
    """The library in ``cache_dir``, built unless it is there (under a lock: processes starting
    together build it once; written under a temporary name and renamed whole). Raises
    RuntimeError where it cannot be built."""
    return build(path(cache_dir), SOURCES, torch_linked=True)


def build(target: Path, sources: tuple[Path, ...], *, torch_linked: bool) -> Path:
    """``sources`` built into the shared library ``target`` unless it is there: each source in a
    compiler process of its own, side by side, then the link (``torch_linked``: with torch's
    headers and libraries). Under a lock (processes starting together build it once), written under
    a temporary name and renamed whole. Raises RuntimeError where it cannot be built."""
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        if target.exists():
            return target
        tmp = target.with_suffix(f".{os.getpid()}.tmp.so")
        objects = [target.with_suffix(f".{os.getpid()}.{source.stem}.o") for source in sources]
        compiling: list[subprocess.Popen[str]] = []
        try:
            compiling = [
                subprocess.Popen(
                    _compile_command(source, obj, torch_linked), stderr=subprocess.PIPE, text=True
                )
                for source, obj in zip(sources, objects, strict=True)
            ]
            for source, process in zip(sources, compiling, strict=True):
                _, err = process.communicate(timeout=BUILD_TIMEOUT_S)
                if process.returncode != 0:
                    raise RuntimeError(f"building {source.name} failed: {err.strip()[-2000:]}")
            done = subprocess.run(
                _link_command(objects, tmp, torch_linked),
                capture_output=True,
                text=True,
                timeout=BUILD_TIMEOUT_S,
                check=False,
            )
            if done.returncode != 0:
                raise RuntimeError(f"linking {target.name} failed: {done.stderr.strip()[-2000:]}")
            os.replace(tmp, target)
        except (OSError, subprocess.SubprocessError) as e:
            raise RuntimeError(f"building {target.name} failed: {e}") from e
        finally:
            for process in compiling:  # (still running where another one failed)
                if process.poll() is None:
                    process.kill()
                    process.wait()
            for leftover in (tmp, *objects):
                with contextlib.suppress(FileNotFoundError):
                    leftover.unlink()
    return target


class Standalone:
    """One of our small libraries without torch (a single C++ source: our int8 kernel, the KV
    cache's row copies), built by ``build`` into a compile cache under a name of its source and of
    how it is built, and loaded once per process through ctypes (``library``: the first loaded).
    ``ensure`` builds and loads it (a second caller waits for the first) and hands it to ``loaded``
    (once, its functions' ctypes declarations); where it cannot, it says once per cache why, and
    what runs instead."""

    def __init__(
        self, name: str, source: Path, *, what: str, instead: str, loaded: Callable[[ctypes.CDLL], None]
    ) -> None:
        self.name, self.source, self.what, self.instead, self.loaded = name, source, what, instead, loaded
        self.library: ctypes.CDLL | None = None
        self._tried: dict[Path, bool] = {}
        self._lock = threading.Lock()

    def path(self, cache_dir: Path) -> Path:
        """Where the library is kept in ``cache_dir``."""
        h = hashlib.sha256(self.source.read_bytes())
        h.update(Path(__file__).read_bytes())
        return cache_dir / f"{self.name}-{h.hexdigest()[:16]}.so"

    def ensure(self, cache_dir: Path) -> bool:
        """Build the library into ``cache_dir`` unless it is there, and load it unless one is
        loaded; whether that worked."""
        with self._lock:
            if cache_dir not in self._tried:
                try:
                    path = build(self.path(cache_dir), (self.source,), torch_linked=False)
                    if self.library is None:
                        library = ctypes.CDLL(str(path))
                        self.loaded(library)
                        self.library = library
                    self._tried[cache_dir] = True
                except (RuntimeError, OSError, AttributeError) as e:  # (AttributeError: a function lacking)
                    log.warning("%s is not available (%s): %s", self.what, e, self.instead)
                    self._tried[cache_dir] = False
            return self._tried[cache_dir]

    def ensure_beside(self, cache_dir: Path) -> threading.Thread:
        """``ensure`` on a thread of its own, started: a first start builds the library while the
        caller reads a model's weights."""
        thread = threading.Thread(target=self.ensure, args=(cache_dir,), name=self.name, daemon=True)
        thread.start()
        return thread


def compiler(torch_linked: bool = True) -> str:
    """The C++ compiler TorchInductor uses (``$CXX``, else the first of its candidates found); for a
    library without torch's headers, ``$CXX`` or g++ without asking TorchInductor: importing it
    before ``model.runtime.runners.load_runner`` sets ``TORCHINDUCTOR_CACHE_DIR`` would fix its
    cache elsewhere."""
    if not torch_linked:
        return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or "g++"
    from torch._inductor.cpp_builder import get_cpp_compiler  # (imported where packages are compiled)

    return get_cpp_compiler()


def _compile_command(source: Path, output: Path, torch_linked: bool) -> list[str]:
    """The compiler's command line for one source: position-independent code, torch's headers
    where ``torch_linked``."""
    root = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    kernel = source.name == "int8mm.cpp"
    return [
        compiler(torch_linked),
        # -O3 for the kernel: at -O2 GCC kept its register tiles in memory (3-4x slower).
        "-O3" if kernel else "-O2",
        *("-std=c++20", "-fPIC", "-c", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"),
        # Inside the shims' library the kernel is its own copy, not exported: the process sees one
        # nmt_int8_mm_blocks, the kernel library's (``model.runtime.int8mm``).
        *(["-fvisibility=hidden"] if kernel and torch_linked else []),
        *(
            [f"-I{root / 'include'}", f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}"]
            if torch_linked
            else []
        ),
        str(source),
        "-o",
        str(output),
    ]


def _link_command(objects: list[Path], output: Path, torch_linked: bool) -> list[str]:
    """The linker's command line: the objects into a shared library (against torch's libraries
    where ``torch_linked``)."""
    root = Path(torch.__file__).parent
    against = (
        [f"-L{root / 'lib'}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{root / 'lib'}"] if torch_linked else []
    )
    return [compiler(torch_linked), "-shared", *map(str, objects), *against, "-o", str(output)]


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
