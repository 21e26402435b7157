"""The decoding step as CUDA graphs: one launch per step instead of ~170-370 kernel launches.

On a GPU the eager step is host-bound: at 256 rows the H100 and H200 were busy 11-31 % of a step,
the rest spent launching ~170 (shipped model) to ~370 (OPUS-MT size, beam 5) kernels one by one
(BENCHMARKS.md, "On a GPU"). A CUDA graph replays a captured sequence of kernels with one launch,
but only over fixed shapes and fixed memory addresses. So, as vLLM's graph runner does:

- **Buckets.** The live rows R are padded to a row bucket (1, 2, 4, ... up to the cache's
  capacity) and the positions read (keys C, source S) to a width bucket (32, 64, ... up to the
  cache's positions, each a multiple of ``KEY_ALIGN``); a graph is captured for each (rows, width)
  pair when the cache is made (the warm-up), and a call replays the smallest that holds it.
- **Static buffers.** The graphs read the cache's own buffers, so the runner hands out the caches
  (``new_cache``): a pool of them per (capacity, positions), each one's buffers allocated and
  zeroed once and captured once; a cache given back (its batch is gone) is handed out again, its
  graphs with it. The step's small inputs (tokens, beam rows, forced tokens) are copied into the
  runner's static buffers; its outputs are sliced to the live rows.
- **Padding rows change nothing.** Every operator of the step is row-wise but the matrix
  products, whose rows are independent (``Transformer.step``): rows past R compute garbage that
  nobody reads. They read finite values only (the pooled buffers are zeroed when made, and
  their stale positions are reset to 0, so that no embedding lookup leaves the table). Masked keys
  past a row's length add exact zeros, as in the eager step.

Where a call does not fit (a cache the runner did not make, constrained decoding's wider
``forced``), the step runs eagerly: same signature, same results. ``capture=False`` runs the same
buckets, buffers and padding eagerly: how the CPU tests check everything but the capture itself.
"""

from __future__ import annotations

import copy
import logging
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from model.cache import KVCache
from model.layers import KEY_ALIGN
from model.runtime.encoder import encode_eagerly
from model.runtime.step import DecodeStep, StepOutputs

log = logging.getLogger(__name__)

UNFORCED = 2  # ``forced``'s width without constraints (``Search.forced``): the only one captured
SMALLEST_WIDTH = 32  # positions: short sentences share one bucket


def row_buckets(capacity: int) -> list[int]:
    """1, 2, 4, ... below ``capacity``, then ``capacity``."""
    buckets = [1]
    while buckets[-1] * 2 < capacity:
        buckets.append(buckets[-1] * 2)
    return sorted({*buckets, capacity})


def width_buckets(positions: int) -> list[int]:
    """32, 64, ... below ``positions`` rounded up to ``KEY_ALIGN``, then that: every view a cache of
    ``positions`` hands out fits in one (``KVCache.views`` rounds up to ``KEY_ALIGN``)."""
    top = -(-positions // KEY_ALIGN) * KEY_ALIGN
    buckets = [min(SMALLEST_WIDTH, top)]
    while buckets[-1] * 2 < top:
        buckets.append(buckets[-1] * 2)
    return sorted({*buckets, top})


def bucket(n: int, buckets: list[int]) -> int:
    return next(b for b in buckets if b >= n)


@dataclass
class Pooled:
    """One pooled cache's buffers (``proto``, the cache first made over them), the static inputs
    of its graphs, and the graphs: (rows, width) -> (graph, its outputs)."""

    proto: KVCache
    tokens: Tensor  # (capacity,) long
    beam_rows: Tensor  # (capacity,) long
    forced: Tensor  # (capacity, UNFORCED) long
    rows: list[int]  # its row buckets (``row_buckets``), and its width buckets: made once, read per call
    widths: list[int]
    graphs: dict[tuple[int, int], tuple[Any, StepOutputs]] = field(default_factory=dict)
    in_use: bool = False


class GraphRunner:
    """``DecodeStep`` replayed as CUDA graphs over bucketed rows and widths (``capture``), or run
    eagerly over the same buckets and buffers (``capture=False``, the CPU tests' way)."""

    align = KEY_ALIGN  # read as the eager step reads (a call that does not fit runs eagerly)

    def __init__(self, step: DecodeStep, *, capture: bool) -> None:
        self.step = step
        self.capture = capture
        self.kind = "graphs" if capture else "eager"
        self.compile_seconds = 0.0
        self.capture_seconds = 0.0  # spent capturing so far (each new pooled cache captures its graphs)
        self._pools: dict[int, Pooled] = {}  # by the data pointer of the cache's self_kv
        # One memory pool for every graph's intermediates and outputs: a call's outputs are read
        # before the next call (``__call__``), so graphs may reuse each other's memory.
        self._memory = torch.cuda.graph_pool_handle() if capture else None

    def prepare(self, cache_dir: Path) -> None:
        """Capture one graph now, so that a GPU that cannot capture falls back at load time."""
        del cache_dir
        if self.capture:
            self.new_cache(capacity=1, positions=1)

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        """``StepRunner.encode``: the model's own modules (batches join a few times a second)."""
        return encode_eagerly(self.step.model, src)

    # -- caches ------------------------------------------------------------------------------
    def new_cache(self, *, capacity: int, positions: int) -> KVCache:
        """An empty cache whose buffers this runner's graphs read: a pooled one given back earlier,
        else a new one (zeroed, its graphs captured now)."""
        free = [
            p
            for p in self._pools.values()
            if not p.in_use and p.proto.capacity == capacity and p.proto.positions == positions
        ]
        pooled = free[0] if free else self._make(capacity, positions)
        pooled.in_use = True
        cache = copy.copy(pooled.proto)  # the same buffers, empty (its own row bookkeeping)
        cache.clear()
        weakref.finalize(cache, _give_back, pooled)  # its batch is gone: the buffers are free again
        return cache

    def _make(self, capacity: int, positions: int) -> Pooled:
        model = self.step.model
        proto = KVCache(
            model.cfg,
            capacity=capacity,
            positions=positions,
            dtype=model.dtype,
            device=model.device,
            align=self.align,
        )
        proto.zero_all()  # padding rows and positions are read: finite, never garbage
        device = model.device
        pooled = Pooled(
            proto,
            tokens=torch.zeros(capacity, dtype=torch.long, device=device),
            beam_rows=torch.zeros(capacity, dtype=torch.long, device=device),
            forced=torch.zeros((capacity, UNFORCED), dtype=torch.long, device=device),
            rows=row_buckets(capacity),
            widths=width_buckets(positions),
        )
        self._pools[proto.self_kv.data_ptr()] = pooled
        if self.capture:
            started = time.perf_counter()
            # Largest first (as vLLM): the smaller graphs reuse the memory the largest took.
            for rows in reversed(pooled.rows):
                for width in reversed(pooled.widths):
                    pooled.graphs[rows, width] = self._capture(pooled, rows, width)
            elapsed = time.perf_counter() - started
            self.capture_seconds += elapsed
            log.info(
                "captured %d decoding-step graphs (%d rows, %d positions) in %.1f s",
                len(pooled.graphs),
                capacity,
                positions,
                elapsed,
            )
        return pooled

    # -- the step ----------------------------------------------------------------------------
    def _inputs(self, pooled: Pooled, rows: int, width: int) -> tuple[Tensor, ...]:
        c = pooled.proto
        return (
            pooled.tokens[:rows],
            c.lengths[:rows],
            c.self_kv[:rows, :, :, :, :width],
            c.cross_kv[:rows, :, :, :, :width],
            c.src_bias[:rows, :, :, :width],
            c.sources[:rows],
            pooled.beam_rows[:rows],
            pooled.forced[:rows],
        )

    @torch.inference_mode()
    def _capture(self, pooled: Pooled, rows: int, width: int) -> tuple[Any, StepOutputs]:
        inputs = self._inputs(pooled, rows, width)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # lazy initialisation (cuBLAS handles, workspaces) off the graph
            for _ in range(2):
                self.step(*inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._memory):
            outputs = self.step(*inputs)
        return graph, outputs

    def __call__(
        self,
        tokens: Tensor,
        positions: Tensor,
        self_kv: Tensor,
        cross_kv: Tensor,
        src_bias: Tensor,
        sources: Tensor,
        beam_rows: Tensor,
        forced: Tensor,
    ) -> StepOutputs:
        pooled = self._pools.get(self_kv.data_ptr())
        if pooled is None or forced.size(1) != UNFORCED:  # not ours, or constrained: eagerly
            return self.step(tokens, positions, self_kv, cross_kv, src_bias, sources, beam_rows, forced)
        r, b = tokens.size(0), beam_rows.size(0)
        cache = pooled.proto
        rows = bucket(r, pooled.rows)
        width = bucket(max(self_kv.size(4), cross_kv.size(4)), pooled.widths)
        pooled.tokens[:r].copy_(tokens)
        pooled.beam_rows[:b].copy_(beam_rows)
        pooled.beam_rows[b:rows].zero_()  # (a stale index may point past this bucket's rows)
        pooled.forced[:b].copy_(forced)
        cache.lengths[r:rows].zero_()  # padding rows: a position inside the embedding table...
        cache.sources[r:rows].zero_()  # ...and a source that is there (the first)
        if self.capture:
            graph, outputs = pooled.graphs[rows, width]
            graph.replay()
        else:
            outputs = self.step(*self._inputs(pooled, rows, width))
        choice, top_tokens, top_lprobs, eos_lprob, new_kv, forced_lprobs = outputs
        # The small outputs copied out (the search may keep them past the next replay); the new
        # keys/values are written into the cache (``KVCache.advance``) before the next call.
        return (
            choice[:r].clone(),
            top_tokens[:b].clone(),
            top_lprobs[:b].clone(),
            eos_lprob[:b].clone(),
            new_kv[:r],
            forced_lprobs[:b].clone(),
        )


def _give_back(pooled: Pooled) -> None:
    pooled.in_use = False
