"""Score a model directory on a test set with sacreBLEU (BLEU and chrF, with their signatures).

python -m training.evaluate --model DIR --src test.de[.gz] --ref test.en[.gz] [--beam-size N] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import sacrebleu

from model.checkpoint import ModelDirError
from model.translator import Translator
from training.data import DataError, read_lines


@dataclass
class Scores:
    bleu: float
    chrf: float
    bleu_signature: str
    chrf_signature: str
    sentences: int
    beam_size: int
    seconds: float


def score(hypotheses: list[str], references: list[str]) -> tuple[float, float, str, str]:
    """Corpus BLEU and chrF with sacreBLEU's defaults (13a tokenisation, cased) and their signatures."""
    bleu, chrf = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
    b = bleu.corpus_score(hypotheses, [references]).score
    c = chrf.corpus_score(hypotheses, [references]).score
    return b, c, str(bleu.get_signature()), str(chrf.get_signature())


def evaluate(
    translator: Translator,
    sources: list[str],
    references: list[str],
    *,
    beam_size: int = 5,
    batch_size: int = 64,
    length_penalty: float = 1.0,
) -> tuple[Scores, list[str]]:
    if len(sources) != len(references):
        raise DataError(f"{len(sources)} source lines but {len(references)} reference lines")
    start = time.perf_counter()
    results = translator.translate_batch(
        sources, beam_size=beam_size, max_batch_size=batch_size, length_penalty=length_penalty
    )
    seconds = time.perf_counter() - start
    hyps = [r.hypotheses[0] for r in results]
    b, c, bsig, csig = score(hyps, references)
    return Scores(b, c, bsig, csig, len(sources), beam_size, round(seconds, 2)), hyps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.evaluate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="model directory")
    ap.add_argument("--src", required=True, help="source sentences, one per line (.gz allowed)")
    ap.add_argument("--ref", required=True, help="reference translations, line-aligned with --src")
    ap.add_argument("--beam-size", type=int, default=5)
    ap.add_argument("--length-penalty", type=float, default=1.0)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--output", help="also write the translations to this file")
    ap.add_argument("--json", action="store_true", help="print the scores as one JSON object")
    args = ap.parse_args(argv)
    try:
        sources, references = read_lines(args.src), read_lines(args.ref)
        translator = Translator.load(args.model, device=args.device, dtype=args.dtype)
        scores, hyps = evaluate(
            translator,
            sources,
            references,
            beam_size=args.beam_size,
            batch_size=args.batch_size,
            length_penalty=args.length_penalty,
        )
    except (DataError, ModelDirError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.output:
        Path(args.output).write_text("".join(h + "\n" for h in hyps))
    if args.json:
        print(json.dumps(asdict(scores)))
    else:
        print(f"BLEU = {scores.bleu:.2f}  ({scores.bleu_signature})")
        print(f"chrF = {scores.chrf:.2f}  ({scores.chrf_signature})")
        print(f"{scores.sentences} sentences, beam {scores.beam_size}, {scores.seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
