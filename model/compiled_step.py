"""The decoding step compiled ahead of time: one graph for every batch, kept on disk between starts.

``StaticStep`` (``model.static_step``) over ``StaticSlots`` is exported with ``torch.export``,
with the running batch's rows, cached positions, source positions and beam rows as symbolic sizes,
and compiled by AOTInductor into a shared library whose C++ wrapper calls the kernels (no Python
between them), packaged with the weights as one ``.pt2`` file. Why this way (BENCHMARKS.md,
"Compiled decoding step"):

- The weights are constants of the graph (``freezing``): TorchInductor then lays out every linear
  layer for oneDNN and fuses its bias, ReLU or residual addition into it. Without freezing a graph
  calls MKL's plain GEMM, which on our AMD EPYC took twice as long as oneDNN's packed one
  (the output projection at 32 rows: 3.5 vs 1.7 ms), so the compiled step was slower than eager.
- ``torch.compile`` with freezing cannot keep its graphs in TorchInductor's on-disk cache (it
  refuses to pickle oneDNN's packed weights): every start recompiled. A package is a file: once
  compiled, a start loads it in a fraction of a second.
- One graph serves every batch: the sizes are symbols (size-oblivious about 1, so one row needs no
  graph of its own), and greedy and beam inputs share a step (``beam_rows``).

The package's name is a digest of everything its code depends on: the weights, the model's
configuration and linear layers (float32 or int8), the capacity, the number of threads (the
kernels' parallel loops are sized when compiled), the CPU's instruction set (oneDNN's weight
layout depends on it), torch's version and the source of the modules that make the graph. Workers
starting together compile once: the first takes a lock, the others wait and load its file.
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

from model.static_slots import StaticSlots
from model.static_step import StaticStep, StepOutputs
from model.transformer import Transformer

log = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "nmt-service" / "compiled"
# The modules whose code is in the graph: a change to any of them makes a new package.
_SOURCES = (
    "compiled_step.py",
    "static_step.py",
    "static_slots.py",
    "layers.py",
    "transformer.py",
    "prepack.py",
    "search.py",
)


class CompiledDecoder:
    """The decoding step of one model: ``StaticStep``, compiled (``warm_up``) or run eagerly.

    Called as ``StaticSlots.decode``'s step function. ``compile=False`` runs the same module eagerly:
    the reference the compiled graph is tested against, and the fallback where compiling fails."""

    def __init__(
        self, model: Transformer, *, top: int, compile: bool = True, cache_dir: Path | None = None
    ) -> None:
        self.model = model
        self.top = top
        self.compiled = compile
        self.cache_dir = cache_dir or DEFAULT_CACHE_DIR
        self._step = StaticStep(model, top=top).eval()
        # The loaded package's runner (torch._C._aoti.AOTIModelPackageLoader): called with the flat
        # list of inputs, it returns the flat list of outputs (the package's own wrapper parses its
        # input and output specs again at every call).
        self._runner: Any = None
        self.ready = not compile
        self.compile_seconds = 0.0  # compiling (or loading, when cached) at start-up
        self.cached = False  # the package was on disk already
        self.capacity = 0  # rows of the running batches it serves (set by warm_up)

    def __call__(self, *args: Tensor) -> StepOutputs:
        if self._runner is None:
            assert not self.compiled, "warm_up() compiles the graph first"
            return self._step(*args)
        choice, top_tokens, top_lprobs, eos_lprob, new_kv = self._runner.run(args)
        return choice, top_tokens, top_lprobs, eos_lprob, new_kv

    @torch.inference_mode()
    def warm_up(self, capacity: int) -> float:
        """Compile the step for running batches of up to ``capacity`` rows (or load it from the
        cache), then take one greedy and one beam step, on one row and on two: the first call's
        lazy initialisation (oneDNN's kernels, thread pools) happens here. Returns the seconds it
        took."""
        started = time.perf_counter()
        self.capacity = capacity
        if self.compiled:
            path = self.cache_dir / f"step-{self.key(capacity)}.pt2"
            self.cached = path.exists()
            if not self.cached:
                self._compile(path, capacity)
            self._runner = torch._inductor.aoti_load_package(str(path)).loader
        for rows in (1, 2):
            slots = StaticSlots(self.model, capacity)
            slots.append(self.model.start_cache(self.model.encode(_source(rows, self.model)), capacity=1))
            tokens = torch.full((rows,), self.model.cfg.bos_id, dtype=torch.long)
            for beam_rows in (torch.zeros(1, dtype=torch.long), torch.arange(rows)):
                slots.decode(self, tokens, beam_rows)
        self.ready = True
        self.compile_seconds = time.perf_counter() - started
        log.info(
            "decoding step %s in %.1f s",
            "loaded" if self.cached else "compiled" if self.compiled else "ready (eager)",
            self.compile_seconds,
        )
        return self.compile_seconds

    def key(self, capacity: int) -> str:
        """The digest that names this step's package (see the module's docstring)."""
        m = self.model
        about = {
            "torch": torch.__version__,
            "isa": torch.backends.cpu.get_cpu_capability(),
            "cpu": _cpu_flags(),
            "threads": torch.get_num_threads(),
            "top": self.top,
            "capacity": capacity,
            "config": asdict(m.cfg),
            "dtype": str(m.embed.weight.dtype),
            "device": str(m.embed.weight.device),
            "modules": sorted({type(x).__name__ for x in m.modules()}),
        }
        h = hashlib.sha256(json.dumps(about, sort_keys=True).encode())
        here = Path(__file__).parent
        for name in _SOURCES:
            h.update((here / name).read_bytes())
        for name, t in sorted(m.state_dict().items()):
            h.update(name.encode())
            h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()[:24]

    def _compile(self, path: Path, capacity: int) -> None:
        """Export and compile the step into ``path``, unless another process did it meanwhile."""
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
            if path.exists():  # compiled by a process that held the lock before us
                self.cached = True
                return
            started = time.perf_counter()
            log.info("compiling the decoding step (once per model and settings; kept in %s)", path.parent)
            tmp = path.with_suffix(f".{os.getpid()}.tmp.pt2")  # (the name must end in .pt2)
            try:
                # Not in inference mode (export takes no inference tensors); freezing (weights as
                # constants) needs autograd off.
                with torch.inference_mode(False), torch.no_grad():
                    program = export(self._step, self.model, capacity)
                    torch._inductor.aoti_compile_and_package(
                        program, package_path=str(tmp), inductor_configs={"freezing": True}
                    )
                os.replace(tmp, path)  # whole or not at all: a reader never sees half a package
            finally:
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()
            log.info("decoding step compiled in %.1f s", time.perf_counter() - started)


def export(step: StaticStep, model: Transformer, capacity: int) -> torch.export.ExportedProgram:
    """``step`` as a graph over a running batch of 1 to ``capacity`` rows, 1 to ``max_positions``
    cached and source positions and 1 to ``capacity`` beam rows. The example inputs are views of
    real buffers (called outside inference mode: export takes no inference tensors): the graph's
    code is written for their strides."""
    positions = model.cfg.max_positions
    slots = StaticSlots(model, capacity)
    rows = min(3, capacity)  # an example; the sizes are symbols
    slots.append(model.start_cache(model.encode(_source(rows, model)), capacity=1))
    n, keys, width = rows, 16, slots.src_bias.size(3) - 16
    args = (
        torch.full((n,), model.cfg.bos_id, dtype=torch.long),
        slots.lengths[:n],
        slots.self_kv[:n, :, :, :, :keys],
        slots.cross_kv[:n, :, :, :, :width],
        slots.src_bias[:n, :, :, :width],
        torch.arange(min(2, n)),
    )
    dim = torch.export.Dim
    r, c, s = (
        dim("rows", min=1, max=capacity),
        dim("keys", min=1, max=positions),
        dim("src", min=1, max=positions),
    )
    shapes = (
        {0: r},
        {0: r},
        {0: r, 4: c},
        {0: r, 4: s},
        {0: r, 3: s},
        {0: dim("beam_rows", min=1, max=capacity)},
    )
    # Size-oblivious: a batch of one row is not a special case (else 1 would be specialized away).
    with torch.fx.experimental._config.patch(backed_size_oblivious=True):  # type: ignore[attr-defined]
        return torch.export.export(step, args, dynamic_shapes=shapes, strict=False)


def _source(rows: int, model: Transformer) -> Tensor:
    """A batch of ``rows`` short inputs (token 5 twice, then eos)."""
    src = torch.full((rows, 3), 5, dtype=torch.long)
    src[:, -1] = model.cfg.eos_id
    return src


def _cpu_flags() -> str:
    """The CPU's model and feature flags, as the kernel reports them (oneDNN picks its kernels and
    weight layouts by them)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    wanted = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    return hashlib.sha256("\n".join(wanted).encode()).hexdigest()[:16]
