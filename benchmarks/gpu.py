"""The GPU checklist's measurements in one command each (docs: BENCHMARKS.md "On a GPU").

    python -m benchmarks.gpu engine --json engine.json   # Translator on CUDA, tokens/s by batch
    python -m benchmarks.gpu server --json server.json   # the service on CUDA under wrk
    python -m benchmarks.gpu train --json train.json     # training tokens/s, AMP, and torchrun

``engine``: our ``Translator`` on the GPU (weights, cache and search on the device), test_2016
German sentences text to text, for each ``--setups`` entry (``dtype:eager`` or ``dtype:compiled``),
beam size and batch size (sentences; the running batch holds batch x beam rows): sentences/s,
generated tokens/s (eos excluded), peak GPU memory, and single-sentence latency (p50 over
``--latency-sentences``). CTranslate2 on the same GPU and weights is the reference where its
CUDA build loads (its wheel needs CUDA 12's cuBLAS); otherwise the error is reported, not hidden.

``server``: the service as deployed (``benchmarks.load.serve``) with ``NMT_DEVICE=cuda``, under
``wrk`` (one sentence per request) at each ``--connections``, greedy and beam 5, then one
connection for latency; GPU memory read from nvidia-smi while it runs.

``train``: ``training.train`` on Multi30k de-en (the shipped recipe) for ``--steps`` steps with AMP
(bf16), in one process and under ``torchrun --nproc_per_node 1`` (the DDP code path): the last
logged tokens/s (source + target tokens, padding excluded) of each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import DATA, DEFAULT_MODEL, REPO
from benchmarks.opus_shape import OPUS_MT
from training.data import read_lines


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(
            gpu=p.name,
            gpu_memory_gib=round(p.total_memory / 2**30, 1),
            multiprocessors=p.multi_processor_count,
        )
    try:
        env["driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as e:
        env["driver"] = f"unknown ({e})"
    return env


def gpu_memory_used_mib() -> float | None:
    """What nvidia-smi says the GPU holds (every process: the service's workers are other processes)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
        ).stdout
    except OSError:  # no nvidia-smi: no GPU
        return None
    return float(out.split()[0]) if out.strip() else None


# -- engine ---------------------------------------------------------------------------------------
def engine(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.engine import ours
    from model.decoding.translator import Translator

    texts = read_lines(args.data / "test_2016_flickr.de.gz")[: args.limit]
    rows: list[dict[str, Any]] = []
    for setup in args.setups:
        dtype, mode = setup.split(":")
        base = Translator.load(args.model, device=args.device, dtype=dtype, compile=mode == "compiled")
        run = ours(base, args.max_length)
        for beam in args.beams:
            for batch in args.batch_sizes:
                if torch.cuda.is_available():
                    torch.cuda.reset_peak_memory_stats()
                started = time.perf_counter()
                run(texts[: batch * 2], beam, batch)  # warm-up (a compiled step compiles here)
                warm_s = time.perf_counter() - started
                runs = [run(texts, beam, batch) for _ in range(args.repeats)]
                seconds = statistics.median(r.seconds for r in runs)
                row = {
                    "setup": setup,
                    "beam": beam,
                    "batch": batch,
                    "sentences_per_s": len(texts) / seconds,
                    "tokens_per_s": runs[0].tokens / seconds,
                    "peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20
                    if torch.cuda.is_available()
                    else None,
                    "warm_up_s": warm_s,
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
            lat = run(texts[: args.latency_sentences], beam, 1)
            p50 = statistics.median(lat.latencies) * 1000
            rows.append({"setup": setup, "beam": beam, "batch": 1, "latency_p50_ms": p50})
            print(json.dumps(rows[-1]), flush=True)
        del base, run
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return {"ours": rows, "ctranslate2": ctranslate2_reference(args, texts)}


def ctranslate2_reference(args: argparse.Namespace, texts: list[str]) -> list[dict[str, Any]] | str:
    try:
        import ctranslate2

        from benchmarks.engine import ctranslate2_engine
        from model.export_ctranslate2 import export
        from model.tokenizer import Tokenizer

        if ctranslate2.get_cuda_device_count() < 1:
            return "CTranslate2 sees no CUDA device"
        out: list[dict[str, Any]] = []
        with tempfile.TemporaryDirectory() as tmp:
            ct2_dir = export(args.model, Path(tmp) / "ct2", quantization="float32")
            tok = Tokenizer(Path(ct2_dir) / "sentencepiece.model")
            for compute_type in ("float32", "bfloat16"):
                ct2 = ctranslate2.Translator(str(ct2_dir), device="cuda", compute_type=compute_type)
                run = ctranslate2_engine(ct2, tok, args.max_length)
                for beam in args.beams:
                    for batch in args.batch_sizes:
                        run(texts[: batch * 2], beam, batch)
                        seconds = statistics.median(
                            run(texts, beam, batch).seconds for _ in range(args.repeats)
                        )
                        tokens = run(texts, beam, batch).tokens
                        out.append(
                            {
                                "compute_type": compute_type,
                                "beam": beam,
                                "batch": batch,
                                "sentences_per_s": len(texts) / seconds,
                                "tokens_per_s": tokens / seconds,
                            }
                        )
                        print(json.dumps(out[-1]), flush=True)
        return out
    except Exception as e:  # noqa: BLE001 - reported: the reference's absence is a result
        return f"{type(e).__name__}: {e}"


def profile(args: argparse.Namespace) -> dict[str, Any]:
    """Where a batch's time goes on the device: torch.profiler over one ``translate_batch`` of
    ``--batch-sizes[0]`` sentences per setup and beam (after a warm-up), the top operators by host
    time and by device time, and the share of wall time the device was busy."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from benchmarks.engine import ours
    from model.decoding.translator import Translator

    texts = read_lines(args.data / "test_2016_flickr.de.gz")
    batch = args.batch_sizes[0]
    out: dict[str, Any] = {}
    for setup in args.setups:
        dtype, mode = setup.split(":")
        run = ours(
            Translator.load(args.model, device=args.device, dtype=dtype, compile=mode == "compiled"), 256
        )
        for beam in args.beams:
            run(texts[:batch], beam, batch)
            with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                r = run(texts[batch : 2 * batch], beam, batch)
            events = prof.key_averages()
            device_us = sum(e.self_device_time_total for e in events)
            key = f"{setup} beam {beam} batch {batch}"
            out[key] = {
                "wall_ms": r.seconds * 1000,
                "device_busy_ms": device_us / 1000,
                "by_host": events.table(sort_by="self_cpu_time_total", row_limit=12),
                "by_device": events.table(sort_by="self_device_time_total", row_limit=12),
            }
            print(key, f"wall {r.seconds * 1000:.0f} ms, device busy {device_us / 1000:.0f} ms")
            print(out[key]["by_host"])
            print(out[key]["by_device"], flush=True)
    return out


# -- server ---------------------------------------------------------------------------------------
def server(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.load import run_wrk, serve, write_bodies

    texts = read_lines(args.data / "test_2016_flickr.de.gz")
    out: dict[str, Any] = {"runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.dtypes:
            env = {
                "NMT_MODEL_DIR": str(args.model),
                "NMT_DEVICE": args.device,
                "NMT_DTYPE": dtype,
                "NMT_MAX_BATCH_SIZE": str(args.max_batch_size),
                "NMT_MAX_BATCH_TOKENS": str(args.max_batch_size * 128),
                "NMT_COMPILE": "true" if args.compile else "false",
                "NMT_MAX_QUEUE": "8192",
            }
            log = Path(tmp) / f"server-{dtype}.log"
            try:
                with serve(env, log) as srv:
                    for beam in args.beams:
                        bodies = write_bodies(texts, Path(tmp) / f"b{beam}.jsonl", beam=beam)
                        url = f"{srv.url}/translate"
                        run_wrk(url, bodies, connections=args.connections[0], duration_s=3)  # warm-up
                        for c in args.connections:
                            r = run_wrk(url, bodies, connections=c, duration_s=args.duration)
                            row = {
                                "dtype": dtype,
                                "beam": beam,
                                "connections": c,
                                "answered_per_s": r.answered_per_s,
                                "statuses": r.statuses,
                                "latency_ms": r.latency_ms,
                                "gpu_memory_used_mib": gpu_memory_used_mib(),
                            }
                            out["runs"].append(row)
                            print(json.dumps(row), flush=True)
                        r = run_wrk(url, bodies, connections=1, duration_s=args.duration, threads=1)
                        row = {
                            "dtype": dtype,
                            "beam": beam,
                            "connections": 1,
                            "answered_per_s": r.answered_per_s,
                            "latency_ms": r.latency_ms,
                        }
                        out["runs"].append(row)
                        print(json.dumps(row), flush=True)
            except Exception as e:  # noqa: BLE001 - the error is the result, with the log's tail
                out[f"error-{dtype}"] = f"{type(e).__name__}: {e}\n{log.read_text(errors='replace')[-3000:]}"
                print(out[f"error-{dtype}"], flush=True)
    return out


# -- training -------------------------------------------------------------------------------------
# OPUS-MT's layers (benchmarks.opus_shape.OPUS_MT) on the shipped recipe's data and vocabulary.
OPUS_SIZE = {
    "d_model": OPUS_MT.d_model,
    "n_heads": OPUS_MT.heads,
    "encoder_layers": OPUS_MT.layers,
    "decoder_layers": OPUS_MT.layers,
    "d_ff": OPUS_MT.ffn,
}


def train(args: argparse.Namespace) -> dict[str, Any]:
    config = tomllib.loads((REPO / "training/configs/multi30k_de_en.toml").read_text())
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        cfg_path = Path(tmp) / "gpu.toml"
        train_cfg = {
            **config["train"],
            "max_steps": args.steps,
            "log_every": max(1, min(50, args.steps // 4)),
            "amp": "bf16" if args.device == "cuda" else "none",
            "device": args.device,
            "max_tokens": args.max_tokens,
            "checkpoint_every": 10**6,
            "epoch_checkpoints": False,
            "valid_max_sentences": 200,
        }
        cfg_path.write_text(
            toml_dump(
                {
                    "data": {**config["data"], "dir": str(args.data)},
                    "model": {**config["model"], **OPUS_SIZE} if args.opus_size else config["model"],
                    "train": train_cfg,
                }
            )
        )
        prepared = Path(tmp) / "prepared"
        launchers = {
            "python": [sys.executable, "-m", "training.train"],
            "torchrun-1": [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node",
                "1",
                "-m",
                "training.train",
            ],
        }
        for name, launcher in launchers.items():
            out_dir = Path(tmp) / name
            cmd = [
                *launcher,
                "--config",
                str(cfg_path),
                "--out",
                str(out_dir),
                "--prepared-dir",
                str(prepared),
            ]
            started = time.perf_counter()
            log_file = (args.log_dir or Path(tmp)) / f"train-{name}.log"
            with log_file.open("w") as f:  # a file, so that a run cut short still shows how far it got
                proc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, text=True)
            entry: dict[str, Any] = {"returncode": proc.returncode, "wall_s": time.perf_counter() - started}
            log = out_dir / "train_log.jsonl"
            if log.exists():
                recs = [json.loads(line) for line in log.read_text().splitlines()]
                trains = [r for r in recs if r["kind"] == "train"]
                entry["tokens_per_s"] = [round(r["tokens_per_s"]) for r in trains]
                entry["last_loss"] = trains[-1]["loss"] if trains else None
                entry["valid"] = [r for r in recs if r["kind"] == "valid"][-1:]
            if proc.returncode:
                entry["log_tail"] = log_file.read_text(errors="replace")[-3000:]
            results[name] = entry
            print(name, json.dumps(entry), flush=True)
    return results


def toml_dump(tables: dict[str, dict[str, Any]]) -> str:
    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return json.dumps(v)

    return "".join(
        f"[{name}]\n" + "".join(f"{k} = {value(v)}\n" for k, v in t.items()) for name, t in tables.items()
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["engine", "profile", "server", "train"])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--data", type=Path, default=Path(os.environ.get("NMT_BENCH_DATA", DATA)))
    p.add_argument("--device", default="cuda", help="engine: where our Translator runs")
    p.add_argument("--limit", type=int, default=None, help="first N test sentences (engine)")
    p.add_argument("--setups", nargs="+", default=["float32:eager", "bfloat16:eager", "bfloat16:compiled"])
    p.add_argument("--beams", type=int, nargs="+", default=[1, 5])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--latency-sentences", type=int, default=100)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], help="server")
    p.add_argument("--connections", type=int, nargs="+", default=[64, 256], help="server")
    p.add_argument("--duration", type=float, default=10.0, help="server: seconds per wrk run")
    p.add_argument("--max-batch-size", type=int, default=1024, help="server: NMT_MAX_BATCH_SIZE (rows)")
    p.add_argument("--compile", action="store_true", help="server: NMT_COMPILE=true")
    p.add_argument("--steps", type=int, default=400, help="train: optimizer steps")
    p.add_argument("--max-tokens", type=int, default=8192, help="train: tokens per batch")
    p.add_argument("--log-dir", type=Path, help="train: keep each run's output here")
    p.add_argument("--opus-size", action="store_true", help="train: OPUS-MT's layers (6+6, d_model 512)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    result = {
        "environment": environment(),
        args.what: {"engine": engine, "profile": profile, "server": server, "train": train}[args.what](args),
    }
    print(json.dumps(result["environment"]))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
