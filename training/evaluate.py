"""Score a model directory with sacreBLEU (BLEU and chrF, with their signatures), per direction.

    python -m training.evaluate --model DIR --src test.de[.gz] --ref test.en[.gz] [--beam-size N] [--json]
    python -m training.evaluate --model DIR --direction fr-en --src test.fr.gz --ref test.en.gz
    python -m training.evaluate --model DIR --data-dir D --split test_2016_flickr [--direction de-en]

A multilingual model needs the direction of --src/--ref; with --data-dir it is scored on every
direction it was trained on (or the one given), from D's {split}.{lang}[.gz] files.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import sacrebleu
import torch

from model.checkpoint import ModelDirError, ModelInfo
from model.decoding.options import DecodeOptions
from model.transformer import Transformer
from model.translator import Translator
from training.config import TrainParams
from training.data import DataError, PreparedCorpus, iterate, read_lines
from training.loss import label_smoothed_nll
from training.sampling import EpochPlan
from training.text import find_file


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
    target: str | None = None,
    beam_size: int = 5,
    length_penalty: float = 1.0,
) -> tuple[Scores, list[str]]:
    """Translate ``sources`` (into ``target``: needed by a multilingual model) and score them."""
    if len(sources) != len(references):
        raise DataError(f"{len(sources)} source lines but {len(references)} reference lines")
    start = time.perf_counter()
    results = translator.translate_batch(
        sources, target=target, beam_size=beam_size, length_penalty=length_penalty
    )
    seconds = time.perf_counter() - start
    hyps = [r.hypotheses[0] for r in results]
    b, c, bsig, csig = score(hyps, references)
    return Scores(b, c, bsig, csig, len(sources), beam_size, round(seconds, 2)), hyps


@torch.no_grad()
def validate(
    model: Transformer, corpus: PreparedCorpus, info: ModelInfo, p: TrainParams, device: torch.device
) -> dict[str, Any]:
    """Validation loss (per target token) and greedy sacreBLEU / chrF of every direction.

    One direction: {"valid_loss", "valid_nll", "valid_bleu", "valid_chrf"}. Several: the same over
    all of them (loss per token of all directions, BLEU and chrF the mean of the directions'), and
    "directions": {"de-en": {...}, ...} with each one's.
    """
    was_training = model.training
    model.eval()
    translator = Translator(
        model, corpus.tokenizer, info, device, options=DecodeOptions(beam_size=1), capacity=p.valid_batch_size
    )
    per: dict[str, dict[str, float]] = {}
    loss_sum, nll_sum, tokens = 0.0, 0.0, 0
    for direction in corpus.valid:
        d_loss, d_nll, d_tokens = 0.0, 0.0, 0
        plan = EpochPlan([direction.sizes], max_tokens=p.max_tokens, pool=1 << 62, seed=0, epoch=0)
        for batch in iterate([direction], plan):
            batch = batch.to(device)
            logits = model(batch.src, batch.tgt_in)
            loss, nll = label_smoothed_nll(logits, batch.tgt_out, p.label_smoothing, model.cfg.pad_id)
            d_loss, d_nll, d_tokens = d_loss + float(loss), d_nll + float(nll), d_tokens + batch.n_tokens
        sources, references = corpus.valid_text(direction)
        n = p.valid_max_sentences or len(sources)
        scores, _ = evaluate(
            translator,
            sources[:n],
            references[:n],
            target=direction.target,
            beam_size=1,
        )
        per[direction.name] = {
            "valid_loss": d_loss / max(d_tokens, 1),
            "valid_nll": d_nll / max(d_tokens, 1),
            "valid_bleu": scores.bleu,
            "valid_chrf": scores.chrf,
        }
        loss_sum, nll_sum, tokens = loss_sum + d_loss, nll_sum + d_nll, tokens + d_tokens
    model.train(was_training)
    result: dict[str, Any] = {
        "valid_loss": loss_sum / max(tokens, 1),
        "valid_nll": nll_sum / max(tokens, 1),
        "valid_bleu": sum(s["valid_bleu"] for s in per.values()) / len(per),
        "valid_chrf": sum(s["valid_chrf"] for s in per.values()) / len(per),
    }
    if len(per) > 1:
        result["directions"] = per
    return result


def _direction(info: ModelInfo, text: str | None) -> tuple[str, str] | None:
    """The --direction asked for, checked against the model's (None: not given)."""
    if text is None:
        return None
    pair = tuple(text.split("-", 1))
    if pair not in info.directions:
        served = ", ".join(f"{s}-{t}" for s, t in info.directions)
        raise DataError(f"--direction {text}: the model translates {served}")
    return pair  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.evaluate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="model directory")
    ap.add_argument("--src", help="source sentences, one per line (.gz allowed)")
    ap.add_argument("--ref", help="reference translations, line-aligned with --src")
    ap.add_argument(
        "--direction", help="source-target, e.g. fr-en (needed with --src for a multilingual model)"
    )
    ap.add_argument("--data-dir", help="instead of --src/--ref: score every direction on D's --split files")
    ap.add_argument("--split", default="test_2016_flickr", help="with --data-dir: the split's name")
    ap.add_argument("--beam-size", type=int, default=5)
    ap.add_argument("--length-penalty", type=float, default=1.0)
    ap.add_argument("--batch-size", type=int, default=64, help="rows (beams) decoded together")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--output", help="also write the translations to this file (--src/--ref only)")
    ap.add_argument("--json", action="store_true", help="print the scores as JSON")
    args = ap.parse_args(argv)
    if (args.src is None or args.ref is None) == (args.data_dir is None):
        ap.error("give either --src and --ref, or --data-dir")
    try:
        translator = Translator.load(
            args.model,
            device=args.device,
            dtype=args.dtype,
            capacity=max(args.batch_size, args.beam_size),  # rows (beams) decoded together
            max_beam_size=args.beam_size,
        )
        asked = _direction(translator.info, args.direction)
        if args.data_dir is None:
            if asked is None and translator.info.is_multilingual:
                raise DataError(
                    "a multilingual model: --direction says which of its directions --src/--ref are"
                )
            tests = {args.direction or "": (read_lines(args.src), read_lines(args.ref), asked)}
        else:
            tests = {}
            for src, tgt in [asked] if asked else translator.info.directions:
                src_file = find_file(args.data_dir, args.split, src, (src, tgt))
                ref_file = find_file(args.data_dir, args.split, tgt, (src, tgt))
                tests[f"{src}-{tgt}"] = (read_lines(src_file), read_lines(ref_file), (src, tgt))
        results: dict[str, Scores] = {}
        for name, (sources, references, pair) in tests.items():
            scores, hyps = evaluate(
                translator,
                sources,
                references,
                target=pair[1] if pair else None,
                beam_size=args.beam_size,
                length_penalty=args.length_penalty,
            )
            results[name] = scores
            if args.output and args.data_dir is None:
                with open(args.output, "w", encoding="utf-8") as f:
                    f.write("".join(h + "\n" for h in hyps))
    except (DataError, ModelDirError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        as_json = {name: asdict(s) for name, s in results.items()}
        print(json.dumps(as_json if args.data_dir else next(iter(as_json.values()))))
        return 0
    for name, scores in results.items():
        if name:
            print(f"{name}:")
        print(f"BLEU = {scores.bleu:.2f}  ({scores.bleu_signature})")
        print(f"chrF = {scores.chrf:.2f}  ({scores.chrf_signature})")
        print(f"{scores.sentences} sentences, beam {scores.beam_size}, {scores.seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
