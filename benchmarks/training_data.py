"""Training data of any size: preparation throughput, and the trainer's peak memory at two sizes.

Generates a synthetic parallel corpus (Zipf-distributed words of two made-up languages, 3-25 words a
sentence, 1,000 validation pairs), then for each size (by default the first 0.5 M pairs and all
5 M): ``python -m training.prepare`` (the wall time, as pairs/s, and its peak RSS); the data path
alone reading 2,000 batches (its peak RSS); and ``python -m training.train`` for 20 steps on the
prepared data (the shipped model's architecture and batch size, training/configs/multi30k_de_en.toml)
once per seed (other seeds, other batches: which batches come up moves the peak by ~100 MB) and
its peak RSS (``ru_maxrss`` of the process, from ``wait4``). The goal: the same peak RSS at both
sizes (within 10 %), under 2 GiB. Each command runs in its own process, one after the other.

    .venv/bin/python -m benchmarks.training_data                    # ~40 min on 2 busy cores, ~2 GB disk
    .venv/bin/python -m benchmarks.training_data --sizes 100000 1000000 --work /tmp/td
    .venv/bin/python -m benchmarks.training_data --baseline ../main    # also the code at ../main, raw files

``--baseline DIR`` also runs 20 steps with another checkout's trainer on the raw files (e.g. the
code before prepared data) at the sizes given by ``--baseline-sizes``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import string
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import REPO, cpu_busy_seconds, cpu_name
from training.config import TrainConfig
from training.data import PreparedCorpus, iterate
from training.sampling import EpochPlan

CONFIG = REPO / "training" / "configs" / "multi30k_de_en.toml"
VOCABULARY = 20_000  # distinct words per language
VALID = 1_000


def make_words(rng: np.random.Generator, n: int) -> np.ndarray:
    letters = np.array(list(string.ascii_lowercase + "äöüéß"))
    return np.array(["".join(rng.choice(letters, rng.integers(2, 11))) for _ in range(n)], dtype=object)


def generate(path: Path, pairs: int, seed: int = 0, block: int = 100_000) -> None:
    """``train.{de,en}`` with ``pairs`` lines and ``val.{de,en}`` with 1,000: made-up words, the
    target word-for-word from the source with some words dropped (so lengths differ a little)."""
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    src_words, tgt_words = make_words(rng, VOCABULARY), make_words(rng, VOCABULARY)
    zipf = 1.0 / np.arange(1, VOCABULARY + 1)
    zipf /= zipf.sum()
    for split, n in (("train", pairs), ("val", VALID)):
        with open(path / f"{split}.de", "w") as fs, open(path / f"{split}.en", "w") as ft:
            for start in range(0, n, block):
                m = min(block, n - start)
                lengths = rng.integers(3, 26, m)
                ids = rng.choice(VOCABULARY, int(lengths.sum()), p=zipf)
                keep = rng.random(len(ids)) > 0.1
                ends = np.cumsum(lengths)
                src, tgt = [], []
                for a, b in zip(ends - lengths, ends, strict=True):
                    src.append(" ".join(src_words[ids[a:b]]).capitalize() + ".\n")
                    tgt.append(" ".join(tgt_words[ids[a:b][keep[a:b]]]).capitalize() + ".\n")
                fs.write("".join(src))
                ft.write("".join(tgt))


def subset(full: Path, path: Path, pairs: int) -> None:
    """The first ``pairs`` lines of ``full``'s training files, and its validation files."""
    path.mkdir(parents=True, exist_ok=True)
    for lang in ("de", "en"):
        with open(full / f"train.{lang}") as f, open(path / f"train.{lang}", "w") as out:
            for _, line in zip(range(pairs), f, strict=False):
                out.write(line)
        (path / f"val.{lang}").write_bytes((full / f"val.{lang}").read_bytes())


def run(cmd: list[str], log: Path, cwd: Path = REPO, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``cmd`` to completion: its wall time, CPU time, peak RSS, and the CPU that other
    processes took meanwhile (a fraction of the machine: on a shared machine they slow it down)."""
    with open(log, "w") as out:
        busy, start = cpu_busy_seconds(), time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds, busy_after = time.perf_counter() - start, cpu_busy_seconds()
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"failed: {' '.join(cmd)} (see {log})")
    cpu = usage.ru_utime + usage.ru_stime
    others = None if busy is None or busy_after is None else max(0.0, busy_after - busy - cpu)
    capacity = seconds * (os.cpu_count() or 1)
    return {
        "seconds": round(seconds, 1),
        "cpu_seconds": round(cpu, 1),
        "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),  # Linux: kilobytes
        "others_cpu_fraction": None if others is None else round(others / capacity, 2),
    }


def bench_config(work: Path, steps: int, seed: int) -> Path:
    """The shipped recipe, stopped after ``steps`` optimizer steps, with another seed (other batches)."""
    text = CONFIG.read_text()
    text = re.sub(r"^\[train\]$", f"[train]\nmax_steps = {steps}", text, flags=re.M)
    text = re.sub(r"^seed = \d+", f"seed = {seed}", text, flags=re.M)
    path = work / f"bench-seed{seed}.toml"
    path.write_text(text)
    return path


def read_batches(prepared: Path, batches: int) -> None:
    """The trainer's data path alone (run in its own process, for its peak RSS): open the prepared
    corpus, plan an epoch as training does, and read ``batches`` batches from it."""
    cfg = TrainConfig.load(CONFIG)
    corpus = PreparedCorpus(prepared)
    sizes = [d.sizes for d in corpus.train]
    plan = EpochPlan(sizes, max_tokens=cfg.train.max_tokens, pool=cfg.train.shuffle_pool, seed=1, epoch=0)
    len(plan)
    for _ in zip(range(batches), iterate(corpus.train, plan), strict=False):
        pass


def spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": float(statistics.median(values)), "max": max(values)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=REPO / "runs" / "bench-training-data")
    p.add_argument("--sizes", type=int, nargs="+", default=[500_000, 5_000_000])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="a training run per seed and size")
    p.add_argument("--read", type=int, default=2000, help="batches the data path alone reads")
    p.add_argument("--baseline", type=Path, help="another checkout whose trainer to run on the raw files")
    p.add_argument("--baseline-sizes", type=int, nargs="+", default=[500_000])
    p.add_argument("--output", type=Path, default=REPO / "benchmarks" / "results" / "training_data.json")
    p.add_argument("--read-batches", type=Path, help=argparse.SUPPRESS)  # internal: read_batches(DIR)
    args = p.parse_args(argv)
    if args.read_batches:
        read_batches(args.read_batches, args.read)
        return
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    full = work / f"corpus-{max(args.sizes)}"
    if not (full / "val.en").is_file():
        print(f"generating {max(args.sizes):,} pairs in {full}", file=sys.stderr)
        generate(full, max(args.sizes))
    configs = {seed: bench_config(work, args.steps, seed) for seed in args.seeds}
    py = sys.executable
    report: dict[str, Any] = {
        "machine": f"{cpu_name()}, {os.cpu_count()} cores",
        "config": str(CONFIG.relative_to(REPO)),
        "steps": args.steps,
        "seeds": args.seeds,
        "sizes": [],
    }
    for size in sorted(args.sizes):
        data = full if size == max(args.sizes) else work / f"corpus-{size}"
        if not (data / "val.en").is_file():
            subset(full, data, size)
        prepared = work / f"prepared-{size}"
        common = ["--data-dir", str(data), "--prepared-dir", str(prepared)]
        print(f"{size:,} pairs: preparing", file=sys.stderr)
        prep = run(
            [py, "-m", "training.prepare", "--config", str(configs[args.seeds[0]]), *common],
            work / f"prepare-{size}.log",
        )
        (corpus,) = prepared.glob("data-*")
        arrays_s = json.loads((corpus / "manifest.json").read_text())["seconds"]
        print(f"{size:,} pairs: reading {args.read} batches", file=sys.stderr)
        cmd = [py, "-m", "benchmarks.training_data", "--read-batches", str(corpus), "--read", str(args.read)]
        read = run(cmd, work / f"read-{size}.log")
        trained = []
        for seed, config in configs.items():
            print(f"{size:,} pairs: training {args.steps} steps, seed {seed}", file=sys.stderr)
            cmd = [
                py,
                "-m",
                "training.train",
                "--config",
                str(config),
                *common,
                "--out",
                str(work / f"run-{size}-{seed}"),
            ]
            trained.append({"seed": seed, **run(cmd, work / f"train-{size}-{seed}.log")})
        row = {
            "pairs": size,
            "prepare": {**prep, "pairs_per_s": round(size / prep["seconds"]), "arrays_seconds": arrays_s},
            "prepare_arrays_pairs_per_s": round(size / arrays_s),
            "prepared_mib": round(sum(f.stat().st_size for f in corpus.iterdir()) / 2**20, 1),
            "read_batches": {"batches": args.read, **read},
            "train": trained,
            "train_peak_rss_mib": spread([t["peak_rss_mib"] for t in trained]),
        }
        report["sizes"].append(row)
        print(json.dumps(row), file=sys.stderr)
    if args.baseline:
        report["baseline"] = {"checkout": str(args.baseline), "seed": args.seeds[0], "sizes": []}
        for size in sorted(args.baseline_sizes):
            data = full if size == max(args.sizes) else work / f"corpus-{size}"
            if not (data / "val.en").is_file():
                subset(full, data, size)
            print(f"{size:,} pairs: baseline training {args.steps} steps", file=sys.stderr)
            cmd = [
                py,
                "-m",
                "training.train",
                "--config",
                str(configs[args.seeds[0]]),
                "--data-dir",
                str(data),
            ]
            cmd += ["--out", str(work / f"baseline-{size}")]
            env = {**os.environ, "PYTHONPATH": str(args.baseline.resolve())}
            old = run(cmd, work / f"baseline-{size}.log", args.baseline.resolve(), env)
            report["baseline"]["sizes"].append({"pairs": size, "train": old})
            print(json.dumps(report["baseline"]["sizes"][-1]), file=sys.stderr)
    first, last = report["sizes"][0], report["sizes"][-1]
    report["largest_to_smallest"] = {
        "train_peak_rss_median": round(
            last["train_peak_rss_mib"]["median"] / first["train_peak_rss_mib"]["median"], 3
        ),
        "train_peak_rss_max": round(
            last["train_peak_rss_mib"]["max"] / first["train_peak_rss_mib"]["max"], 3
        ),
        "read_peak_rss": round(
            last["read_batches"]["peak_rss_mib"] / first["read_batches"]["peak_rss_mib"], 3
        ),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
