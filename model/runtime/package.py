"""One module compiled by AOTInductor into a package kept on disk (CPU): the decoding step
(``model.runtime.runners.PackagedRunner``) and the encoder (``model.runtime.encoder``).

A package holds no weights: once loaded, it is handed the model's own tensors by name
(user-managed: not copied), so a worker keeps one copy of each weight, and one package serves
every model of the same architecture. It is called through its library's own C interface
(``model.runtime.native``), without the GIL, so that the decoding threads of one process run at
once; where that fails, through torch's binding of the package, which holds the GIL (``native``
turns False).

A package's name is its kind and a digest of everything its graph depends on, the weights' values
excepted: the configuration and linear layers (float32 or int8), the names, shapes and types of
the tensors it is handed, the cache's capacity and positions, the number of threads (the kernels'
parallel loops are sized when compiled), the CPU's instruction set (oneDNN's weight layout depends
on it), torch's version and the source of the modules that make the graph. A second model of the
same architecture compiles nothing. Processes starting together compile once: the first takes a
lock, the others wait and load its file.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from model.runtime import builds
from model.runtime.native import NativeStep, extract
from model.runtime.prepack import ACT_ZERO
from model.transformer import Transformer

log = logging.getLogger(__name__)

_MODEL = Path(__file__).parent.parent
# The modules whose code makes every package's graph: a change to any of them makes new packages.
SOURCES = (
    _MODEL / "layers.py",
    _MODEL / "transformer.py",
    _MODEL / "cache.py",
    _MODEL / "runtime" / "prepack.py",
    _MODEL / "runtime" / "int8mm.py",
    _MODEL / "runtime" / "package.py",
)


class Package:
    """``module`` as an AOTInductor package: compiled once per architecture and settings into
    ``<kind>-<key>.pt2``, or loaded, then handed the model's weights. A subclass says what it is
    (``kind``), how it is exported (``export``), what else its graph depends on (``about``,
    ``sources``), and how its outputs are read (its ``__call__``, over ``run``)."""

    kind = "compiled"
    name = "package"  # the file's prefix, and what the logs call it
    sources: tuple[Path, ...] = SOURCES

    def __init__(self, module: nn.Module, model: Transformer, *, native: bool = True) -> None:
        self.module, self.model = module, model
        self.native = native
        self.package: Path | None = None  # the .pt2 file, once prepared
        # One of the two, once prepared. The native container; or the loaded package's runner
        # (torch._C._aoti.AOTIModelPackageLoader): called with the flat list of inputs, it returns
        # the flat list of outputs (as the native one does: the input and output specs are
        # handled by the Python wrapper, AOTICompiledModel, which neither goes through), holding
        # the GIL.
        self._native: NativeStep | None = None
        self._loader: Any = None
        self.cached = False  # the package was on disk already
        self.compile_seconds = 0.0

    def export(self) -> torch.export.ExportedProgram:
        """The module as a graph whose sizes are symbols (called outside inference mode)."""
        raise NotImplementedError

    def about(self) -> dict[str, Any]:
        """What else the graph depends on, beyond what every package's key names."""
        return {}

    def inductor_configs(self) -> dict[str, Any]:
        """TorchInductor's settings for this package, beyond every package's."""
        return {}

    def run(self, args: tuple[Tensor, ...]) -> list[Tensor]:
        """The package's outputs, flat, for its inputs, flat."""
        return self._native(*args) if self._native is not None else self._loader.run(args)

    def path(self, cache_dir: Path) -> Path:
        """Where the package is kept in ``cache_dir``."""
        return cache_dir / f"{self.name}-{self.key()}.pt2"

    def prepare(self, cache_dir: Path) -> None:
        """Compile the package into ``cache_dir`` unless it is there, and load it."""
        path = self.path(cache_dir)
        self.cached = path.exists()
        if not self.cached:
            self._compile(path)
        self._load(path)

    def load_twin(self, twin: Package) -> None:
        """Load this package into ``twin`` (the same module, a container of its own): nothing
        compiled, nothing copied."""
        assert self.package is not None, "prepare the package first"
        twin.cached = True
        twin._load(self.package)
        twin.compile_seconds = self.compile_seconds  # what making it took, once

    def _load(self, path: Path) -> None:
        """Load the package at ``path`` and hand it the model's weights: natively where it can."""
        self.package = path
        # The model's own tensors, by the names the graph was exported with (user-managed: the
        # package computes with them where they lie, nothing copied), and the scalars the lowering
        # made constants of.
        tensors = {**self.tensors(), **self._scalars}
        if self.native:
            try:
                self._native = NativeStep(extract(path), tensors)
                return
            except Exception as e:  # the native path is an optimization: torch's loader runs it too
                self.native = False
                _warn_native_failed(e)
        self._loader = self._torch_loader(path, tensors)

    @staticmethod
    def _torch_loader(path: Path, tensors: dict[str, Tensor]) -> Any:
        """The package loaded by torch's own loader and handed ``tensors``: the C++ loader itself,
        not ``torch._inductor.aoti_load_package``, which imports TorchInductor (and sympy): 86 MiB
        more in a worker that compiles nothing."""
        loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
        wanted = loader.get_constant_fqns()  # the original name of each constant, repeats included
        if lacking := set(wanted) - tensors.keys():
            raise RuntimeError(f"the package wants tensors the model lacks: {sorted(lacking)}")
        # Handed over by the constants' own names (the lowering's scalars share an original name,
        # so that one name cannot reach them all); a full update, checked by the package.
        loader.update_constant_buffer(
            {name: tensors[fqn] for name, fqn in constant_names(wanted).items()}, False, True, True
        )
        return loader

    # Scalars that TorchInductor's oneDNN lowering (torch/_inductor/mkldnn_lowerings.py) turns into
    # constants of the graph, under these names: an int8 layer's activation scale (1: each row's
    # own scale is applied after the product) and zero point.
    _scalars = {"x_scale": torch.tensor(1.0), "x_zp": torch.tensor(ACT_ZERO, dtype=torch.int32)}

    def tensors(self) -> dict[str, Tensor]:
        """The module's parameters and buffers by name (tied ones under each name): what its
        package computes with."""
        return {
            **dict(self.module.named_parameters(remove_duplicate=False)),
            **dict(self.module.named_buffers(remove_duplicate=False)),
        }

    def key(self) -> str:
        """The digest that names this package (see the module's docstring)."""
        m = self.model
        about = {
            "torch": torch.__version__,
            "isa": torch.backends.cpu.get_cpu_capability(),
            "cpu": cpu_digest(),
            "threads": torch.get_num_threads(),
            "config": asdict(m.cfg),
            "dtype": str(m.dtype),
            "device": str(m.device),
            "modules": sorted({type(x).__name__ for x in m.modules()}),
            **self.about(),
        }
        # What the graph is handed, not the values: a model of the same architecture shares it.
        about["tensors"] = [
            [name, list(t.shape), str(t.dtype), str(t.layout)] for name, t in sorted(self.tensors().items())
        ]
        h = hashlib.sha256(json.dumps(about, sort_keys=True).encode())
        for path in self.sources:
            h.update(path.read_bytes())
        return h.hexdigest()[:24]

    def _compile(self, path: Path) -> None:
        """Export and compile the module into ``path``, unless another process did it meanwhile."""
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
            if path.exists():  # compiled by a process that held the lock before us
                self.cached = True
                return
            started = time.perf_counter()
            log.info(
                "compiling the %s (once per architecture and settings; kept in %s)", self.name, path.parent
            )
            tmp = path.with_suffix(f".{os.getpid()}.tmp.pt2")  # (the name must end in .pt2)
            try:
                # Not in inference mode (export takes no inference tensors). No weights in the
                # package: the model's own are handed to it when loaded (``prepare``).
                # (``builds``: what shortens a first compile.)
                probing = builds.probe_isa_beside()
                with torch.inference_mode(False), torch.no_grad():
                    program = self.export()
                    with builds.side_by_side():
                        torch._inductor.aoti_compile_and_package(
                            program,
                            package_path=str(tmp),
                            inductor_configs={
                                "aot_inductor.package_constants_in_so": False,
                                **builds.CONFIGS,
                                **self.inductor_configs(),
                            },
                        )
                probing.join()
                os.replace(tmp, path)  # whole or not at all: a reader never sees half a package
            finally:
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()
            log.info("%s compiled in %.1f s", self.name, time.perf_counter() - started)


_native_warned = False


def _warn_native_failed(error: Exception) -> None:
    """Say once per process that packages run through torch's binding (holding the GIL)."""
    global _native_warned
    if not _native_warned:
        _native_warned = True
        log.warning(
            "a compiled package's library could not be called directly (%s: %s): running it through"
            " torch's binding, which holds the GIL (decoding threads of this process take turns)",
            type(error).__name__,
            error,
        )


def constant_names(fqns: list[str]) -> dict[str, str]:
    """Each constant's name in an AOTInductor package, from the original names (fully qualified,
    one per constant) that ``get_constant_fqns`` lists: a parameter's is its dotted name with
    underscores; the lowering's scalars (``Package._scalars``), one per int8 layer, are named
    ``x_scale``, ``x_scale_0``, ``x_scale_1``... (TorchInductor's ``add_tensor_constant``); they all
    hold the same value, so which of them is which does not matter."""
    names: dict[str, str] = {}
    repeats: dict[str, int] = {}
    for fqn in fqns:
        if fqn in Package._scalars:
            k = repeats[fqn] = repeats.get(fqn, -1) + 1
            names[fqn if k == 0 else f"{fqn}_{k - 1}"] = fqn
        else:
            names[fqn.replace(".", "_")] = fqn
    return names


def cpu_digest() -> str:
    """The CPU's model and feature flags, as the kernel reports them (oneDNN picks its kernels and
    weight layouts by them)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    wanted = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    return hashlib.sha256("\n".join(wanted).encode()).hexdigest()[:16]
