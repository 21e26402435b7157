"""Several models in one service: what each more model costs at start-up and in memory.

For each set of model directories a server is started as deployed (``uvicorn app.main:app``,
default settings: workers per model = cores, int8, the compiled step), first with an empty compile
cache (``cold``: every model's step compiled), then again with the cache it filled (``warm``).
Reported per start: seconds until /health/ready, the resident memory of the front end and its
workers (peak, VmHWM summed over the processes: an upper bound of what compiling needed at once),
their proportional memory (PSS summed) once ready and after one request per direction, and the
latency of that request.

``--twin`` stands in for a second model of the same size where only one is shipped: a copy of the
first model directory, its weights changed by a factor of 1 + 1e-6 (so its step is compiled anew,
not found in the cache) and its direction reversed (``de-en`` -> ``en-de``); its translations are
of no interest here.

    .venv/bin/python -m benchmarks.models --twin --json models.json       # ~6 min on 2 cores
    .venv/bin/python -m benchmarks.models --models artifacts/multi30k-de-en --models artifacts
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

from benchmarks.common import DEFAULT_MODEL
from benchmarks.load import http_get, machine, peak_rss_mib, pss_mib, serve
from model.checkpoint import CONFIG_FILE, WEIGHTS_FILE, read_info

SENTENCES = {"de": "Ein Mann fährt Fahrrad.", "en": "A man is riding a bike.", "fr": "Un homme fait du vélo."}


def twin(model_dir: Path, out: Path) -> Path:
    """A stand-in second model (see the module's docstring)."""
    shutil.copytree(model_dir, out)
    weights = load_file(str(out / WEIGHTS_FILE))
    save_file({k: (v * (1 + 1e-6)).contiguous() for k, v in weights.items()}, str(out / WEIGHTS_FILE))
    config = json.loads((out / CONFIG_FILE).read_text())
    config["source_lang"], config["target_lang"] = config["target_lang"], config["source_lang"]
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return out


def directions(paths: list[Path]) -> list[tuple[str, str]]:
    found = []
    for path in paths:
        dirs = (
            [path]
            if (path / CONFIG_FILE).is_file()
            else sorted(p.parent for p in path.glob(f"*/{CONFIG_FILE}"))
        )
        found += [pair for d in dirs for pair in read_info(d).directions]
    return found


def post_json(url: str, body: dict[str, Any]) -> tuple[int, str]:
    import urllib.request

    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.status, response.read().decode()


def record(results: list[dict[str, Any]], point: dict[str, Any]) -> None:
    """A measured point, with the load average it was measured under: printed as it comes (a JSON
    line, so that a long run shows its progress), and kept."""
    point["load_average"] = os.getloadavg()[0]
    print(json.dumps(point), flush=True)
    results.append(point)


def write_report(results: list[dict[str, Any]], path: Path | None) -> None:
    """The points and the machine they were measured on, as JSON in ``path`` (none: nowhere)."""
    if path:
        path.write_text(json.dumps({"machine": machine(), "results": results}, indent=2) + "\n")


def start(paths: list[Path], cache: Path, log: Path) -> dict[str, Any]:
    env = {"NMT_MODEL_DIR": ",".join(str(p.resolve()) for p in paths), "NMT_COMPILE_CACHE_DIR": str(cache)}
    started = time.perf_counter()
    with serve(env, log) as server:
        ready_s = time.perf_counter() - started
        pid = server.process.pid
        info = json.loads(http_get(f"{server.url}/info", timeout_s=10)[1])
        point: dict[str, Any] = {
            "models": [m["name"] for m in info["models"]],
            "workers": sum(m["workers"] for m in info["models"]),
            "decoding": sorted({m["decoding"] for m in info["models"]}),
            "ready_s": round(ready_s, 1),
            "peak_rss_mib": round(peak_rss_mib(pid)),
            "pss_ready_mib": round(pss_mib(pid)),
        }
        latencies = {}
        for source, target in directions(paths):
            body = {"q": SENTENCES.get(source, "x"), "source": source, "target": target}
            t0 = time.perf_counter()
            status, _ = post_json(f"{server.url}/translate", body)
            latencies[f"{source}-{target}"] = (status, round(time.perf_counter() - t0, 3))
        point["first_request_s"] = latencies
        point["pss_after_requests_mib"] = round(pss_mib(pid))
    return point


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--models",
        action="append",
        type=Path,
        help="a model directory or a folder of them, one set per use (default: the shipped model)",
    )
    parser.add_argument(
        "--twin", action="store_true", help="also the shipped model beside a stand-in second one"
    )
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="nmt-models-") as tmp:
        sets = [[p] for p in args.models or [DEFAULT_MODEL]]
        if args.twin:
            sets.append([DEFAULT_MODEL, twin(DEFAULT_MODEL, Path(tmp) / "twin-en-de")])
        results: list[dict[str, Any]] = []
        for i, paths in enumerate(sets):
            cache = Path(tmp) / f"cache-{i}"
            for state in ("cold", "warm"):
                point = start(paths, cache, Path(tmp) / f"uvicorn-{i}-{state}.log")
                record(results, {**point, "cache": state})
    write_report(results, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
