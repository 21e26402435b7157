"""Single-request latency: servers against CTranslate2 batch-1, in interleaved rounds.

Every server configuration (``name:NMT_VAR=value,...``) is started at once (``benchmarks.load.serve``:
uvicorn as deployed, loopback; an idle server's workers sleep on their pipes and take no CPU).
Then, ``--rounds`` times: each server in turn gets one ``wrk`` connection (a request is sent when the
previous answer came: no batching, no queue) for ``--duration`` seconds, posting the first
``--sentences`` test_2016 sentences one per request; then CTranslate2 4.x translates the same
sentences one at a time (``translate_batch`` of one, float32 weights exported from the same model,
its better thread configuration for a batch of one, in a process of its own). A round's ratio is a
server's p50 over CTranslate2's p50 of that round: on a shared machine that drifts by tens of
percent within minutes, interleaving and same-round ratios are what make configurations comparable.

    .venv/bin/python -m benchmarks.latency --rounds 6 --configs \\
        f32-one-core:NMT_QUANTIZATION=none,NMT_IDLE_CORES=false f32:NMT_QUANTIZATION=none
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

import ctranslate2
import torch

from benchmarks.common import DATA, DEFAULT_MODEL
from benchmarks.engine import Worker
from benchmarks.load import machine, run_wrk, serve, write_bodies
from benchmarks.throughput import ct2_latency, ct2_workers, parse_config
from model.export_ctranslate2 import export
from training.data import read_lines


@dataclass
class Round:
    config: str
    beam: int
    round: int
    p50_ms: float
    p99_ms: float
    ct2_p50_ms: float  # CTranslate2 batch-1 in the same round, its better thread configuration
    ct2_threads: str

    @property
    def ratio(self) -> float:
        return self.p50_ms / self.ct2_p50_ms


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--src", type=Path, default=DATA / "test_2016_flickr.de.gz")
    p.add_argument("--sentences", type=int, default=200)
    p.add_argument("--configs", nargs="+", default=["default"], help="name:NMT_VAR=value,... per server")
    p.add_argument("--beams", type=int, nargs="+", default=[1])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--duration", type=float, default=8.0, help="seconds of one connection per server")
    p.add_argument("--ct2-threads", nargs="+", default=["1x1", "1x2"], help="inter x intra threads")
    p.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()) / "nmt-latency")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    texts = read_lines(args.src)[: args.sentences]
    rounds: list[Round] = []
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        workers = ct2_workers(export(args.model, Path(tmp) / "ct2", quantization="float32"), args.ct2_threads)
        for w in workers.values():
            stack.callback(w.close)
        servers = {}
        for spec in args.configs:
            name, env = parse_config(spec)
            started = time.perf_counter()
            servers[name] = stack.enter_context(
                serve({"NMT_MODEL_DIR": str(args.model), **env}, args.log_dir / f"{name}.log")
            )
            print(f"[{name}] ready in {time.perf_counter() - started:.1f} s", flush=True)
        for beam in args.beams:
            bodies = write_bodies(texts, Path(tmp) / f"bodies-{beam}.jsonl", beam=beam)
            for server in servers.values():  # warm-up: first requests, thread pools
                run_wrk(server.url, bodies, connections=1, threads=1, duration_s=2)
            for r in range(args.rounds):
                measured = {
                    name: run_wrk(server.url, bodies, connections=1, threads=1, duration_s=args.duration)
                    for name, server in servers.items()
                }
                ct2 = best_ct2(workers, texts, beam)
                for name, result in measured.items():
                    rounds.append(
                        Round(name, beam, r, result.latency_ms["p50"], result.latency_ms["p99"], *ct2)
                    )
                    print(f"[{name}] beam {beam} round {r + 1}: {rounds[-1]} -> {rounds[-1].ratio:.2f}x")
    print()
    print(markdown(rounds))
    if args.json:
        env_info = {**machine(), "torch": torch.__version__, "ctranslate2": ctranslate2.__version__}
        data = {"environment": env_info, "rounds": [asdict(x) | {"ratio": x.ratio} for x in rounds]}
        args.json.write_text(json.dumps(data, indent=2))


def best_ct2(workers: dict[str, Worker], texts: list[str], beam: int) -> tuple[float, str]:
    """CTranslate2's batch-1 p50 (ms) in its better thread configuration, and which one."""
    p50 = {t: ct2_latency(w, texts, beam) for t, w in workers.items()}
    best = min(p50, key=lambda t: p50[t])
    return p50[best], best


def markdown(rounds: list[Round]) -> str:
    lines = [
        "| config | beam | server p50 ms per round | CT2 batch-1 p50 ms per round "
        "| ratio per round | median |",
        "|---|---:|---|---|---|---:|",
    ]
    for config, beam in dict.fromkeys((x.config, x.beam) for x in rounds):
        mine = [x for x in rounds if (x.config, x.beam) == (config, beam)]
        lines.append(
            f"| {config} | {beam} | {', '.join(f'{x.p50_ms:.1f}' for x in mine)} "
            f"| {', '.join(f'{x.ct2_p50_ms:.1f}' for x in mine)} "
            f"| {', '.join(f'{x.ratio:.2f}' for x in mine)} "
            f"| **{statistics.median(x.ratio for x in mine):.2f}×** |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
