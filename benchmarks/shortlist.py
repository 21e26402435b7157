"""Would a vocabulary shortlist of each row's own pay at OPUS-MT size? One thread, no model needed.

A shortlist that keeps one answer per input must be each row's own: CTranslate2's ``use_vmap``
scores the union of the batch's candidates, so a sentence's candidates depend on its neighbours.
Scoring each row against its own ``W`` candidates is a batched matrix-vector product; this times
it against the full output projection as the service runs it (``Int8Linear``, 512 x 58,101):

- ``gather+bmm``: the W candidate rows of a float32 output matrix gathered for each row at every
  step, then each row's dot products;
- ``bmm``: the same with each row's W x 512 candidate rows gathered once when it joins (kept per
  row: W x 512 x 4 bytes), only the dot products per step.

    .venv/bin/python -m benchmarks.shortlist
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch

from model.runtime.allocator import keep_freed_memory
from model.runtime.prepack import Int8Linear


def best_ms(f: Callable[[], object], calls: int = 20) -> float:
    for _ in range(3):
        f()
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for _ in range(calls):
            f()
        best = min(best, (time.perf_counter() - started) / calls)
    return best * 1e3


def gather_and_score(weight: torch.Tensor, ids: torch.Tensor, column: torch.Tensor) -> torch.Tensor:
    return torch.bmm(weight[ids], column)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=58_101)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--candidates", type=int, nargs="+", default=[256, 1024])
    args = p.parse_args(argv)
    keep_freed_memory()  # as a worker runs
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(args.vocab, args.d_model, generator=g) * 0.05
    full = Int8Linear(weight, None, keep=False)
    with torch.inference_mode():
        for rows in args.rows:
            x = torch.randn(rows, args.d_model, generator=g)
            column = x[:, :, None]  # (rows, D, 1)
            line = f"rows {rows:3d}: full int8 projection {best_ms(partial(full, x)):6.2f} ms"
            for w in args.candidates:
                ids = torch.randint(0, args.vocab, (rows, w), generator=g)
                kept = weight[ids]  # (rows, W, D)
                each_step = best_ms(partial(gather_and_score, weight, ids, column))
                once = best_ms(partial(torch.bmm, kept, column))
                line += (
                    f" | W={w}: gather+bmm {each_step:6.2f}, bmm {once:6.2f} ms"
                    f" ({kept.numel() * 4 / 2**20:.0f} MiB kept)"
                )
            print(line, flush=True)


if __name__ == "__main__":
    main()
