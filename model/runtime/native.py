"""The compiled decoding step called through its package's own C interface, without the GIL.

torch's binding of an AOTInductor package (``AOTIModelPackageLoader.run``) holds the GIL for the
whole step, so the decoding threads of one process (two models, or two runners of one model) take
turns even though each step is native code from end to end. The package's shared library exports
a C interface (torch/csrc/inductor/aoti_runtime/interface.h); called through ``ctypes``, which
releases the GIL around every foreign call, the step runs while other Python threads run, and
steps of two threads run at once. No C++ is built here: the library is the one in the package.

``extract`` unpacks the library next to its package, once; ``NativeStep`` is one model container
of it (the package's runtime object: its own buffers and a pointer to each weight) handed the
model's own tensors (user-managed: not copied). Every ``NativeStep`` of one package shares the one
loaded library (``dlopen`` loads a path once): the generated code keeps its state in the
container. The one global its kernels write (``inductor_cpu_integer_div_error_flag``, a pointer to
an integer division error flag) is read only on a division by zero (the step divides by constants
only), and it is a GNU unique symbol: one per process whatever the number of copies of the
library (torch's loader's own included), so a copy per container would not separate it anyway.
The tests step two containers in two threads at once and compare with each alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import re
import shutil
import threading
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

# The library and metadata of the package's default model ("model"), under the archive's own top
# folder (the package's temporary name when it was written): what torch's AOTIModelPackageLoader
# reads (torch/csrc/inductor/aoti_package/model_package_loader.cpp).
_MODEL_FILE = re.compile(r"(?:^|/)data/aotinductor/model/([^/]+)$")

_SUCCESS = 0  # AOTIRuntimeError


class NativeUnavailable(RuntimeError):
    """The package holds something the native path does not handle (torch's loader does)."""


def extract(package: Path) -> Path:
    """The package's shared library, unpacked once into a folder beside it (``step-<key>/`` for
    ``step-<key>.pt2``) and kept: a folder written under a temporary name and renamed whole, under
    the package's lock, so that processes starting together unpack it once and none loads half a
    file."""
    folder = package.with_suffix("")
    if found := _library_in(folder):
        return found
    with open(package.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        if found := _library_in(folder):  # unpacked by a process that held the lock before us
            return found
        tmp = folder.with_name(f"{folder.name}.{os.getpid()}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a process that died with our pid
        try:
            tmp.mkdir(parents=True)
            _unpack(package, tmp)
            os.rename(tmp, folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    found = _library_in(folder)
    if found is None:
        raise NativeUnavailable(f"no shared library unpacked in {folder}")
    return found


def _library_in(folder: Path) -> Path | None:
    libraries = sorted(folder.glob("*.so"))
    return libraries[0] if len(libraries) == 1 else None


def _unpack(package: Path, into: Path) -> None:
    """Write the package's library into ``into``, or say why the native path cannot run it: what
    torch's loader does besides loading the library (compile a package shipped as C++, load
    weights packaged with it, run custom operators through its proxy executor) is not done here."""
    with zipfile.ZipFile(package) as archive:
        files = {m.group(1): name for name in archive.namelist() if (m := _MODEL_FILE.search(name))}
        libraries = [f for f in files if f.endswith(".so")]
        if len(libraries) != 1:
            raise NativeUnavailable(f"{package.name} holds {len(libraries)} shared libraries, not one")
        library = libraries[0]
        if others := [f for f in files if f.endswith((".blob", ".o")) or f == library[:-3] + ".json"]:
            raise NativeUnavailable(f"{package.name} holds {others}: left to torch's loader")
        if any("/data/constants/" in f"/{name}" for name in archive.namelist()):
            raise NativeUnavailable(f"{package.name} holds packaged weights: left to torch's loader")
        metadata = [f for f in files if f.endswith("_metadata.json")]
        for name in metadata:
            device = json.loads(archive.read(files[name])).get("AOTI_DEVICE_KEY")
            if device != "cpu":
                raise NativeUnavailable(f"{package.name} is compiled for {device!r}, not the CPU")
        for name in (library, *metadata):
            with archive.open(files[name]) as src, open(into / name, "wb") as dst:
                shutil.copyfileobj(src, dst)
        (into / library).chmod(0o755)


# One loaded library per path (a path is loaded once by the dynamic linker anyway): its functions'
# signatures are declared once.
_libraries: dict[Path, ctypes.CDLL] = {}
_libraries_lock = threading.Lock()

_p = ctypes.c_void_p
_SIGNATURES: dict[str, list[Any]] = {
    "AOTInductorModelContainerCreateWithDevice": [
        ctypes.POINTER(_p),
        ctypes.c_size_t,
        ctypes.c_char_p,
        ctypes.c_char_p,
    ],
    "AOTInductorModelContainerDelete": [_p],
    "AOTInductorModelContainerGetNumConstants": [_p, ctypes.POINTER(ctypes.c_size_t)],
    "AOTInductorModelContainerGetConstantName": [_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_char_p)],
    "AOTInductorModelContainerGetConstantOriginalFQN": [_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_char_p)],
    "AOTInductorModelContainerGetNumInputs": [_p, ctypes.POINTER(ctypes.c_size_t)],
    "AOTInductorModelContainerGetNumOutputs": [_p, ctypes.POINTER(ctypes.c_size_t)],
    "AOTInductorModelContainerUpdateUserManagedConstantBufferPairs": [
        _p,
        _p,
        ctypes.c_size_t,
        ctypes.c_bool,
        ctypes.c_bool,
    ],
    "AOTInductorModelContainerRun": [_p, _p, ctypes.c_size_t, _p, ctypes.c_size_t, _p, _p],
}


def load(library: Path) -> ctypes.CDLL:
    """The library loaded (``ctypes.CDLL``: its calls release the GIL), its functions declared.
    Raises ``AttributeError`` where a function of the interface is missing (another torch)."""
    with _libraries_lock:
        if library not in _libraries:
            lib = ctypes.CDLL(str(library))
            for name, argtypes in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = argtypes, ctypes.c_int32
            _libraries[library] = lib
        return _libraries[library]


class _Entry(ctypes.Structure):
    """``AOTInductorConstantMapEntry``: a constant's name and the tensor handed for it."""

    _fields_ = [("name", ctypes.c_char_p), ("handle", _p)]


# Between a tensor and a handle (an ``at::Tensor*`` on the heap, ``AtenTensorHandle``): torch's
# own helpers pass them as capsules; the library takes and gives plain pointers.
_capi = ctypes.pythonapi
_capi.PyCapsule_GetPointer.argtypes, _capi.PyCapsule_GetPointer.restype = (
    [ctypes.py_object, ctypes.c_char_p],
    _p,
)
_capi.PyCapsule_New.argtypes, _capi.PyCapsule_New.restype = [_p, ctypes.c_char_p, _p], ctypes.py_object


def new_handles(tensors: Sequence[Tensor]) -> list[int]:
    """A new handle to each tensor (a reference: each must be given back, or stolen by a run)."""
    capsules = torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors(list(tensors))
    return [_capi.PyCapsule_GetPointer(c, None) for c in capsules]


def take_handles(handles: Sequence[int | None]) -> list[Tensor]:
    """The tensors of handles given to us (outputs, or our own), the handles freed."""
    return torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs(
        [_capi.PyCapsule_New(h, None, None) for h in handles]
    )


class NativeStep:
    """One model container of a package's library (``extract``), computing with ``tensors`` (the
    model's weights, by their original names) where they lie: called with the step's inputs, it
    returns its outputs, and runs without the GIL, so that decoding threads of one process step at
    once. Another ``NativeStep`` of the same library and tensors is another container (its own
    buffers), not another copy of the weights."""

    def __init__(self, library: Path, tensors: Mapping[str, Tensor]) -> None:
        self.library = library
        self._lib = load(library)
        self._container = _p()
        self._handles: list[int] = []
        self._check(
            self._lib.AOTInductorModelContainerCreateWithDevice(
                ctypes.byref(self._container), 1, b"cpu", None
            ),
            "create a model container",
        )
        self.inputs = self._count("AOTInductorModelContainerGetNumInputs")
        self.outputs = self._count("AOTInductorModelContainerGetNumOutputs")
        self._hand(tensors)

    def constants(self) -> dict[str, str]:
        """Each constant's name in the package, and its original (fully qualified) name."""
        lib, names = self._lib, {}
        for i in range(self._count("AOTInductorModelContainerGetNumConstants")):
            name, fqn = ctypes.c_char_p(), ctypes.c_char_p()
            self._check(
                lib.AOTInductorModelContainerGetConstantName(self._container, i, ctypes.byref(name)),
                "read a name",
            )
            self._check(
                lib.AOTInductorModelContainerGetConstantOriginalFQN(self._container, i, ctypes.byref(fqn)),
                "read a name",
            )
            names[(name.value or b"").decode()] = (fqn.value or b"").decode()
        return names

    def _hand(self, tensors: Mapping[str, Tensor]) -> None:
        """Hand the container a tensor for every constant (a full update, checked by the library),
        user-managed: it computes with them where they lie. Our handles, their names and the
        tensors stay alive as long as the container (freed by ``close``)."""
        names = self.constants()
        if lacking := set(names.values()) - tensors.keys():
            raise RuntimeError(f"the package wants tensors the model lacks: {sorted(lacking)}")
        self._names = [name.encode() for name in names]
        self._tensors = [tensors[fqn] for fqn in names.values()]
        self._handles = new_handles(self._tensors)
        self._pairs = (_Entry * len(names))(
            *(_Entry(name, handle) for name, handle in zip(self._names, self._handles, strict=True))
        )
        self._check(
            self._lib.AOTInductorModelContainerUpdateUserManagedConstantBufferPairs(
                self._container, self._pairs, len(names), False, True
            ),
            "hand the weights over",
        )

    def __call__(self, *args: Tensor) -> list[Tensor]:
        # Checked here: the library checks the counts outside its error handling (a C++ exception
        # through ctypes would end the process).
        if len(args) != self.inputs:
            raise ValueError(f"the step takes {self.inputs} inputs, not {len(args)}")
        if not self._container:
            raise RuntimeError("the step is closed")
        inputs = (_p * len(args))(*new_handles(args))  # stolen (and freed) by the run
        outputs = (_p * self.outputs)()
        # The GIL is released from here to the return (ctypes.CDLL).
        status = self._lib.AOTInductorModelContainerRun(
            self._container, inputs, len(args), outputs, self.outputs, None, None
        )
        self._check(status, "run the step")
        return take_handles(list(outputs))

    def close(self) -> None:
        """Delete the container, then give our handles to the weights back."""
        container, self._container = self._container, _p()
        if container:
            self._lib.AOTInductorModelContainerDelete(container)
        handles, self._handles = self._handles, []
        if handles:
            take_handles(handles)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # (at interpreter exit, ctypes may be gone)
            self.close()

    def _count(self, function: str) -> int:
        n = ctypes.c_size_t()
        self._check(getattr(self._lib, function)(self._container, ctypes.byref(n)), function)
        return n.value

    def _check(self, status: int, what: str) -> None:
        if status != _SUCCESS:
            raise RuntimeError(f"the compiled step failed to {what} (error {status}): {self._last_error()}")

    def _last_error(self) -> str:
        """The library's message for this thread's last failure (where its torch exports one)."""
        try:
            get = self._lib.AOTInductorGetLastError
        except AttributeError:
            return "no message"
        get.argtypes, get.restype = [ctypes.POINTER(ctypes.c_char_p)], ctypes.c_int32
        message = ctypes.c_char_p()
        get(ctypes.byref(message))
        return (message.value or b"").decode(errors="replace") or "no message"
