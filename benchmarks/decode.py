"""Decoding throughput: incremental decoding with the KV cache vs recomputing the whole prefix.

Two ways to get the next-token logits at every search step:

- ``cached``: ``Transformer.start_cache`` once, then ``decode_step`` with one new token per row;
  self-attention K/V of earlier positions and cross-attention K/V are reused.
- ``recompute`` (the seeds' method): ``Transformer.decode(prefix, enc)`` over the whole prefix at every
  step, keeping only the last position's logits.

Both run the very same search code (``model.search.greedy_search`` / ``beam_search``): the recompute
method is an adapter that exposes the same ``cfg`` / ``start_cache`` / ``decode_step`` interface, so
only the model call differs and both must produce the same tokens (checked). Random-weight models
rarely emit eos, so every sequence decodes until its length limit (``--steps``): both methods do the
same amount of search work.

Throughput is generated tokens per second of search time (the encoder runs once per batch outside the
timed region: it is identical for both methods). Generated tokens are counted on the best hypothesis
of each input, eos included (= decoder steps that produced it): batch * steps when nothing ends early.

    .venv/bin/python -m benchmarks.decode                      # defaults: batch 1 and 64, greedy and beam 5
    .venv/bin/python -m benchmarks.decode --model models/de-en --device cuda --json decode.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor

from benchmarks.common import OtherLoad, cpu_name
from model.config import ModelConfig
from model.search import Hypothesis, beam_search, greedy_search, max_lengths
from model.tokenizer import BOS_ID, EOS_ID, PAD_ID
from model.transformer import EncoderOutput, Transformer
from model.translator import Translator, resolve_device, resolve_dtype

# Searches take (model, enc, limits) and return the n-best hypotheses of every input.
Search = Callable[[Transformer, EncoderOutput, Tensor], list[list[Hypothesis]]]


# -- the recompute method, behind the incremental-decoding interface --------------------------------
@dataclass
class PrefixCache:
    """The "cache" of the recompute method: just the tokens fed so far and the matching encoder rows.

    ``index_select`` is all the search functions call on a cache (beam reordering, dropping finished
    rows), so this is enough to run them unchanged.
    """

    prefix: Tensor  # (B, t) tokens fed so far, bos first
    enc: EncoderOutput  # B rows, aligned with ``prefix``

    def index_select(self, index: Tensor, *, same_sources: bool = False) -> PrefixCache:
        # Like KVCache: beams reordered within their sentence keep the encoder rows as they are.
        if same_sources:
            return PrefixCache(self.prefix.index_select(0, index), self.enc)
        enc = EncoderOutput(self.enc.memory.index_select(0, index), self.enc.src_mask.index_select(0, index))
        return PrefixCache(self.prefix.index_select(0, index), enc)


class RecomputePrefix:
    """Duck-typed stand-in for ``Transformer`` in model.search: every ``decode_step`` re-runs the full
    decoder over the whole prefix (cross-attention K/V and all logits included, as ``decode`` does)."""

    def __init__(self, model: Transformer) -> None:
        self.model = model
        self.cfg = model.cfg

    def start_cache(self, enc: EncoderOutput, capacity: int = 32) -> PrefixCache:
        del capacity  # nothing is preallocated: the prefix grows by concatenation
        empty = torch.empty(enc.memory.size(0), 0, dtype=torch.long, device=enc.memory.device)
        return PrefixCache(empty, enc)

    def decode_step(self, tokens: Tensor, cache: PrefixCache) -> tuple[Tensor, PrefixCache]:
        prefix = torch.cat([cache.prefix, tokens[:, None]], dim=1)  # (B, t+1)
        logits = self.model.decode(prefix, cache.enc)[:, -1]  # (B, V): only the last position is used
        return logits, PrefixCache(prefix, cache.enc)


def search_fn(beam: int) -> Search:
    if beam == 1:
        return lambda model, enc, limits: greedy_search(model, enc, limits)
    return lambda model, enc, limits: beam_search(model, enc, limits, beam_size=beam)


def decoders(model: Transformer) -> dict[str, Transformer]:
    # The adapter is not a Transformer, but it has every attribute the search functions use.
    return {"cached": model, "recompute": cast(Transformer, RecomputePrefix(model))}


# -- inputs and model -------------------------------------------------------------------------------
def random_sources(batch: int, vocab_size: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    """Random source sentences of ``min_len``..``max_len`` tokens, each ending in eos (as the
    Translator feeds them); ids avoid the special tokens."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (batch,), generator=gen).tolist()
    return [torch.randint(4, vocab_size, (n - 1,), generator=gen).tolist() + [EOS_ID] for n in lengths]


def pad_batch(sources: list[list[int]], device: torch.device) -> Tensor:
    src = torch.full((len(sources), max(map(len, sources))), PAD_ID, dtype=torch.long)
    for i, ids in enumerate(sources):
        src[i, : len(ids)] = torch.tensor(ids)
    return src.to(device)


def config_from_args(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
        vocab_size=args.vocab_size,
        d_model=args.d_model,
        n_heads=args.heads,
        encoder_layers=args.encoder_layers,
        decoder_layers=args.decoder_layers,
        d_ff=args.d_ff,
        pre_norm=args.pre_norm,
    )


def build_model(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> Transformer:
    if args.model is not None:
        return Translator.load(args.model, device=str(device), dtype=dtype).model
    torch.manual_seed(args.seed)  # random init, reproducible
    return Transformer(config_from_args(args)).to(device=device, dtype=dtype).eval()


# -- timing -----------------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":  # kernels are asynchronous: wait for them before reading the clock
        torch.cuda.synchronize(device)


def timed(
    fn: Callable[[], list[list[Hypothesis]]], device: torch.device
) -> tuple[float, list[list[Hypothesis]]]:
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - start, out


def generated_tokens(hyps: list[list[Hypothesis]]) -> int:
    """Tokens of the best hypothesis of every input, eos included (one per decoder step)."""
    return sum(len(nbest[0].tokens) + 1 for nbest in hyps)


@dataclass
class Result:
    batch_size: int
    beam: int
    method: str
    tokens: int  # generated tokens per run
    seconds: float  # median search time per run
    best_seconds: float  # fastest run: the least disturbed by other processes
    runs: list[float]  # every timed run, seconds
    tokens_per_s: float  # from the median
    speedup: float = 1.0  # cached tokens/s / this method's (filled in per configuration)


def measure(
    methods: dict[str, Transformer],
    search: Search,
    enc: EncoderOutput,
    limits: Tensor,
    repeats: dict[str, int],
    device: torch.device,
) -> dict[str, tuple[list[float], list[list[Hypothesis]]]]:
    """One untimed warm-up run per method (allocator, kernel selection; its output is kept for the
    token check), then the timed runs, interleaved: on a shared machine, load from other processes
    then hits both methods alike instead of whichever happened to run during it."""
    outputs = {name: timed(partial(search, dec, enc, limits), device)[1] for name, dec in methods.items()}
    runs: dict[str, list[float]] = {name: [] for name in methods}
    for i in range(max(repeats.values())):
        for name, dec in methods.items():
            if i < repeats[name]:
                runs[name].append(timed(partial(search, dec, enc, limits), device)[0])
    for name, times in runs.items():
        print(f"  {name}: {', '.join(f'{s:.3f}' for s in times)} s", file=sys.stderr)
    return {name: (runs[name], outputs[name]) for name in methods}


def check_same_tokens(a: list[list[Hypothesis]], b: list[list[Hypothesis]], allow_mismatch: bool) -> int:
    """Both methods must choose the same tokens; returns the number of inputs that differ."""
    differ = sum(x[0].tokens != y[0].tokens for x, y in zip(a, b, strict=True))
    if differ and not allow_mismatch:
        raise SystemExit(f"cached and recompute decoding differ on {differ}/{len(a)} inputs")
    return differ


def run_config(
    model: Transformer, args: argparse.Namespace, batch: int, beam: int, device: torch.device
) -> list[Result]:
    print(f"batch {batch}, beam {beam}", file=sys.stderr)
    sources = random_sources(batch, model.cfg.vocab_size, args.src_min, args.src_max, args.seed)
    src = pad_batch(sources, device)
    enc = model.encode(src)
    # a=0: every input gets the same budget of ``steps`` tokens (eos included), so both methods
    # decode exactly as many steps whatever the source length.
    limits = max_lengths((src != PAD_ID).sum(1), 0.0, args.steps, model.cfg.max_positions)
    repeats = {"cached": args.repeats, "recompute": args.recompute_repeats or args.repeats}
    measured = measure(decoders(model), search_fn(beam), enc, limits, repeats, device)
    results = []
    for method, (runs, hyps) in measured.items():
        tokens, seconds = generated_tokens(hyps), statistics.median(runs)
        results.append(Result(batch, beam, method, tokens, seconds, min(runs), runs, tokens / seconds))
    differ = check_same_tokens(measured["cached"][1], measured["recompute"][1], args.allow_mismatch)
    if differ:
        print(f"  WARNING: tokens differ on {differ}/{batch} inputs", file=sys.stderr)
    for r in results:
        r.speedup = results[0].tokens_per_s / r.tokens_per_s
    return results


# -- reporting --------------------------------------------------------------------------------------
def environment(model: Transformer, device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {
        "cpu": cpu_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "device": str(device),
        "dtype": str(model.embed.weight.dtype).removeprefix("torch."),
        "parameters": sum(p.numel() for p in model.parameters()),
        "model": model.cfg.to_dict(),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def markdown_table(results: list[Result]) -> str:
    lines = [
        "| batch | beam | method | tokens/run | ms/run (median) | ms/run (best) | tokens/s | speedup |",
        "|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        speedup = "—" if r.method == "cached" else f"**{r.speedup:.1f}×**"
        lines.append(
            f"| {r.batch_size} | {r.beam} | {r.method} | {r.tokens} | {r.seconds * 1000:,.0f} "
            f"| {r.best_seconds * 1000:,.0f} | {r.tokens_per_s:,.0f} | {speedup} |"
        )
    return "\n".join(lines)


def other_load(env: dict[str, Any]) -> str:
    if env["other_cpu_seconds"] is None:
        return "CPU use of other processes unknown"
    seconds, fraction = env["other_cpu_seconds"], env["other_cpu_fraction"]
    return f"other processes used {seconds:.1f} CPU-s ({fraction:.0%} of the CPUs)"


def summary(env: dict[str, Any], args: argparse.Namespace) -> str:
    recompute = args.recompute_repeats or args.repeats
    cfg = env["model"]
    return (
        f"{env['cpu']}, {env['device']}, torch {env['torch']}, {env['threads']} threads, {env['dtype']}; "
        f"model {env['parameters'] / 1e6:.1f}M params (d_model {cfg['d_model']}, "
        f"{cfg['encoder_layers']}+{cfg['decoder_layers']} layers, vocab {cfg['vocab_size']}); "
        f"{args.steps} target steps, sources of {args.src_min}-{args.src_max} tokens; "
        f"median of {args.repeats} runs (recompute: {recompute}) after 1 warm-up; "
        f"{other_load(env)}. "
        "Speedup = cached tokens/s / recompute tokens/s (medians)."
    )


# -- command line -----------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d = ModelConfig(d_model=256, n_heads=4, encoder_layers=3, decoder_layers=3, d_ff=1024)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    p.add_argument("--beams", type=int, nargs="+", default=[1, 5], help="1 = greedy search")
    p.add_argument("--steps", type=int, default=32, help="target tokens decoded per input, eos included")
    p.add_argument("--src-min", type=int, default=12, help="shortest random source, eos included")
    p.add_argument("--src-max", type=int, default=25, help="longest random source, eos included")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per method (median reported)")
    p.add_argument("--recompute-repeats", type=int, default=None, help="timed runs of the slow method")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--seed", type=int, default=0, help="weights (random model) and source tokens")
    p.add_argument(
        "--allow-mismatch", action="store_true", help="warn instead of failing on differing tokens"
    )
    p.add_argument("--json", type=Path, default=None, help="also write the results to this file")
    m = p.add_argument_group("model", "a random-init model (the size we ship), unless --model is given")
    m.add_argument(
        "--model", type=Path, default=None, help="model directory to load instead (sources stay random ids)"
    )
    m.add_argument("--vocab-size", type=int, default=d.vocab_size)
    m.add_argument("--d-model", type=int, default=d.d_model)
    m.add_argument("--heads", type=int, default=d.n_heads)
    m.add_argument("--encoder-layers", type=int, default=d.encoder_layers)
    m.add_argument("--decoder-layers", type=int, default=d.decoder_layers)
    m.add_argument("--d-ff", type=int, default=d.d_ff)
    m.add_argument("--pre-norm", action="store_true", default=d.pre_norm)
    args = p.parse_args(argv)
    if not 1 < args.src_min <= args.src_max:
        p.error("need 2 <= --src-min <= --src-max")
    if args.steps < 1 or args.repeats < 1 or min(args.batch_sizes + args.beams) < 1:
        p.error("--steps, --repeats, batch sizes and beams must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        device, dtype = resolve_device(args.device), resolve_dtype(args.dtype)
    except ValueError as e:  # e.g. --device cuda on a machine without CUDA
        raise SystemExit(f"error: {e}") from None
    model = build_model(args, device, dtype)
    if (model.cfg.bos_id, model.cfg.eos_id) != (BOS_ID, EOS_ID):  # random sources are built with these
        raise SystemExit(f"model special ids differ from model.tokenizer's ({BOS_ID}, {EOS_ID})")
    if args.steps >= model.cfg.max_positions or args.src_max > model.cfg.max_positions:
        raise SystemExit(f"--steps and --src-max must be below max_positions ({model.cfg.max_positions})")
    env = environment(model, device)
    results: list[Result] = []
    with OtherLoad() as other, torch.inference_mode():
        for batch in args.batch_sizes:
            for beam in args.beams:
                results.extend(run_config(model, args, batch, beam, device))
    env["other_cpu_seconds"], env["other_cpu_fraction"] = other.cpu_seconds, other.fraction
    if other.fraction is not None and other.fraction > 0.05:
        print(f"warning: {other_load(env)} during the run: timings are noisy", file=sys.stderr)
    print(summary(env, args) + "\n")
    print(markdown_table(results))
    if args.json is not None:
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        data = {"environment": env, "settings": settings, "results": [asdict(r) for r in results]}
        args.json.write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    main()
