"""One decoding step, alone: the compiled step (``model.compiled_step``) against the eager ones, and
where its time goes.

For each batch size, a running batch of test_2016 sources (their first ``rows``), decoded to
``--history`` tokens first, then timed over ``--steps`` steps with the history kept fixed (each
step's written position is rolled back), in the CPU time of this thread (``time.thread_time``: the
time another process takes from this core is not counted), median of ``--repeats``:

- ``compiled``: ``StaticSlots.decode`` with the AOTInductor package (what a worker runs);
- ``static eager``: the same ``StaticStep`` module run operator by operator;
- ``decode_step``: ``Transformer.decode_step`` over a ``KVCache`` and an argmax (the eager path of
  ``Translator``);
- ``linear layers``: the step's linear layers alone (oneDNN or int8, as loaded), the floor that the
  compiled step's other work adds to.

``--profile ROWS`` then prints the compiled step's kernels at that batch size (torch.profiler, with
TorchInductor's per-kernel records compiled in: a separate package in ``--cache-dir``/profile).

    .venv/bin/python -m benchmarks.step --quantization none --rows 1 8 32 64
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
from model.cache import CacheSlots
from model.compiled_step import DEFAULT_CACHE_DIR, CompiledDecoder
from model.static_slots import StaticSlots
from model.translator import Translator
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


def static_batch(
    translator: Translator, decoder: CompiledDecoder, sources: list[list[int]], history: int
) -> StaticSlots:
    model = translator.model
    slots = StaticSlots(model, decoder.capacity)
    slots.append(model.start_cache(model.encode(translator.batch(sources)), capacity=1))
    tokens = torch.full((len(sources),), model.cfg.bos_id, dtype=torch.long)
    for _ in range(history):
        tokens = slots.decode(decoder, tokens, torch.zeros(1, dtype=torch.long)).choice
    return slots


def measure(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    translator = Translator.load(args.model, device="cpu", quantization=args.quantization)
    sources = translator.source_ids(read_lines(args.src))
    compiled = CompiledDecoder(translator.model, top=16, cache_dir=args.cache_dir)
    seconds = compiled.warm_up(max(args.rows))
    print(f"compiled step ready in {seconds:.1f} s ({'loaded' if compiled.cached else 'compiled'})")
    eager = CompiledDecoder(translator.model, top=16, compile=False)
    eager.warm_up(max(args.rows))
    print(f"\n{translator.quantization}, {args.threads} thread(s), history {args.history} tokens, ms/step:\n")
    print("| rows | compiled | static eager | decode_step | linear layers |")
    print("|---:|---:|---:|---:|---:|")
    with torch.inference_mode():
        for rows in args.rows:
            results = [
                *(static_ms(translator, d, sources[:rows], args) for d in (compiled, eager)),
                eager_ms(translator, sources[:rows], args),
                linears_ms(translator, rows, args),
            ]
            print(f"| {rows} | " + " | ".join(f"{r:.2f}" for r in results) + " |")
    if args.profile:
        profile(translator, sources[: args.profile], args)


def static_ms(
    translator: Translator, decoder: CompiledDecoder, sources: list[list[int]], args: argparse.Namespace
) -> float:
    slots = static_batch(translator, decoder, sources, args.history)
    tokens = torch.full((len(sources),), 5, dtype=torch.long)
    beam_rows = torch.zeros(1, dtype=torch.long)

    def step() -> None:
        slots.decode(decoder, tokens, beam_rows)
        slots.lengths[: len(sources)] -= 1  # the same history at every call
        slots.max_length -= 1

    return thread_ms(step, args.steps, args.repeats)


def eager_ms(translator: Translator, sources: list[list[int]], args: argparse.Namespace) -> float:
    model = translator.model
    cache = CacheSlots()
    cache.append(model.start_cache(model.encode(translator.batch(sources)), capacity=args.history + 8))
    tokens = torch.full((len(sources),), 5, dtype=torch.long)
    for _ in range(args.history):
        _, view = model.decode_step(tokens, cache.view())
        cache.advance(view)

    def step() -> None:  # a new view each call: the same history (its lengths) each time
        logits, _ = model.decode_step(tokens, cache.view())
        logits.argmax(-1)

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


def profile(translator: Translator, sources: list[list[int]], args: argparse.Namespace) -> None:
    import torch._inductor.config as inductor_config
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    inductor_config.cpp.enable_kernel_profile = True  # a record per generated kernel
    decoder = CompiledDecoder(translator.model, top=16, cache_dir=args.cache_dir / "profile")
    decoder.warm_up(max(args.rows))
    with torch.inference_mode():
        slots = static_batch(translator, decoder, sources, args.history)
        tokens = torch.full((len(sources),), 5, dtype=torch.long)
        beam_rows = torch.zeros(1, dtype=torch.long)
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                slots.decode(decoder, tokens, beam_rows)
                slots.lengths[: len(sources)] -= 1
                slots.max_length -= 1
    print(f"\nThe compiled step's kernels at {len(sources)} rows ({args.steps} steps):\n")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--src", type=Path, default=DATA / "test_2016_flickr.de.gz")
    p.add_argument("--quantization", default="none", choices=["none", "int8"])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--history", type=int, default=12, help="tokens decoded before timing")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    p.add_argument("--profile", type=int, default=0, metavar="ROWS")
    measure(p.parse_args(argv))


if __name__ == "__main__":
    main()
