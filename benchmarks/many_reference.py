"""A LibreTranslate-style reference for many pairs on one machine: ``processes`` processes (as
LibreTranslate's gunicorn workers), each with a CTranslate2 int8 translator for every pair, each
translating one request at a time (a request: one sentence of a pair drawn at random), text to
text, with no HTTP in front. LibreTranslate makes a translator per pair on first use; here each
is made (and warmed up) before the clock starts, so the reference pays nothing for loading.

The models are our directories converted with ``model.export_ctranslate2`` (int8 weights), made
once under ``out`` and reused. Random weights never choose eos: outputs run to
``max_output_tokens`` (eos counted, as our server's ``NMT_MAX_LENGTH_B`` counts it), so both sides
generate the same number of tokens.
"""

from __future__ import annotations

import multiprocessing as mp
import random
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from model.decoding.options import DecodeOptions, ctranslate2_options


def ct2_models(dirs: list[Path], out: Path) -> list[Path]:
    """Each model directory converted to CTranslate2 (int8), under ``out`` (made once)."""
    from model.export_ctranslate2 import export

    converted = []
    for model_dir in dirs:
        target = out / model_dir.name
        if not (target / "model.bin").is_file():
            started = time.perf_counter()
            export(model_dir, target, quantization="int8", force=True)
            print(f"converted {model_dir.name} in {time.perf_counter() - started:.1f} s", flush=True)
        converted.append(target)
    return converted


def _serve(conn: Connection, spec: dict[str, Any]) -> None:
    """One process: a translator per pair, then one request at a time until the deadline."""
    import ctranslate2
    import sentencepiece

    translators = {
        pair: ctranslate2.Translator(
            path, device="cpu", compute_type="int8", intra_threads=1, inter_threads=1
        )
        for pair, path in spec["models"].items()
    }
    sp = sentencepiece.SentencePieceProcessor(model_file=spec["spm"])
    options = ctranslate2_options(DecodeOptions(beam_size=spec["beam"], max_output_tokens=spec["max_tokens"]))
    requests: list[tuple[str, str]] = spec["requests"]
    for pair, text in requests[:2]:  # warm-up: first-call costs are not the reference's
        translators[pair].translate_batch([sp.encode(text, out_type=str)], **options)
    conn.send("ready")
    conn.recv()  # go
    latencies: list[float] = []
    rng = random.Random(spec["seed"])
    deadline = time.perf_counter() + spec["duration_s"]
    while time.perf_counter() < deadline:
        pair, text = rng.choice(requests)
        t0 = time.perf_counter()
        result = translators[pair].translate_batch([sp.encode(text, out_type=str)], **options)
        sp.decode(result[0].hypotheses[0])
        latencies.append(time.perf_counter() - t0)
    conn.send(latencies)


def run_reference(
    ct2_dirs: dict[str, Path],
    requests: list[tuple[str, str]],
    *,
    spm: Path,
    beam: int,
    max_tokens: int,
    duration_s: float,
    processes: int = 2,
) -> dict[str, Any]:
    """Sentences/s and latency of ``processes`` LibreTranslate-style processes over ``requests``
    ((pair, text), drawn at random with replacement)."""
    ctx = mp.get_context("spawn")
    children = []
    for i in range(processes):
        ours, theirs = ctx.Pipe()
        spec = {
            "models": {pair: str(path) for pair, path in ct2_dirs.items()},
            "spm": str(spm),
            "beam": beam,
            "max_tokens": max_tokens,
            "requests": requests,
            "seed": i,
            "duration_s": duration_s,
        }
        process = ctx.Process(target=_serve, args=(theirs, spec), daemon=True)
        process.start()
        children.append((process, ours))
    for _, conn in children:
        assert conn.recv() == "ready"
    for _, conn in children:
        conn.send("go")
    latencies = sorted(x for _, conn in children for x in conn.recv())
    for process, _ in children:
        process.join(30)

    def pct(q: float) -> float:
        return round(1000 * latencies[min(len(latencies) - 1, int(q * len(latencies)))], 1)

    return {
        "processes": processes,
        "sentences_per_s": round(len(latencies) / duration_s, 1),
        "latency_ms": {"p50": pct(0.5), "p99": pct(0.99)},
    }
