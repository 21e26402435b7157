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

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from model.cache import KVCache
from model.layers import KEY_ALIGN
from model.runtime import DEFAULT_CACHE_DIR, int8mm, kvrows, shims
from model.runtime.encoder import CompiledEncoder, encode_eagerly
from model.runtime.graphs import GraphRunner
from model.runtime.package import SOURCES, Package
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
        kernels=kvrows.kernels(),  # (on the CPU, where loaded: ``load_runner`` builds them)
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

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        """``StepRunner.encode``: the model's own modules."""
        return encode_eagerly(self.step.model, src)

    def sibling(self) -> EagerRunner:
        """Another runner of the step for another thread (the module keeps no state between calls)."""
        return EagerRunner(self.step)


class PackagedRunner(FreshCaches, Package):
    """The step as an AOTInductor package (CPU, ``model.runtime.package``): compiled once per
    architecture and settings, or loaded, then handed the model's weights; with the encoder's own
    package beside it (``encoder``: ``model.runtime.encoder``), where that could be made.

    ``native`` (the default): the package's library called through its C interface, without the
    GIL (``model.runtime.native.NativeStep``); where that fails (another torch, a package holding
    what it does not handle), torch's binding of the package, and ``native`` turns False."""

    name = "step"
    align = 1  # the generated kernels sum in an order that does not depend on the keys read
    sources = (*SOURCES, _MODEL / "runtime" / "step.py", _MODEL / "runtime" / "runners.py")

    def __init__(self, step: DecodeStep, *, capacity: int, positions: int, native: bool = True) -> None:
        Package.__init__(self, step, step.model, native=native)
        self.step = step
        self.capacity, self.positions = capacity, positions
        # The encoder's package, shared with the siblings (set by ``load_runner``; None: eager).
        self.encoder: CompiledEncoder | None = None

    def __call__(self, *args: Tensor) -> StepOutputs:
        choice, top_tokens, top_lprobs, eos_lprob, new_kv, forced_lprobs = self.run(args)
        return choice, top_tokens, top_lprobs, eos_lprob, new_kv, forced_lprobs

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        """``StepRunner.encode``: the encoder's package once it is made, else the eager encoder
        (the same bits)."""
        if self.encoder is not None:
            return self.encoder(src)
        return encode_eagerly(self.step.model, src)

    def export(self) -> torch.export.ExportedProgram:
        return export(self.step, capacity=self.capacity, positions=self.positions)

    def about(self) -> dict[str, Any]:
        about: dict[str, Any] = {"top": self.step.top, "capacity": self.capacity, "positions": self.positions}
        if self._calls_shims():
            about["shims"] = shims.digest()
        return about

    def inductor_configs(self) -> dict[str, Any]:
        # Our int8 kernel called through its C shim (``model.runtime.shims``), without Python.
        return shims.inductor_configs() if self._calls_shims() else {}

    def prepare(self, cache_dir: Path) -> None:
        """``Package.prepare``; where the step calls our int8 kernel, the shims' library (its C
        shim) is built meanwhile, on a thread of its own, and loaded before the package."""
        if not self._calls_shims():
            return Package.prepare(self, cache_dir)
        path, library = self.path(cache_dir), shims.path(cache_dir)
        if path.exists() and library.exists():  # (nothing to build: TorchInductor not imported)
            self.cached = True
            shims.load(library)
            return self._load(path)
        shims.compiler()  # (imports TorchInductor's builder here: two threads importing it collide)
        with ThreadPoolExecutor(1, thread_name_prefix="shims") as pool:
            building = pool.submit(shims.library, cache_dir)
            self.cached = path.exists()
            if not self.cached:
                self._compile(path)
            shims.load(building.result())  # (RuntimeError where it cannot be built: decoding eagerly)
        self._load(path)

    def _calls_shims(self) -> bool:
        """Whether the step's int8 layers run our kernel (the shims' library is then loaded)."""
        return int8mm.runs_ours(self.step.model)

    def sibling(self) -> PackagedRunner:
        """Another runner of this step for another thread: the same package (nothing compiled) in
        a container of its own, handed the same weights (nothing copied), warmed up; the same
        encoder (one call at a time). Two threads stepping one runner would take turns for its
        one container."""
        twin = PackagedRunner(self.step, capacity=self.capacity, positions=self.positions, native=self.native)
        self.load_twin(twin)
        twin.encoder = self.encoder
        warm_up(twin, self.step.model, capacity=self.capacity, positions=self.positions)
        return twin


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
    compile_encoder: bool = True,
) -> Runner:
    """The step of ``model`` for a cache of ``capacity`` rows and ``positions`` positions, ready to
    call: compiled where ``compile`` and the device allow (a package on CPU, CUDA graphs on CUDA),
    eager otherwise or when compiling fails (no C++ compiler, an unwritable cache...: slower,
    but decoding; ``runner.kind`` says which). Warmed up: greedy and beam steps on one row and on
    two (where the cache holds two), with two forced tokens per beam row and with three (decoding
    passes at least two), so that lazy initialisation (kernels, thread pools, compilation:
    ``torch.compile`` specializes a size of 1 and compiles again for larger ones) happens here.
    ``compile_encoder``: with a compiled CPU step, the encoder compiled too (``runner.encode``;
    ``model.runtime.encoder``): loaded where it was made before, else made in the background, the
    eager encoder serving meanwhile (the same bits)."""
    started = time.perf_counter()
    step = DecodeStep(model, top=top).eval()
    cache_dir = cache_dir or DEFAULT_CACHE_DIR
    runner: Runner = EagerRunner(step)
    device = model.device.type
    if device == "cpu" and kvrows.kernels() is None:
        kvrows.ensure_beside(cache_dir)  # (the caches made after it is built copy rows in C)
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
            # The encoder first: where it is not made yet, its process compiles it beside the
            # step (on another core) instead of after it: on a first start at OPUS-MT size, made
            # ~7 s after ready instead of ~28 s (2-vCPU AMD EPYC, avx512_vnni), ready no later.
            if isinstance(compiled, PackagedRunner) and compile_encoder:
                compiled.encoder = CompiledEncoder(
                    model, rows=capacity, positions=positions, cache_dir=cache_dir
                )
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
        cache = _example_cache(
            model, rows, capacity=capacity, positions=positions, align=runner.align, runner=runner
        )
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
    rows = min(3, capacity)  # an example; the sizes are symbols (the rows read fewer sources)
    beams = [rows - 1, 1] if rows > 2 else None
    cache = _example_cache(model, rows, capacity=capacity, positions=positions, beams=beams)
    n, m, keys, width = rows, cache.slots, 16, min(positions, cache.src_bias.size(3) - 16)
    args = (
        torch.full((n,), model.cfg.bos_id, dtype=torch.long),
        cache.lengths[:n],
        cache.self_kv[:n, :, :, :, :keys],
        cache.cross_kv[:m, :, :, :, :width],
        cache.src_bias[:m, :, :, :width],
        cache.sources[:n],
        torch.arange(min(2, n)),
        torch.full((min(2, n), 2), model.cfg.eos_id, dtype=torch.long),
    )
    dim = torch.export.Dim
    r, c, s, u = (
        dim("rows", min=1, max=capacity),
        dim("keys", min=1, max=positions),
        dim("src", min=1, max=positions),
        dim("sources", min=1, max=capacity),
    )
    b = dim("beam_rows", min=1, max=capacity)
    shapes = (
        {0: r},
        {0: r},
        {0: r, 4: c},
        {0: u, 4: s},
        {0: u, 3: s},
        {0: r},
        {0: b},
        {0: b, 1: dim("forced", min=1, max=model.cfg.vocab_size)},
    )
    # Size-oblivious: a batch of one row is not a special case (else 1 would be specialized away).
    with torch.fx.experimental._config.patch(backed_size_oblivious=True):  # type: ignore[attr-defined]
        return torch.export.export(step, args, dynamic_shapes=shapes, strict=False)


def _example_cache(
    model: Transformer,
    rows: int,
    *,
    capacity: int,
    positions: int,
    align: int = 1,
    runner: Runner | None = None,
    beams: list[int] | None = None,
) -> KVCache:
    """A cache holding ``rows`` rows of short inputs (token 5 twice, then eos), encoded by
    ``runner``'s encoder (default: the model's own): an input a row, or ``beams[i]`` rows of input
    i."""
    beams = beams or [1] * rows
    src = torch.full((len(beams), 3), 5, dtype=torch.long, device=model.device)
    src[:, -1] = model.cfg.eos_id
    cache = new_cache(model, capacity=capacity, positions=positions, align=align)
    cache.append(*(runner.encode(src) if runner is not None else encode_eagerly(model, src)), beams)
    return cache
