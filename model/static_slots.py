"""The running batch at a fixed capacity, decoded by one compiled graph (``model.static_step``).

``StaticSlots`` is ``model.cache.CacheSlots`` for the compiled step: buffers allocated once at their
full capacity (rows: the largest batch; positions and source positions: the model's
``max_positions``), row-major (R, L, 2, H, C, Dh), so that a step's view of the first ``rows``
rows and first ``C`` positions has the same strides whatever those counts are. The step's graph is
compiled with those three sizes as symbols (``torch._dynamo.mark_dynamic``): one graph serves every
batch size and length, no bucket wastes work on padding rows or positions, and no shape change
recompiles (the compiler is told to fail rather than recompile once warmed up). Positions are read
in multiples of ``KEY_ALIGN`` as in the eager step.

``CompiledDecoder`` owns the compiled graphs: greedy (argmax only) and beam (also each row's best
``top`` log-probs), compiled at start-up (``warm_up``), cached on disk by TorchInductor
(``TORCHINDUCTOR_CACHE_DIR``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from model.cache import KVCache
from model.layers import aligned
from model.static_step import StaticStep
from model.transformer import Transformer

log = logging.getLogger(__name__)


@dataclass
class StepChoice:
    """What a step chose, per live row (``StaticStep``'s outputs)."""

    choice: Tensor  # (R,) argmax of the logits
    top_tokens: Tensor  # (R, top) best next tokens (top = 0 for the greedy graph)
    top_lprobs: Tensor  # (R, top) their log-probs
    eos_lprob: Tensor  # (R,) log-prob of eos (zeros for the greedy graph)

    def select(self, rows: Tensor) -> StepChoice:
        """These rows, in this order."""
        return StepChoice(
            *(
                t.index_select(0, rows)
                for t in (self.choice, self.top_tokens, self.top_lprobs, self.eos_lprob)
            )
        )


StepFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor, Tensor, Tensor, Tensor]]


class StaticSlots:
    """Continuous batching's running cache, at fixed capacity, row-major. Same interface as
    ``CacheSlots`` (``rows``, ``width``, ``append``, ``remove``, ``reorder``) and ``decode``."""

    @torch.inference_mode()  # inference tensors, as the graphs were compiled for (a guard checks)
    def __init__(self, model: Transformer, capacity: int, device: torch.device | None = None) -> None:
        cfg = model.cfg
        dtype = model.embed.weight.dtype
        device = device or model.embed.weight.device
        self.positions = cfg.max_positions
        shape = (capacity, cfg.decoder_layers, 2, cfg.n_heads, cfg.max_positions, cfg.head_dim)
        # Zeros, never garbage: masked keys are multiplied by a weight of 0, so they must be finite.
        self.self_kv = torch.zeros(shape, dtype=dtype, device=device)  # (Rcap, L, 2, H, Pcap, Dh)
        self.cross_kv = torch.zeros(shape, dtype=dtype, device=device)  # (Rcap, L, 2, H, Pcap, Dh)
        self.src_bias = torch.full(
            (capacity, 1, 1, cfg.max_positions), float("-inf"), dtype=dtype, device=device
        )  # (Rcap, 1, 1, Pcap)
        self.lengths = torch.zeros(capacity, dtype=torch.long, device=device)  # written positions
        self.capacity = capacity
        self.rows = 0
        self.source_lengths: list[int] = []  # per row, last real source position + 1
        self.max_length = 0

    @property
    def width(self) -> int:
        return max(self.source_lengths, default=0)

    def decode(self, step: StepFn, tokens: Tensor) -> StepChoice:
        """Run ``step`` on the live rows and write their new keys/values into the cache."""
        n = self.rows
        keys = min(aligned(max(self.max_length, 1)), self.positions)  # positions read (KEY_ALIGN)
        width = min(aligned(self.width), self.positions)
        positions = self.lengths[:n]
        choice, top_tokens, top_lprobs, eos_lprob, new = step(
            tokens,
            positions,
            self.self_kv[:n, :, :, :, :keys],
            self.cross_kv[:n, :, :, :, :width],
            self.src_bias[:n, :, :, :width],
        )
        rows = torch.arange(n, device=tokens.device)
        self.self_kv[rows, :, :, :, positions] = new  # indexed view is (R, L, 2, H, Dh)
        self.lengths[:n] += 1
        self.max_length += 1
        return StepChoice(choice, top_tokens, top_lprobs, eos_lprob)

    def append(self, new: KVCache) -> None:
        """Add ``new``'s rows (a fresh ``Transformer.start_cache``, beams already repeated) after
        the last one: their cross-attention keys/values and source masks (nothing decoded yet)."""
        n, k = self.rows, new.batch_size
        if k == 0:
            return
        if n + k > self.capacity:
            raise ValueError(f"{n + k} rows exceed the running batch's capacity ({self.capacity})")
        assert new.max_length == 0, "rows join before their first step"
        s = new.cross_kv.size(4)
        self.cross_kv[n : n + k, :, :, :, :s] = new.cross_kv.permute(2, 0, 1, 3, 4, 5)
        bias = self.src_bias[n : n + k, 0, 0]  # (k, Pcap)
        bias.fill_(float("-inf"))
        bias[:, :s].masked_fill_(new.src_mask, 0.0)
        self.lengths[n : n + k] = 0
        self.source_lengths += (new.src_mask.long().cumsum(1).argmax(1) + 1).tolist()
        self.rows = n + k

    def remove(self, leaving: list[int]) -> dict[int, int]:
        """Drop rows ``leaving``: the last remaining rows move into their places. Returns the moves,
        old row -> new row."""
        gone = set(leaving)
        n, m = self.rows, self.rows - len(gone)
        holes = sorted(r for r in gone if r < m)
        movers = [r for r in range(m, n) if r not in gone]
        if holes:
            self._copy_rows(holes, movers, sources=True)
        for hole, mover in zip(holes, movers, strict=True):
            self.source_lengths[hole] = self.source_lengths[mover]
        del self.source_lengths[m:]
        self.rows = m
        self.max_length = int(self.lengths[:m].max()) if m else 0
        return dict(zip(movers, holes, strict=True))

    def reorder(self, index: list[int]) -> None:
        """Row r takes the decoded prefix of row ``index[r]`` (beams of one input)."""
        changed = [r for r, source in enumerate(index) if r != source]
        if changed:
            self._copy_rows(changed, [index[r] for r in changed], sources=False)

    def _copy_rows(self, dst: list[int], src: list[int], *, sources: bool) -> None:
        d = torch.tensor(dst, device=self.lengths.device)
        s = torch.tensor(src, device=self.lengths.device)
        parts = [self.self_kv[:, :, :, :, : self.max_length], self.lengths]
        if sources:
            width = max(self.source_lengths[r] for r in src)
            parts += [self.cross_kv[:, :, :, :, :width], self.src_bias]
        for t in parts:  # gathered first, so rows both read and written are safe
            t.index_copy_(0, d, t.index_select(0, s))


class CompiledDecoder:
    """The compiled decoding graphs of one model: ``greedy`` and ``beam`` (``top`` candidates)."""

    def __init__(self, model: Transformer, *, top: int, compile: bool = True) -> None:
        self.model = model
        self.top = top
        self.compiled = compile
        greedy, beam = StaticStep(model, top=0).eval(), StaticStep(model, top=top).eval()
        if compile:
            # Not ``freezing`` (weights folded into the graph as constants): its graphs bypass
            # TorchInductor's on-disk cache (a restart took 29-38 s instead of 7-8) and its steps
            # were no faster (64 rows: int8 6.0 vs 3.9-4.1 ms once cached, float32 8.4 vs 7.7-7.9).
            # Graphs are cached per code object (StaticStep.forward), whatever the model: room for
            # those of a few models in one process (tests), 3 graphs each.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            self._greedy: StepFn = torch.compile(greedy, dynamic=False, fullgraph=True)
            self._beam: StepFn = torch.compile(beam, dynamic=False, fullgraph=True)
        else:
            self._greedy, self._beam = greedy, beam
        self.ready = not compile
        self.compile_seconds = 0.0

    def greedy(self, *args: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        return self._call(self._greedy, args)

    def beam(self, *args: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        return self._call(self._beam, args)

    def _call(self, step: StepFn, args: tuple[Tensor, ...]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        if not self.compiled:
            return step(*args)
        assert self.ready, "warm_up() compiles the graphs first"
        return step(*args)

    @torch.inference_mode()
    def warm_up(self, capacity: int) -> float:
        """Compile every graph the running batch will use: the greedy and beam steps with the batch
        size and both lengths as symbols (one row: greedy only, a graph of its own, since the
        compiler specializes a size of 1). Afterwards a recompilation is an error, not a stall.
        Returns the seconds it took."""
        started = time.perf_counter()
        model = self.model
        torch.compiler.set_stance("default")  # this process may have warmed up another decoder
        for step, rows in ((self._greedy, 2), (self._greedy, 1), (self._beam, 2)):
            if rows > capacity:
                continue
            slots = StaticSlots(model, capacity)
            src = torch.full((rows, 3), 5, dtype=torch.long, device=slots.lengths.device)
            slots.append(model.start_cache(model.encode(src), capacity=1))
            tokens = torch.full((rows,), model.cfg.bos_id, dtype=torch.long, device=src.device)
            if self.compiled:
                n, keys, width = rows, aligned(1), aligned(slots.width)
                views = (
                    tokens,
                    slots.lengths[:n],
                    slots.self_kv[:n, :, :, :, :keys],
                    slots.cross_kv[:n, :, :, :, :width],
                    slots.src_bias[:n, :, :, :width],
                )
                # Rows (when more than one), cached positions and source positions are symbols.
                row = (0,) if rows > 1 else ()
                for t, dims in zip(views, (row, row, (*row, 4), (*row, 4), (*row, 3)), strict=True):
                    for dim in dims:
                        torch._dynamo.mark_dynamic(t, dim)
                step(*views)
            slots.decode(step, tokens)
        if self.compiled:
            # Once warm, a shape the graphs do not cover is a bug to report, not a 20 s stall. (For
            # the whole process: a context manager around each step cost 0.1 ms.)
            torch.compiler.set_stance("fail_on_recompile")
        self.ready = True
        self.compile_seconds = time.perf_counter() - started
        log.info("decoding graphs ready in %.1f s", self.compile_seconds)
        return self.compile_seconds
