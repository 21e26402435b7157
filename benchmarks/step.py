"""One decoding step, alone: the compiled runner against the eager one, and where its time goes.

For each batch size, a ``KVCache`` holding test_2016 sources (their first ``rows``), decoded to
``--history`` tokens first, then timed over ``--steps`` steps with the history kept fixed (each
step's written position is rolled back), in the CPU time of this thread (``time.thread_time``: the
time another process takes from this core is not counted), median of ``--repeats``. A step is what
the running batch (``model.decoding.batch``) does for one token: the runner over the cache's views
(greedy: one beam row), then ``KVCache.advance``.

- ``compiled``: ``model.runtime.runners.load_runner`` with ``compile=True`` (the AOTInductor package
  on CPU, what a worker runs; ``eager`` again where compiling fails, as the header says);
- ``eager``: the same ``DecodeStep`` module run operator by operator (``EagerRunner``);
- ``linear layers``: the step's linear layers alone (oneDNN or int8, as loaded), the floor that the
  compiled step's other work adds to.

``--profile ROWS`` then prints the compiled step's kernels at that batch size (torch.profiler, with
TorchInductor's per-kernel records compiled in: a separate package in ``--cache-dir``/profile).

    .venv/bin/python -m benchmarks.step --quantization none --rows 1 32 64
    .venv/bin/python -m benchmarks.step --quantization int8 --rows 32 --profile 32
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import DATA, DEFAULT_MODEL
from model.cache import KVCache
from model.decoding.translator import Translator
from model.runtime import DEFAULT_CACHE_DIR
from model.runtime.runners import Runner, load_runner
from training.data import read_lines


def thread_ms(fn: Callable[[], object], steps: int, repeats: int) -> float:
    """Median over ``repeats`` of the CPU time of ``steps`` calls, ms per call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        for _ in range(steps):
            fn()
        times.append((time.thread_time() - start) / steps * 1000)
    return statistics.median(times)


def unforced(beam_rows: torch.Tensor) -> torch.Tensor:
    """The step's ``forced`` without constraints: two dummy columns (pad) per beam row, as decoding."""
    return torch.zeros((len(beam_rows), 2), dtype=torch.long, device=beam_rows.device)


def filled_cache(
    translator: Translator, runner: Runner, sources: list[list[int]], args: argparse.Namespace
) -> KVCache:
    """A cache laid out as ``runner`` was made for, holding ``sources`` decoded (greedily) to
    ``--history`` tokens."""
    model = translator.model
    cache = KVCache(
        model.cfg,
        capacity=args.capacity,
        positions=args.positions,
        dtype=translator.dtype,
        device=translator.device,
        align=runner.align,
    )
    enc = model.encode(translator.batch(sources))
    cache.append(model.source_kv(enc), enc.src_mask)
    tokens = torch.full((len(sources),), model.cfg.bos_id, dtype=torch.long, device=translator.device)
    beam_rows = torch.zeros(1, dtype=torch.long, device=translator.device)
    for _ in range(args.history):
        out = runner(tokens, *cache.views(), beam_rows, unforced(beam_rows))
        cache.advance(out[4])
        tokens = out[0]
    return cache


def step_ms(
    translator: Translator, runner: Runner, sources: list[list[int]], args: argparse.Namespace
) -> float:
    cache = filled_cache(translator, runner, sources, args)
    tokens = torch.full((len(sources),), 5, dtype=torch.long, device=translator.device)
    beam_rows = torch.zeros(1, dtype=torch.long, device=translator.device)

    def step() -> None:
        cache.advance(runner(tokens, *cache.views(), beam_rows, unforced(beam_rows))[4])
        cache.lengths[: len(sources)] -= 1  # the same history at every call
        cache.max_length -= 1

    return thread_ms(step, args.steps, args.repeats)


def linears_ms(translator: Translator, rows: int, args: argparse.Namespace) -> float:
    """The linear layers a step runs (not the cross-attention K/V projection: once per input)."""
    model = translator.model
    x, wide = torch.randn(rows, 1, model.cfg.d_model), torch.randn(rows, 1, model.cfg.d_ff)
    layers = [
        (m, wide if m is layer.ff.fc2 else x)
        for layer in model.decoder
        for m in (layer.self_attn.qkv, layer.self_attn.out, layer.cross_attn.q, layer.cross_attn.out)
        + (layer.ff.fc1, layer.ff.fc2)
    ]

    def step() -> None:
        for m, inp in layers:
            m(inp)
        model._logits(x)

    return thread_ms(step, args.steps, args.repeats)


def runner_for(translator: Translator, args: argparse.Namespace, *, compile: bool, cache_dir: Path) -> Runner:
    return load_runner(
        translator.model,
        top=args.top,
        capacity=args.capacity,
        positions=args.positions,
        compile=compile,
        cache_dir=cache_dir,
    )


def measure(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    translator = Translator.load(args.model, device="cpu", quantization=args.quantization)
    args.capacity = max(args.capacity, *args.rows)
    args.positions = translator.options.positions(translator.model.cfg.max_positions)
    sources = translator.source_ids(read_lines(args.src)[: max(args.rows)])
    compiled = runner_for(translator, args, compile=True, cache_dir=args.cache_dir)
    cached = " (loaded)" if getattr(compiled, "cached", False) else ""
    print(f"compiled step ready in {compiled.compile_seconds:.1f} s: {compiled.kind}{cached}")
    eager = runner_for(translator, args, compile=False, cache_dir=args.cache_dir)
    print(
        f"\n{translator.quantization}, {args.threads} thread(s), capacity {args.capacity}, "
        f"history {args.history} tokens, ms/step:\n"
    )
    print("| rows | compiled | eager | linear layers |")
    print("|---:|---:|---:|---:|")
    with torch.inference_mode():
        for rows in args.rows:
            results = [
                *(step_ms(translator, r, sources[:rows], args) for r in (compiled, eager)),
                linears_ms(translator, rows, args),
            ]
            print(f"| {rows} | " + " | ".join(f"{r:.2f}" for r in results) + " |", flush=True)
    if args.profile:
        profile(translator, sources[: args.profile], args)


def profile(translator: Translator, sources: list[list[int]], args: argparse.Namespace) -> None:
    import torch._inductor.config as inductor_config
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    inductor_config.cpp.enable_kernel_profile = True  # a record per generated kernel
    runner = runner_for(translator, args, compile=True, cache_dir=args.cache_dir / "profile")
    with torch.inference_mode():
        cache = filled_cache(translator, runner, sources, args)
        tokens = torch.full((len(sources),), 5, dtype=torch.long)
        beam_rows = torch.zeros(1, dtype=torch.long)
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                cache.advance(runner(tokens, *cache.views(), beam_rows, unforced(beam_rows))[4])
                cache.lengths[: len(sources)] -= 1
                cache.max_length -= 1
    print(f"\nThe {runner.kind} step's kernels at {len(sources)} rows ({args.steps} steps):\n")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--src", type=Path, default=DATA / "test_2016_flickr.de.gz")
    p.add_argument("--quantization", default="none", choices=["none", "int8"])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 32, 64])
    p.add_argument(
        "--capacity",
        type=int,
        default=64,
        help="the cache's rows (the service's running batch; at least max --rows)",
    )
    p.add_argument("--top", type=int, default=16, help="candidates per beam row (2 x the largest beam)")
    p.add_argument("--history", type=int, default=12, help="tokens decoded before timing")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    p.add_argument("--profile", type=int, default=0, metavar="ROWS")
    measure(p.parse_args(argv))


if __name__ == "__main__":
    main()
