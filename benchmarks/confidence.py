"""Sentence confidence: which signal of the search's token log-probs predicts a translation's
quality, and its calibration per model (``model.decoding.confidence``).

For each shipped model (de-en, en-de), decoded as the service decodes by default (beam 5, int8
where the CPU has int8 instructions, n-best 2 here so that the runner-up is known), every
sentence's candidate signals (``SIGNALS``: mean token log-prob, its minimum, the length-normalized
score's gap to the runner-up) against its sentence chrF (sacreBLEU's ``sentence_chrf``) with the
Multi30k reference:

- fitted on val (1,014 sentences): isotonic regression of "chrF >= 50" on each signal;
- reported on test_2016_flickr (1,000): Spearman correlation of the signal with chrF (targets:
  >= 0.35), AUROC of finding the sentences with chrF < 30 by low signal (>= 0.70), expected
  calibration error of the fitted confidence (10 bins, <= 0.1); also the uncalibrated default
  (exp of the mean log-prob) for a model without a calibration;
- glossary-forced: ``--forced`` test sentences (default 300) given up to 2 terms each, drawn from
  the words aligned to their references (``benchmarks.terminology``'s glossary, every sentence
  drawn), decoded with constraints: the same figures with the forced tokens left out of the mean
  (as served) and counted in.

``--write`` stores the chosen signal's calibration in each model directory (``confidence.json``:
the points, the signal, what it estimates, and the data, model, decoding and date it was fitted
on). sacreBLEU's and numpy's only (``benchmarks.confidence_stats``), no scikit-learn.

    .venv/bin/python -m benchmarks.confidence --threads 1 --write   # ~6 min on a 2-core machine
    .venv/bin/python -m benchmarks.confidence --directions de-en --limit 200 --forced 50  # quick
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import sacrebleu
import torch

from benchmarks import terminology
from benchmarks.common import DATA, REPO, cpu_name
from benchmarks.confidence_stats import auroc, ece, isotonic_points, spearman
from model.decoding.confidence import CONFIDENCE_FILE, DEFAULT, SIGNALS, Calibration, signal_values
from model.decoding.hypothesis import Hypothesis
from model.translator import Translator
from training.data import read_lines

GOOD = 50.0  # the calibration's target: P(chrF >= GOOD)
BAD = 30.0  # the AUROC's positives: chrF < BAD
CHOSEN = "mean_log_prob"  # the signal served (see the table: the best that needs no runner-up)


def decode(
    t: Translator, sources: Sequence[str], beam: int, terms: Sequence[Sequence[str]] | None = None
) -> tuple[list[list[Hypothesis]], list[str], float]:
    """n-best 2 hypotheses (one with terms), the best's text, seconds taken."""
    ids = t.source_ids(list(sources))
    constraints = None
    if terms is not None:
        constraints = [tuple(tuple(c) for c in t.tokenizer.encode(list(ts), target=True)) for ts in terms]
    started = time.perf_counter()
    nbests = t.generate(ids, beam_size=beam, n_best=1 if terms else 2, constraints=constraints)
    seconds = time.perf_counter() - started
    return nbests, t.tokenizer.decode([n[0].tokens for n in nbests]), seconds


def chrf(outputs: Sequence[str], references: Sequence[str]) -> np.ndarray:
    return np.array([sacrebleu.sentence_chrf(o, [r]).score for o, r in zip(outputs, references, strict=True)])


def signals(nbests: Sequence[Sequence[Hypothesis]]) -> dict[str, np.ndarray]:
    rows = [signal_values(n[0], n[1] if len(n) > 1 else None) for n in nbests]
    out: dict[str, np.ndarray] = {}
    for name in SIGNALS:
        values = [r.get(name, np.nan) for r in rows]
        if all(np.isnan(v) for v in values):
            continue
        arr = np.array(values, dtype=np.float64)
        # (An input whose beam found one hypothesis only: nothing came close, the largest gap.)
        out[name] = np.where(np.isnan(arr), np.nanmax(arr), arr)
    return out


def mean_with_forced(nbests: Sequence[Sequence[Hypothesis]]) -> np.ndarray:
    return np.array([sum(n[0].token_log_probs) / len(n[0].token_log_probs) for n in nbests])


def evaluate(signal: np.ndarray, scores: np.ndarray, calibration: Calibration) -> dict[str, float]:
    confidence = np.array([calibration(v) for v in signal.tolist()])
    return {
        "spearman": spearman(signal, scores),
        "auroc_bad": auroc(-signal, scores < BAD),
        "ece": ece(confidence, (scores >= GOOD).astype(np.float64)),
        "mean_confidence": float(confidence.mean()),
        "share_good": float((scores >= GOOD).mean()),
        "share_below_half": float((confidence < 0.5).mean()),
    }


def fit(signal: np.ndarray, scores: np.ndarray, name: str, provenance: dict[str, Any]) -> Calibration:
    points = isotonic_points(signal, (scores >= GOOD).astype(np.float64))
    return Calibration(name, tuple(points), GOOD, True, provenance)


def run_direction(src: str, tgt: str, args: argparse.Namespace) -> dict[str, Any]:
    model_dir = args.models / f"multi30k-{src}-{tgt}"
    t = Translator.load(model_dir, device="cpu", quantization=args.quantization)
    rows: list[dict[str, Any]] = []
    val_src, val_ref = (read_lines(args.data / f"val.{lang}.gz")[: args.limit] for lang in (src, tgt))
    test_src, test_ref = (
        read_lines(args.data / f"test_2016_flickr.{lang}.gz")[: args.limit] for lang in (src, tgt)
    )
    val_n, val_out, val_s = decode(t, val_src, args.beam)
    test_n, test_out, test_s = decode(t, test_src, args.beam)
    val_chrf, test_chrf = chrf(val_out, val_ref), chrf(test_out, test_ref)
    val_sig, test_sig = signals(val_n), signals(test_n)
    provenance = {
        "fitted_on": f"Multi30k val.{src} -> val.{tgt}, {len(val_src)} sentences",
        "model": model_dir.name,
        "decoding": f"beam {args.beam}, {t.quantization if t.quantization != 'none' else 'float32'}",
        "target": f"sentence chrF (sacreBLEU {sacrebleu.__version__} sentence_chrf) >= {GOOD:g}",
        "tool": "python -m benchmarks.confidence",
        "date": datetime.date.today().isoformat(),
    }
    calibrations = {name: fit(val_sig[name], val_chrf, name, provenance) for name in val_sig}
    for name, calibration in calibrations.items():
        rows.append({"set": "test", "signal": name, **evaluate(test_sig[name], test_chrf, calibration)})
    rows.append(
        {"set": "test", "signal": "exp(mean), uncalibrated", **evaluate(test_sig[CHOSEN], test_chrf, DEFAULT)}
    )
    forced: dict[str, Any] = {}
    if args.forced:
        glossary = terminology.term_set(
            src,
            tgt,
            terminology.parse_args(["--limit", str(args.forced), "--share", "1", "--placeholders", "0"]),
        )
        picked = [i for i, ts in enumerate(glossary.terms) if ts]
        f_n, f_out, _ = decode(
            t, [glossary.sources[i] for i in picked], args.beam, [glossary.terms[i] for i in picked]
        )
        f_chrf = chrf(f_out, [glossary.references[i] for i in picked])
        f_sig = signals(f_n)
        with_forced = mean_with_forced(f_n)
        chosen = calibrations[CHOSEN]
        rows.append(
            {
                "set": "forced",
                "signal": "mean, forced tokens left out",
                **evaluate(f_sig[CHOSEN], f_chrf, chosen),
            }
        )
        rows.append(
            {
                "set": "forced",
                "signal": "mean, forced tokens counted",
                **evaluate(with_forced, f_chrf, chosen),
            }
        )
        forced = {"sentences": len(picked), "terms": sum(len(glossary.terms[i]) for i in picked)}
    if args.write:
        path = model_dir / CONFIDENCE_FILE
        path.write_text(calibration_text(calibrations[CHOSEN]), encoding="utf-8")
        print(f"wrote {path} ({path.stat().st_size} bytes)")
    return {
        "direction": f"{src}-{tgt}",
        "quantization": t.quantization,
        "val_sentences": len(val_src),
        "test_sentences": len(test_src),
        "decode_seconds": {"val": round(val_s, 1), "test": round(test_s, 1)},
        "test_mean_chrf": float(test_chrf.mean()),
        "forced": forced,
        "rows": rows,
    }


def calibration_text(calibration: Calibration) -> str:
    """``confidence.json``'s text: indented, a point per line (the file is tracked: diffs stay short)."""
    data = calibration.to_json()
    points = data.pop("points")
    head = json.dumps(data, indent=1)[: -len("\n}")]
    rows = ",\n".join(f"  {json.dumps(p)}" for p in points)
    return f'{head},\n "points": [\n{rows}\n ]\n}}\n'


def table(results: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| direction | sentences | signal | Spearman (chrF) | AUROC (chrF < 30) | ECE | mean confidence "
        "| share chrF >= 50 | share confidence < 0.5 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        for row in r["rows"]:
            n = r["test_sentences"] if row["set"] == "test" else f"{r['forced'].get('sentences')} forced"
            lines.append(
                f"| {r['direction']} | {n} | {row['signal']} | {row['spearman']:.3f} "
                f"| {row['auroc_bad']:.3f} | {row['ece']:.3f} | {row['mean_confidence']:.3f} "
                f"| {row['share_good']:.3f} | {row['share_below_half']:.3f} |"
            )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--directions", nargs="+", default=["de-en", "en-de"], help="SRC-TGT, e.g. de-en")
    p.add_argument("--models", type=Path, default=REPO / "artifacts", help="holds multi30k-SRC-TGT")
    p.add_argument("--data", type=Path, default=DATA, help="Multi30k: val.*, test_2016_flickr.*")
    p.add_argument("--limit", type=int, default=None, help="first N val and test sentences only")
    p.add_argument("--forced", type=int, default=300, help="test sentences given glossary terms (0: none)")
    p.add_argument("--beam", type=int, default=5, help="the service's default")
    p.add_argument("--quantization", default="int8", choices=["none", "int8"])
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument(
        "--write", action="store_true", help=f"store the calibration as each model's {CONFIDENCE_FILE}"
    )
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    results = []
    for direction in args.directions:
        src, tgt = direction.split("-")
        results.append(run_direction(src, tgt, args))
        print(json.dumps({k: v for k, v in results[-1].items() if k != "rows"}), flush=True)
    print(f"CPU: {cpu_name()}, {args.threads} thread(s), torch {torch.__version__}")
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
