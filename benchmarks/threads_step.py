"""Can two threads of one process run the compiled decoding step at once (one copy of the weights)?

Two runners of one model's package (the second a ``sibling`` of the first: another container of
the same library, handed the same weights) each run ``--steps`` beam steps at ``--rows`` rows, one
after the other and then in two threads at once, two ways:

- through torch's own binding of the package (``AOTIModelPackageLoader.run``), which holds the GIL;
- natively (``model.runtime.native``, the default): the package's library called through its C
  interface with ``ctypes``, which releases the GIL around the call.

Two threads can only beat one after the other where the step runs without the GIL. Then one
thread's step time at 1 row and at ``--rows`` rows, both ways (the median of ``--repeats``
timings of ``--steps`` steps, the two ways taking turns).

    .venv/bin/python -m benchmarks.threads_step --model artifacts/multi30k-de-en
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from model.runtime.runners import PackagedRunner, _example_cache, load_runner
from model.translator import Translator


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--quantization", default="int8", choices=["int8", "none"])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeats", type=int, default=7, help="timings of one thread's steps, each way")
    p.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "nmt-threads-step")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    tr = Translator.load(
        args.model, device="cpu", quantization=args.quantization, compile=True, cache_dir=args.cache_dir
    )
    model, positions = tr.model, tr.options.positions(tr.model.cfg.max_positions)
    top = tr.options.candidates(tr.max_beam_size)

    def two(native: bool) -> list[PackagedRunner]:
        first = load_runner(
            model, top=top, capacity=tr.capacity, positions=positions, compile=True, cache_dir=args.cache_dir
        )
        assert isinstance(first, PackagedRunner) and first.native, "the step did not compile natively"
        if not native:  # the same package and weights through torch's binding
            first = PackagedRunner(first.step, capacity=tr.capacity, positions=positions, native=False)
            first.prepare(args.cache_dir)
        second = first.sibling()
        assert first.native == second.native == native
        return [first, second]

    def steps(runner: PackagedRunner, rows: int, n: int) -> float:
        """Seconds for ``n`` beam steps of ``rows`` rows (the same inputs each time)."""
        with torch.inference_mode():
            cache = _example_cache(model, rows, capacity=tr.capacity, positions=positions, align=1)
            tokens = torch.full((rows,), model.cfg.bos_id, dtype=torch.long)
            beam_rows = torch.arange(rows)
            forced = torch.full((rows, 2), model.cfg.eos_id, dtype=torch.long)
            inputs = (tokens, *cache.views(), beam_rows, forced)
            started = time.perf_counter()
            for _ in range(n):
                runner(*inputs)
            return time.perf_counter() - started

    ways = {"torch's binding": two(native=False), "native (GIL released)": two(native=True)}
    for name, runners in ways.items():
        for runner in runners:
            steps(runner, args.rows, args.steps)  # warm-up
        one_after_other = sum(steps(runner, args.rows, args.steps) for runner in runners)
        threads = [threading.Thread(target=steps, args=(r, args.rows, args.steps)) for r in runners]
        started = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        together = time.perf_counter() - started
        print(
            f"{name}: 2 x {args.steps} beam steps at {args.rows} rows, one after the other "
            f"{one_after_other:.2f} s, in two threads {together:.2f} s",
            flush=True,
        )

    for rows in sorted({1, args.rows}):
        timings: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(args.repeats):  # taking turns: a slower moment of the machine hits both
            for name, runners in ways.items():
                timings[name].append(steps(runners[0], rows, args.steps) / args.steps)
        print(
            f"one thread, {rows} rows: "
            + ", ".join(f"{name} {statistics.median(t) * 1e3:.3f} ms a step" for name, t in timings.items()),
            flush=True,
        )


if __name__ == "__main__":
    main()
