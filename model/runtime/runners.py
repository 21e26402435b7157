"""Step runners: ``DecodeStep`` run eagerly or compiled, behind one signature (``StepRunner``).

``load_runner`` picks one when a model is loaded, and callers never branch on which they hold:

- ``EagerRunner``: the module itself. The reference every compiled runner is tested against, and
  the fallback wherever compiling fails.
- ``PackagedRunner`` (CPU): the step exported with ``torch.export``, the running batch's rows,
  cached positions, source positions and beam rows as symbolic sizes, compiled by AOTInductor into
  a shared library whose C++ wrapper calls the kernels (no Python between them), kept on disk
  between starts as one ``.pt2`` file. The package holds no weights: once loaded, it is handed the
  model's own tensors by name (user-managed: not copied), so a worker keeps one copy of each
  weight, and one package serves every model of the same architecture. The linear layers call
  oneDNN on the weights ``model.runtime.prepack`` laid out (float32 or int8), as the eager step
  does. The library is called through its own C interface (``model.runtime.native``), which runs
  the step without the GIL, so that the decoding threads of one process step at once; where that
  fails, through torch's binding of the package, which holds the GIL (``PackagedRunner.native``).
- ``GraphRunner`` (CUDA, ``model.runtime.graphs``): the eager step captured as CUDA graphs, one per
  bucket of rows and positions, replayed with one launch (``torch.compile`` was tried there first:
  76 s to compile the first shape, and slower than eager float32 at 256 rows on an H100).

A package's name is a digest of everything its graph depends on, the weights' values excepted: the
configuration and linear layers (float32 or int8), the names, shapes and types of the tensors it
is handed, the cache's capacity and positions (the graph's code is written for the cache's
strides), the number of threads (the kernels' parallel loops are sized when compiled), the CPU's
instruction set (oneDNN's weight layout depends on it), torch's version and the source of the
modules that make the graph (not the search's bookkeeping: editing it recompiles nothing). A second
model of the same architecture compiles nothing. Workers starting together compile once: the
first takes a lock, the others wait and load its file.
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
from torch import Tensor

from model.cache import KVCache
from model.layers import KEY_ALIGN
from model.runtime import DEFAULT_CACHE_DIR
from model.runtime.graphs import GraphRunner
from model.runtime.native import NativeStep, extract
from model.runtime.prepack import ACT_ZERO
from model.runtime.step import DecodeStep, StepOutputs
from model.transformer import Transformer

log = logging.getLogger(__name__)

# The torch releases (major.minor) the CPU package was tested under. Loading an AOTInductor package
# is native code: under torch 2.11 (a GPU machine's own torch) ``aoti_load_package`` crashed the
# process with a segmentation fault, which no ``except`` catches. Under any other release the CPU
# step runs eagerly, and says why.
PACKAGED_TORCH = ("2.13",)


def packaged_runs_under(version: str) -> bool:
    """Whether the CPU step may be compiled into a package under torch ``version``."""
    return ".".join(version.split("+")[0].split(".")[:2]) in PACKAGED_TORCH


_MODEL = Path(__file__).parent.parent
# The modules whose code makes the graph: a change to any of them makes a new package.
_SOURCES = (
    _MODEL / "layers.py",
    _MODEL / "transformer.py",
    _MODEL / "cache.py",
    _MODEL / "runtime" / "step.py",
    _MODEL / "runtime" / "prepack.py",
    _MODEL / "runtime" / "runners.py",
)


class FreshCaches:
    """``StepRunner.new_cache`` for runners that read whatever cache they are handed: a new one."""

    step: DecodeStep
    align: int

    def new_cache(self, *, capacity: int, positions: int) -> KVCache:
        return new_cache(self.step.model, capacity=capacity, positions=positions, align=self.align)


def new_cache(model: Transformer, *, capacity: int, positions: int, align: int = 1) -> KVCache:
    """An empty cache for ``model``, in its weights' dtype and on their device."""
    return KVCache(
        model.cfg,
        capacity=capacity,
        positions=positions,
        dtype=model.dtype,
        device=model.device,
        align=align,
    )


class EagerRunner(FreshCaches):
    """``DecodeStep`` called as it is."""

    kind = "eager"
    # torch's eager kernels sum an axis in chunks that depend on its length: reading keys in whole
    # multiples of KEY_ALIGN keeps a row's bits independent of its neighbours' lengths.
    align = KEY_ALIGN

    def __init__(self, step: DecodeStep) -> None:
        self.step = step
        self.compile_seconds = 0.0

    def __call__(self, *args: Tensor) -> StepOutputs:
        return self.step(*args)

    def prepare(self, cache_dir: Path) -> None:
        """Nothing to compile."""

    def sibling(self) -> EagerRunner:
        """Another runner of the step for another thread (the module keeps no state between calls)."""
        return EagerRunner(self.step)


class PackagedRunner(FreshCaches):
    """The step as an AOTInductor package (CPU): compiled once per architecture and settings, or
    loaded, then handed the model's weights.

    ``native`` (the default): the package's library called through its C interface, without the
    GIL (``model.runtime.native.NativeStep``); where that fails (another torch, a package holding
    what it does not handle), torch's binding of the package, and ``native`` turns False."""

    kind = "compiled"
    align = 1  # the generated kernels sum in an order that does not depend on the keys read

    def __init__(self, step: DecodeStep, *, capacity: int, positions: int, native: bool = True) -> None:
        self.step = step
        self.capacity, self.positions = capacity, positions
        self.native = native
        self.package: Path | None = None  # the .pt2 file, once prepared
        # One of the two, once prepared. The native step; or the loaded package's runner
        # (torch._C._aoti.AOTIModelPackageLoader): called with the flat list of inputs, it returns
        # the flat list of outputs (as the native step does: the input and output specs are
        # handled by the Python wrapper, AOTICompiledModel, which neither goes through), holding
        # the GIL.
        self._native: NativeStep | None = None
        self._loader: Any = None
        self.cached = False  # the package was on disk already
        self.compile_seconds = 0.0

    def __call__(self, *args: Tensor) -> StepOutputs:
        outputs = self._native(*args) if self._native is not None else self._loader.run(args)
        choice, top_tokens, top_lprobs, eos_lprob, new_kv, forced_lprobs = outputs
        return choice, top_tokens, top_lprobs, eos_lprob, new_kv, forced_lprobs

    def prepare(self, cache_dir: Path) -> None:
        path = cache_dir / f"step-{self.key()}.pt2"
        self.cached = path.exists()
        if not self.cached:
            self._compile(path)
        self._load(path)

    def sibling(self) -> PackagedRunner:
        """Another runner of this step for another thread: the same package (nothing compiled) in
        a container of its own, handed the same weights (nothing copied), warmed up. Two threads
        stepping one runner would take turns for its one container."""
        assert self.package is not None, "prepare the runner first"
        twin = PackagedRunner(self.step, capacity=self.capacity, positions=self.positions, native=self.native)
        twin.cached = True
        twin._load(self.package)
        warm_up(twin, self.step.model, capacity=self.capacity, positions=self.positions)
        twin.compile_seconds = self.compile_seconds  # what making this model's step took, once
        return twin

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
            except Exception as e:  # the native path is an optimization: torch's loader decodes too
                self.native = False
                _warn_native_failed(e)
        self._loader = self._torch_loader(path, tensors)

    @staticmethod
    def _torch_loader(path: Path, tensors: dict[str, Tensor]) -> Any:
        """The package loaded by torch's own loader and handed ``tensors``."""
        loader = torch._inductor.aoti_load_package(str(path)).loader
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
        """The step's parameters and buffers by name (tied ones under each name): what its package
        computes with."""
        return {
            **dict(self.step.named_parameters(remove_duplicate=False)),
            **dict(self.step.named_buffers(remove_duplicate=False)),
        }

    def key(self) -> str:
        """The digest that names this step's package (see the module's docstring)."""
        m = self.step.model
        about = {
            "torch": torch.__version__,
            "isa": torch.backends.cpu.get_cpu_capability(),
            "cpu": cpu_digest(),
            "threads": torch.get_num_threads(),
            "top": self.step.top,
            "capacity": self.capacity,
            "positions": self.positions,
            "config": asdict(m.cfg),
            "dtype": str(m.dtype),
            "device": str(m.device),
            "modules": sorted({type(x).__name__ for x in m.modules()}),
        }
        # What the graph is handed, not the values: a model of the same architecture shares it.
        about["tensors"] = [
            [name, list(t.shape), str(t.dtype), str(t.layout)] for name, t in sorted(self.tensors().items())
        ]
        h = hashlib.sha256(json.dumps(about, sort_keys=True).encode())
        for path in _SOURCES:
            h.update(path.read_bytes())
        return h.hexdigest()[:24]

    def _compile(self, path: Path) -> None:
        """Export and compile the step into ``path``, unless another process did it meanwhile."""
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
            if path.exists():  # compiled by a process that held the lock before us
                self.cached = True
                return
            started = time.perf_counter()
            log.info(
                "compiling the decoding step (once per architecture and settings; kept in %s)", path.parent
            )
            tmp = path.with_suffix(f".{os.getpid()}.tmp.pt2")  # (the name must end in .pt2)
            try:
                # Not in inference mode (export takes no inference tensors). No weights in the
                # package: the model's own are handed to it when loaded (``prepare``).
                with torch.inference_mode(False), torch.no_grad():
                    program = export(self.step, capacity=self.capacity, positions=self.positions)
                    torch._inductor.aoti_compile_and_package(
                        program,
                        package_path=str(tmp),
                        inductor_configs={"aot_inductor.package_constants_in_so": False},
                    )
                os.replace(tmp, path)  # whole or not at all: a reader never sees half a package
            finally:
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()
            log.info("decoding step compiled in %.1f s", time.perf_counter() - started)


_native_warned = False


def _warn_native_failed(error: Exception) -> None:
    """Say once per process that the step runs through torch's binding (holding the GIL)."""
    global _native_warned
    if not _native_warned:
        _native_warned = True
        log.warning(
            "the compiled step's library could not be called directly (%s: %s): running it through"
            " torch's binding, which holds the GIL (decoding threads of this process take turns)",
            type(error).__name__,
            error,
        )


Runner = EagerRunner | PackagedRunner | GraphRunner


def load_runner(
    model: Transformer,
    *,
    top: int,
    capacity: int,
    positions: int,
    compile: bool = True,
    cache_dir: Path | None = None,
    release_gil: bool = True,
) -> Runner:
    """The step of ``model`` for a cache of ``capacity`` rows and ``positions`` positions, ready to
    call: compiled where ``compile`` and the device allow (a package on CPU, CUDA graphs on CUDA),
    eager otherwise or when compiling fails (no C++ compiler, an unwritable cache...: slower,
    but decoding; ``runner.kind`` says which). Warmed up: greedy and beam steps on one row and on
    two (where the cache holds two), with two forced tokens per beam row and with three (decoding
    passes at least two), so that lazy initialisation (kernels, thread pools, compilation:
    ``torch.compile`` specializes a size of 1 and compiles again for larger ones) happens here."""
    started = time.perf_counter()
    step = DecodeStep(model, top=top).eval()
    cache_dir = cache_dir or DEFAULT_CACHE_DIR
    runner: Runner = EagerRunner(step)
    device = model.device.type
    if compile and device == "cpu" and not packaged_runs_under(torch.__version__):
        log.warning(
            "the compiled CPU step is tested under torch %s only, not %s: decoding eagerly",
            " and ".join(PACKAGED_TORCH),
            torch.__version__,
        )
        compile = False
    if compile:
        compiled: Runner = (
            PackagedRunner(step, capacity=capacity, positions=positions, native=release_gil)
            if device == "cpu"
            else GraphRunner(step, capture=device == "cuda")
        )
        # Where TorchInductor builds (and caches the pieces of) what it compiles, for either runner.
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir / "inductor"))
        try:
            compiled.prepare(cache_dir)
            warm_up(compiled, model, capacity=capacity, positions=positions)
            runner = compiled
        except Exception:
            log.exception("compiling the decoding step failed; decoding eagerly")
    if runner.kind == "eager":
        warm_up(runner, model, capacity=capacity, positions=positions)
    elapsed = time.perf_counter() - started
    # What compiling took (0 for the eager step: its warm-up is not a compile, and under load it
    # took a tenth of a second that /info reported as compiling).
    runner.compile_seconds = 0.0 if runner.kind == "eager" else elapsed
    log.info("decoding step ready (%s) in %.1f s", runner.kind, elapsed)
    return runner


@torch.inference_mode()
def warm_up(runner: Runner, model: Transformer, *, capacity: int, positions: int) -> None:
    for rows in sorted({1, min(2, capacity)}):
        cache = _example_cache(model, rows, capacity=capacity, positions=positions, align=runner.align)
        tokens = torch.full((rows,), model.cfg.bos_id, dtype=torch.long, device=cache.lengths.device)
        for beam_rows in (torch.zeros(1, dtype=torch.long), torch.arange(rows)):
            for width in (2, 3):
                forced = torch.full((len(beam_rows), width), model.cfg.eos_id, dtype=torch.long)
                out = runner(tokens, *cache.views(), beam_rows.to(tokens.device), forced.to(tokens.device))
                cache.advance(out[4])


def export(step: DecodeStep, *, capacity: int, positions: int) -> torch.export.ExportedProgram:
    """``step`` as a graph over 1 to ``capacity`` rows, 1 to ``positions`` cached and source
    positions, 1 to ``capacity`` beam rows and 1 to ``vocab_size`` forced tokens per beam row (any
    width: a constrained input forces up to one token per constraint). The example inputs are
    views of a real cache (called outside inference mode: export takes no inference tensors): the
    graph's code is written for their strides."""
    model = step.model
    rows = min(3, capacity)  # an example; the sizes are symbols
    cache = _example_cache(model, rows, capacity=capacity, positions=positions)
    n, keys, width = rows, 16, min(positions, cache.src_bias.size(3) - 16)
    args = (
        torch.full((n,), model.cfg.bos_id, dtype=torch.long),
        cache.lengths[:n],
        cache.self_kv[:n, :, :, :, :keys],
        cache.cross_kv[:n, :, :, :, :width],
        cache.src_bias[:n, :, :, :width],
        torch.arange(min(2, n)),
        torch.full((min(2, n), 2), model.cfg.eos_id, dtype=torch.long),
    )
    dim = torch.export.Dim
    r, c, s = (
        dim("rows", min=1, max=capacity),
        dim("keys", min=1, max=positions),
        dim("src", min=1, max=positions),
    )
    b = dim("beam_rows", min=1, max=capacity)
    shapes = (
        {0: r},
        {0: r},
        {0: r, 4: c},
        {0: r, 4: s},
        {0: r, 3: s},
        {0: b},
        {0: b, 1: dim("forced", min=1, max=model.cfg.vocab_size)},
    )
    # Size-oblivious: a batch of one row is not a special case (else 1 would be specialized away).
    with torch.fx.experimental._config.patch(backed_size_oblivious=True):  # type: ignore[attr-defined]
        return torch.export.export(step, args, dynamic_shapes=shapes, strict=False)


def constant_names(fqns: list[str]) -> dict[str, str]:
    """Each constant's name in an AOTInductor package, from the original names (fully qualified,
    one per constant) that ``get_constant_fqns`` lists: a parameter's is its dotted name with
    underscores; the lowering's scalars (``PackagedRunner._scalars``), one per int8 layer, are named
    ``x_scale``, ``x_scale_0``, ``x_scale_1``... (TorchInductor's ``add_tensor_constant``); they all
    hold the same value, so which of them is which does not matter."""
    names: dict[str, str] = {}
    repeats: dict[str, int] = {}
    for fqn in fqns:
        if fqn in PackagedRunner._scalars:
            k = repeats[fqn] = repeats.get(fqn, -1) + 1
            names[fqn if k == 0 else f"{fqn}_{k - 1}"] = fqn
        else:
            names[fqn.replace(".", "_")] = fqn
    return names


def _example_cache(
    model: Transformer, rows: int, *, capacity: int, positions: int, align: int = 1
) -> KVCache:
    """A cache holding ``rows`` short inputs (token 5 twice, then eos)."""
    src = torch.full((rows, 3), 5, dtype=torch.long, device=model.device)
    src[:, -1] = model.cfg.eos_id
    enc = model.encode(src)
    cache = new_cache(model, capacity=capacity, positions=positions, align=align)
    cache.append(model.source_kv(enc), enc.src_mask)
    return cache


def cpu_digest() -> str:
    """The CPU's model and feature flags, as the kernel reports them (oneDNN picks its kernels and
    weight layouts by them)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    wanted = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    return hashlib.sha256("\n".join(wanted).encode()).hexdigest()[:16]
