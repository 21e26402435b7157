"""Many models on one machine: start-up, memory and throughput with N models served by one set of
workers (issue 30: LibreTranslate serves dozens of pairs from one machine).

N random-weight Transformers of OPUS-MT's size (d_model 512, 8 heads, 6 + 6 layers, d_ff 2048,
58,101-entry shared vocabulary, tied embeddings, 512 positions: ~74M parameters, ~300 MB of float32
weights each) are written once into a folder (``--out``, reused when it is there), each with its
own pair: x->en and en->x for N/2 languages. The tokenizer is the shipped model's SentencePiece
model, mapped through a 58,101-piece ``shared_vocabulary.json`` (its 8,000 pieces, then fillers it
never produces), as imported OPUS-MT models are. Random weights never choose eos: every output runs
to its length limit, set here to 12 tokens (``NMT_MAX_LENGTH_A=0``, ``NMT_MAX_LENGTH_B=12``), the
same for every run.

For each set (the first 2 models, then all N) a server is started as deployed (``uvicorn
app.main:app``, the default settings: one worker per core, int8; ``NMT_COMPILE=false`` unless
``--compile``), and reported: seconds to /health/ready, the resident memory (RSS, from /proc) of
the front end and of each worker once ready, once every model is loaded (each by the worker that
owns it, in the background; idle), and after the load, beside the weights each worker holds
(``/info``: weight_mb), and sentences/s and latency under ``wrk`` with ``--connections``
connections, each request one sentence of a pair drawn at random (``loads``): uniformly over the
pairs for each of ``--beams``; one pair alone; and skewed, 80 % of the requests on two pairs.
The one-pair load runs twice: once while the workers load the other models in the background
(right after ready), once every model is loaded.
Then, with the server stopped, the LibreTranslate-style reference on the uniform loads
(``benchmarks.many_reference``: two processes, a CTranslate2 int8 translator per pair in each, one
request at a time), and our ratio to it. ``--before REPO``: the 2-model point again with the server
of another checkout (main, before this change).

    .venv/bin/python -m benchmarks.many_models --compile --models 20 --json many.json   # ~15 min
    .venv/bin/python -m benchmarks.many_models --models 2 --before /work/main
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import benchmarks.load
from benchmarks.common import DEFAULT_MODEL, REPO
from benchmarks.load import http_get, metric, process_tree, run_wrk, serve, wait_idle
from benchmarks.many_reference import ct2_models, run_reference
from benchmarks.models import post_json, record, write_report
from benchmarks.opus_shape import OPUS_MT, OPUS_MT_VOCAB, random_ours

MAX_TOKENS = 12  # every output, eos included: random weights never choose eos
benchmarks.load.START_TIMEOUT_S = 1500.0  # 20 models of this size load for minutes on 2 cores

LANGUAGES = ["de", "fr", "es", "it", "pt", "nl", "sv", "da", "fi", "pl", "cs", "ru", "uk", "tr", "hu"]
_TEXT = (
    "ein mann eine frau zwei kinder hund katze spielt läuft sitzt steht auf dem der die das im park "
    "straße wasser ball rot blau grün großen kleinen hält trägt schaut vor einem gebäude mit hut "
    "a man woman two children dog cat plays runs sits stands on the in park street water ball red"
)
WORDS = _TEXT.split()


def opus_sized(out: Path, source: str, target: str, seed: int, spm: Path) -> Path:
    """A random model directory of OPUS-MT's size for ``source``->``target``."""
    import sentencepiece

    from model.checkpoint import ModelInfo, save_model_dir

    processor = sentencepiece.SentencePieceProcessor(model_file=str(spm))
    pieces = [processor.id_to_piece(i) for i in range(processor.get_piece_size())]
    pieces += [f"<filler{i}>" for i in range(OPUS_MT_VOCAB - len(pieces))]
    model = random_ours(OPUS_MT, vocab_size=OPUS_MT_VOCAB, seed=seed)
    info = ModelInfo(
        config=model.cfg, source_lang=source, target_lang=target, training={"note": "random weights"}
    )
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_model_dir(tmp, model, info, spm)
    (tmp / "shared_vocabulary.json").write_text(json.dumps(pieces))
    tmp.rename(out)
    return out


def generate(root: Path, count: int) -> list[Path]:
    """``count`` model directories under ``root`` (made once): x->en and en->x per language."""
    pairs = [p for lang in LANGUAGES for p in ((lang, "en"), ("en", lang))][:count]
    spm = DEFAULT_MODEL / "sentencepiece.model"
    root.mkdir(parents=True, exist_ok=True)
    dirs = []
    for i, (source, target) in enumerate(pairs):
        path = root / f"{i:02d}-{source}-{target}"
        if not path.is_dir():
            started = time.perf_counter()
            opus_sized(path, source, target, seed=i, spm=spm)
            print(f"made {path.name} in {time.perf_counter() - started:.1f} s", flush=True)
        dirs.append(path)
    return dirs


def rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def memory(pid: int) -> dict[str, Any]:
    """RSS of the front end and of each of its worker processes (its other children, e.g.
    multiprocessing's resource tracker, counted in the total only), MiB."""
    tree = process_tree(pid)
    per = {p: rss_mib(p) for p in tree}
    workers = sorted((v for p, v in per.items() if p != pid and v > 200), reverse=True)
    return {
        "front_end_mib": round(per.get(pid, 0)),
        "workers_mib": [round(v) for v in workers],
        "total_mib": round(sum(per.values())),
    }


# The loads of a point: (name, the pairs' weights, beam). Uniform: every pair alike; single: one
# pair alone (the reference for the skewed load's hot pairs); skewed: 80 % of the requests on 2
# pairs, the rest spread over all.
def loads(pairs: list[tuple[str, str]], beams: list[int]) -> list[tuple[str, list[float], int]]:
    uniform = [1.0] * len(pairs)
    hot = 0.8 * (len(pairs) - 2) / (2 * 0.2)  # two pairs' weight: 80 % of the requests
    skewed = [hot if i < 2 else 1.0 for i in range(len(pairs))]
    single = one_pair(pairs)
    return [
        *((f"uniform-beam{b}", uniform, b) for b in beams),
        ("single-beam1", single, 1),
        ("skewed-beam1", skewed, 1),
    ]


def one_pair(pairs: list[tuple[str, str]]) -> list[float]:
    """The weights of a load on the first pair alone."""
    return [1.0 if i == 0 else 0.0 for i in range(len(pairs))]


def requests(
    pairs: list[tuple[str, str]], weights: list[float], *, sentences: int = 400, seed: int = 0
) -> list[tuple[str, str, str]]:
    """(source, target, text) per request: a random sentence of a pair drawn by ``weights``."""
    rng = random.Random(seed)
    out = []
    for _ in range(sentences):
        source, target = rng.choices(pairs, weights)[0]
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 16))).capitalize() + "."
        out.append((source, target, text))
    return out


def bodies(drawn: list[tuple[str, str, str]], beam: int, path: Path) -> Path:
    """One request body per line, one sentence each."""
    with path.open("w", encoding="utf-8") as f:
        for source, target, text in drawn:
            f.write(json.dumps({"q": text, "source": source, "target": target, "beam_size": beam}) + "\n")
    return path


def point(
    dirs: list[Path],
    tmp: Path,
    *,
    connections: int,
    duration_s: float,
    compile: bool,
    repo: Path | None,
    extra_env: dict[str, str],
    beams: list[int],
) -> dict[str, Any]:
    env = {
        **extra_env,
        "NMT_MODEL_DIR": ",".join(str(d.resolve()) for d in dirs),
        "NMT_COMPILE": "true" if compile else "false",
        # Kept beside the models: a second run starts warm, as a deployed server does after its
        # first start (or with the image's PRECOMPILE=true); delete it for a cold start.
        "NMT_COMPILE_CACHE_DIR": str(dirs[0].parent / "compiled"),
        # Random weights never choose eos: every output is cut at 12 tokens, a short sentence's length.
        "NMT_MAX_LENGTH_A": "0",
        "NMT_MAX_LENGTH_B": str(MAX_TOKENS),
        "NMT_REQUEST_TIMEOUT_S": "120",
    }
    log = tmp / f"uvicorn-{len(dirs)}-{'before' if repo else 'after'}.log"
    started = time.perf_counter()
    with serve(env, log, repo=repo or REPO) as server:
        ready_s = time.perf_counter() - started
        pid = server.process.pid
        info = json.loads(http_get(f"{server.url}/info", timeout_s=30)[1])
        pairs = [tuple(d.split("-", 1)) for m in info["models"] for d in m["directions"]]
        result: dict[str, Any] = {
            "models": len(info["models"]),
            "server": "before" if repo else "after",
            "workers": info["models"][0]["workers"]
            if repo is None
            else sum(m["workers"] for m in info["models"]),
            "ready_s": round(ready_s, 1),
            "weights_per_worker_mib": round(sum(m.get("weight_mb", 0) for m in info["models"])),
            "memory_ready": memory(pid),
        }
        first = {}
        for source, target in pairs[:4]:
            t0 = time.perf_counter()
            status, _ = post_json(
                f"{server.url}/translate", {"q": "Ein Mann.", "source": source, "target": target}
            )
            first[f"{source}-{target}"] = (status, round(time.perf_counter() - t0, 3))
        result["first_request_s"] = first
        # A steady single-pair load while the workers load the other models in the background
        # (the same load once every model is loaded: "single-beam1" below).
        single = one_pair(pairs)  # type: ignore[arg-type]
        wrk = run_wrk(
            server.url,
            bodies(requests(pairs, single), 1, tmp / "bodies.jsonl"),  # type: ignore[arg-type]
            connections=connections,
            duration_s=duration_s,
        )
        result["single_while_loading"] = {
            "sentences_per_s": round(wrk.answered_per_s, 1),
            "statuses": wrk.statuses,
            "latency_ms": wrk.latency_ms,
            "loads_done": metric(server, "nmt_model_loads_total"),
        }
        print("single-while-loading", result["single_while_loading"], flush=True)
        # Every model held by a worker (its owner loads it in the background once ready).
        while any(
            m["held_by"] == 0 for m in json.loads(http_get(f"{server.url}/info", timeout_s=30)[1])["models"]
        ):
            assert time.perf_counter() - started < benchmarks.load.START_TIMEOUT_S, "the models never loaded"
            time.sleep(0.5)
        result["all_loaded_s"] = round(time.perf_counter() - started, 1)
        time.sleep(3.0)  # idle: a worker gives back what loading freed (app.serving.worker.process)
        result["memory_all_loaded_idle"] = memory(pid)
        wait_idle(server)
        result["wrk"] = {}
        for name, weights, beam in loads(pairs, beams):  # type: ignore[arg-type]
            wrk = run_wrk(
                server.url,
                bodies(requests(pairs, weights), beam, tmp / "bodies.jsonl"),  # type: ignore[arg-type]
                connections=connections,
                duration_s=duration_s,
            )
            result["wrk"][name] = {
                "connections": connections,
                "sentences_per_s": round(wrk.answered_per_s, 1),
                "statuses": wrk.statuses,
                "latency_ms": wrk.latency_ms,
                # every load so far: a rise is a hot model's copy in another worker
                "loads_done": metric(server, "nmt_model_loads_total"),
            }
            print(name, result["wrk"][name], flush=True)
        result["memory_after_load"] = memory(pid)
        result["loads"] = metric(server, "nmt_model_loads_total")
        result["evictions"] = metric(server, "nmt_model_evictions_total")
    return result


def reference(dirs: list[Path], out: Path, beams: list[int], duration_s: float) -> dict[str, Any]:
    """The LibreTranslate-style reference (``benchmarks.many_reference``) on the uniform load."""
    converted = ct2_models(dirs, out)
    by_pair = {d.name.split("-", 1)[1]: c for d, c in zip(dirs, converted, strict=True)}
    pairs = [tuple(p.split("-")) for p in by_pair]
    drawn = [(f"{s}-{t}", text) for s, t, text in requests(pairs, [1.0] * len(pairs))]  # type: ignore[arg-type]
    spm = converted[0] / "sentencepiece.model"
    runs = {}
    for beam in beams:
        runs[f"beam{beam}"] = run_reference(
            by_pair, drawn, spm=spm, beam=beam, max_tokens=MAX_TOKENS, duration_s=duration_s
        )
        print("reference", beam, runs[f"beam{beam}"], flush=True)
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "nmt-many-models")
    parser.add_argument("--models", type=int, nargs="+", default=[2, 20], help="model counts, one point each")
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--compile", action="store_true", help="the compiled step (NMT_COMPILE=true)")
    parser.add_argument("--before", type=Path, help="another checkout: its server for the 2-model point too")
    parser.add_argument("--env", action="append", default=[], help="NMT_X=VALUE for the server, repeatable")
    parser.add_argument("--json", type=Path, help="write the results here too")
    parser.add_argument("--beams", type=int, nargs="+", default=[1, 4], help="the uniform load's beams")
    parser.add_argument(
        "--no-reference",
        action="store_true",
        help="skip the LibreTranslate-style reference (benchmarks.many_reference)",
    )
    args = parser.parse_args(argv)
    extra_env = dict(item.split("=", 1) for item in args.env)
    dirs = generate(args.out, max(args.models))
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="nmt-many-") as tmp:
        runs: list[tuple[int, Path | None]] = [(n, None) for n in args.models]
        if args.before:
            runs.insert(0, (min(args.models), args.before))
        for n, repo in runs:
            result = point(
                dirs[:n],
                Path(tmp),
                connections=args.connections,
                duration_s=args.duration,
                compile=args.compile,
                repo=repo,
                extra_env=extra_env,
                beams=args.beams,
            )
            if not args.no_reference and repo is None:
                result["reference"] = reference(dirs[:n], args.out / "ct2", args.beams, args.duration)
                for beam in args.beams:
                    ours = result["wrk"][f"uniform-beam{beam}"]["sentences_per_s"]
                    theirs = result["reference"][f"beam{beam}"]["sentences_per_s"]
                    result["wrk"][f"uniform-beam{beam}"]["vs_reference"] = round(ours / theirs, 2)
            record(results, {**result, "env": extra_env})
    write_report(results, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
