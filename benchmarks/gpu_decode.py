"""The decode loop on a device, token level: the shipped model and an OPUS-MT-sized one.

    python -m benchmarks.gpu_decode --json decode.json                  # on CUDA: every setup
    python -m benchmarks.gpu_decode --device cpu --models shipped --batch-sizes 1 8 --limit 32

For each model, dtype, runner (``load_runner``'s: eager, or compiled: CUDA graphs on CUDA), beam
and batch size, the running batch (``model.decoding.batch.decode``) decodes ``--limit`` sources
(``batch`` x beam rows): generated tokens/s (eos excluded), steps and time per step, peak device
memory; batch 1 is one ``decode`` per sentence, its p50 latency reported. ``--profile`` adds, at
the largest batch, one run under torch.profiler: kernel launches per step, device→host copies per
step and the share of wall time the device was busy (the decode is host-bound where it is low).

- ``shipped``: ``artifacts/multi30k-de-en`` on test_2016's German sentences (as the service
  tokenizes them); outputs end where the model puts eos.
- ``opus``: random weights of OPUS-MT's shape (``benchmarks.opus_shape.OPUS_MT``: 6+6 layers,
  d_model 512, 58,101 pieces, ~74M parameters) with eos's output bias at -1e4, so that every output
  is exactly ``--opus-length`` tokens; sources are 20 random token ids.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import DATA, DEFAULT_MODEL
from model.decoding.batch import decode
from model.decoding.options import DecodeOptions
from model.runtime.runners import load_runner
from model.transformer import Transformer
from training.data import read_lines

OPUS_SOURCE_TOKENS = 20
Work = tuple[Transformer, list[list[int]], DecodeOptions]  # a model, its sources, their options


def shipped(device: str, dtype: str, limit: int, data: Path) -> Work:
    from model.decoding.translator import Translator

    t = Translator.load(DEFAULT_MODEL, device=device, dtype=dtype, compile=False)
    texts = read_lines(data / "test_2016_flickr.de.gz")[:limit]
    return t.model, t.source_ids(texts), DecodeOptions(max_output_tokens=256)


def opus(device: str, dtype: str, limit: int, length: int) -> Work:
    from benchmarks.opus_shape import OPUS_MT, OPUS_MT_VOCAB, random_ours

    model = random_ours(OPUS_MT, vocab_size=OPUS_MT_VOCAB, seed=0, output_bias=True)
    cfg = model.cfg
    assert model.output_bias is not None
    with torch.no_grad():
        model.output_bias[cfg.eos_id] = -1e4  # never ends early: every output is `length` tokens
    model = model.to(device=device, dtype=getattr(torch, dtype))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(cfg.eos_id + 1, cfg.vocab_size, (limit, OPUS_SOURCE_TOKENS), generator=g)
    sources = [[*row, cfg.eos_id] for row in ids.tolist()]
    options = DecodeOptions(max_output_tokens=length + 1, max_length_a=0.0, max_length_b=length + 1)
    return model, sources, options


class Counted:
    """A runner that counts its calls (decoding steps)."""

    def __init__(self, runner: Any) -> None:
        self.runner, self.align, self.kind, self.calls = runner, runner.align, runner.kind, 0

    def __call__(self, *args: torch.Tensor) -> Any:
        self.calls += 1
        return self.runner(*args)

    def new_cache(self, *, capacity: int, positions: int) -> Any:
        return self.runner.new_cache(capacity=capacity, positions=positions)

    def encode(self, src: torch.Tensor) -> Any:
        return self.runner.encode(src)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(
    model: Transformer,
    sources: list[list[int]],
    options: DecodeOptions,
    *,
    runner_kind: str,
    beam: int,
    batch: int,
    device: str,
    profile: bool,
) -> dict[str, Any]:
    options = options.but(beam_size=beam)
    capacity = max(batch * beam, 2)
    positions = options.positions(model.cfg.max_positions)
    runner = Counted(
        load_runner(
            model,
            top=options.candidates(beam),
            capacity=capacity,
            positions=positions,
            compile=runner_kind == "compiled",
        )
    )

    def run(srcs: list[list[int]]) -> tuple[float, int]:
        sync(device)
        started = time.perf_counter()
        with torch.inference_mode():
            hyps = decode(model, runner, srcs, options, capacity=capacity, positions=positions)
        sync(device)
        return time.perf_counter() - started, sum(len(h[0].tokens) for h in hyps)

    row: dict[str, Any] = {"runner": runner.kind, "beam": beam, "batch": batch}
    if batch == 1:
        run(sources[:2])
        latencies = [run([s])[0] for s in sources[: min(len(sources), 50)]]
        row["latency_p50_ms"] = statistics.median(latencies) * 1000
        return row
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    run(sources[: 2 * batch])  # warm-up (a compiled step compiles here; graphs are captured)
    row["capture_s"] = getattr(runner.runner, "capture_seconds", None)
    runner.calls = 0
    seconds, tokens = run(sources)
    row.update(
        tokens_per_s=tokens / seconds,
        sentences_per_s=len(sources) / seconds,
        steps=runner.calls,
        ms_per_step=seconds / max(runner.calls, 1) * 1000,
        peak_device_mib=torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None,
    )
    if profile:
        row.update(profiled(lambda: run(sources[:batch]), runner, device))
    return row


def profiled(run: Callable[[], tuple[float, int]], runner: Counted, device: str) -> dict[str, Any]:
    """Launches, device→host copies and device busy time of one ``run``, per step."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    runner.calls = 0
    with profile(activities=activities) as prof:
        seconds, _ = run()
    events = prof.key_averages()
    steps = max(runner.calls, 1)
    launches = sum(e.count for e in events if "LaunchKernel" in e.key or "GraphLaunch" in e.key)
    to_host = sum(e.count for e in events if "DtoH" in e.key or e.key == "aten::_local_scalar_dense")
    busy_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return {
        "profile_wall_ms": seconds * 1000,
        "launches_per_step": launches / steps,
        "to_host_per_step": to_host / steps,
        "device_busy": busy_us / 1000 / (seconds * 1000),
        "by_device": events.table(sort_by="self_device_time_total", row_limit=8) if device == "cuda" else "",
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--models", nargs="+", default=["shipped", "opus"], choices=["shipped", "opus"])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--runners", nargs="+", default=["eager"], choices=["eager", "compiled"])
    p.add_argument("--beams", type=int, nargs="+", default=[1, 5])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--limit", type=int, default=1000, help="sources per measured run")
    p.add_argument("--opus-length", type=int, default=24, help="output tokens per OPUS-size sentence")
    p.add_argument("--profile", action="store_true", help="profile the largest batch")
    p.add_argument("--data", type=Path, default=DATA)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for name in args.models:
        for dtype in args.dtypes:
            if name == "shipped":
                model, sources, options = shipped(args.device, dtype, args.limit, args.data)
            else:
                model, sources, options = opus(args.device, dtype, args.limit, args.opus_length)
            for kind in args.runners:
                for beam in args.beams:
                    for batch in args.batch_sizes:
                        row = {"model": name, "dtype": dtype}
                        try:
                            row.update(
                                measure(
                                    model,
                                    sources,
                                    options,
                                    runner_kind=kind,
                                    beam=beam,
                                    batch=batch,
                                    device=args.device,
                                    profile=args.profile and batch == max(args.batch_sizes),
                                )
                            )
                        except Exception as e:  # noqa: BLE001 - the error is the result
                            row["error"] = f"{type(e).__name__}: {e}"
                        table = row.pop("by_device", "")
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                        if table:
                            print(table, flush=True)
            del model
            if args.device == "cuda":
                torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
