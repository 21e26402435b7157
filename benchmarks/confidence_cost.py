"""What confidence costs decoding: the first ``--sentences`` of test_2016 (de→en, the shipped model,
int8, eager step or with ``--compile`` the compiled one, one thread, in inference mode as the
worker), decoded as the service's executor decodes them (a running batch of
64 rows, greedy rows unscored, newcomers joining in groups), three times each, median seconds:

- ``beam5``: beam 5 (its hypotheses always carry token log-probs);
- ``greedy_off``: greedy, no log-probs asked (the service's default greedy row: argmax only);
- ``greedy_on``: greedy with ``Source.scored`` (a request that asked for confidence: its rows ask
  the step for their candidates, the log-softmax of their row).

Run it under this checkout, and under an older one's ``model/`` to compare (``greedy_on`` needs
``Source.scored``: printed only where it exists):

    .venv/bin/python -m benchmarks.confidence_cost
    mkdir -p /tmp/before && git archive HEAD model | tar -x -C /tmp/before
    PYTHONPATH=/tmp/before:. .venv/bin/python -m benchmarks.confidence_cost   # HEAD's model/
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable

import torch

import model
from benchmarks.common import DATA, DEFAULT_MODEL, cpu_name
from model.decoding.batch import RunningBatch, Source
from model.translator import Translator
from training.data import read_lines


@torch.inference_mode()  # as the worker decodes (without it, autograd keeps every step's graph)
def run(t: Translator, ids: list[list[int]], beam: int, scored: bool) -> int:
    """Decode ``ids`` through one running batch of 64 rows; returns the sentences finished."""
    batch: RunningBatch[int] = RunningBatch(
        t.model, t.runner, capacity=64, options=t.options.but(beam_size=beam), greedy_scores=False
    )
    extra = {"scored": True} if scored else {}
    order, done = list(range(len(ids))), 0
    while order or len(batch):
        free = (64 - batch.rows) // beam
        if order and free > 0 and batch.joins_now(min(free, len(order))):  # (in groups, as ``decode``)
            taken, order = order[:free], order[free:]
            batch.add([Source(i, ids[i], beam, 1, **extra) for i in taken])  # type: ignore[arg-type]
        done += len(batch.step())
    return done


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sentences", type=int, default=500)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="the compiled step (as served)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    t = Translator.load(DEFAULT_MODEL, device="cpu", quantization="int8", compile=args.compile)
    ids = t.source_ids(read_lines(DATA / "test_2016_flickr.de.gz")[: args.sentences])
    cases: dict[str, Callable[[], int]] = {
        "beam5": lambda: run(t, ids, 5, False),
        "greedy_off": lambda: run(t, ids, 1, False),
    }
    if "scored" in {f.name for f in dataclasses.fields(Source)}:
        cases["greedy_on"] = lambda: run(t, ids, 1, True)
    seconds: dict[str, list[float]] = {}
    for _ in range(args.repeats):  # (alternating: a busy spell of the machine hits every case)
        for name, case in cases.items():
            started = time.perf_counter()
            assert case() == len(ids)
            seconds.setdefault(name, []).append(time.perf_counter() - started)
    step = "compiled" if args.compile else "eager"
    print(f"model/ at {model.__file__}; CPU: {cpu_name()}, 1 thread, {step} step, torch {torch.__version__}")
    print(json.dumps({k: round(statistics.median(v), 3) for k, v in seconds.items()}))


if __name__ == "__main__":
    main()
