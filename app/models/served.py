"""What the front end knows of the models it serves: which directories ``NMT_MODEL_DIR`` names,
each one's metadata and vocabulary (read from the model directory; the weights stay in the workers)
and what the workers run it on."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from app.serving.protocol import Confidence, Constraints, Hypothesis, ModelDescription, Placed, SentenceResult
from model.decoding.confidence import DEFAULT, Calibration
from model.decoding.options import DecodeOptions
from model.directory import CONFIG_FILE, ModelDirError, ModelInfo, read_info_and_tokenizer
from model.tokenizer import Tokenizer


def find_model_dirs(paths: Sequence[Path]) -> list[Path]:
    """The model directories that ``paths`` (``NMT_MODEL_DIR``) name, in order: each path is a
    model directory (it holds config.json), or a directory of them (every subdirectory that holds
    one, by name: ``artifacts/``; hidden ones, such as model.fetch's unfinished ``.NAME.partial``,
    are skipped). ``ModelDirError`` for a directory with neither; a path that does
    not exist is left for ``ServedModel.open`` to name its missing config.json."""
    found: list[Path] = []
    for path in paths:
        if (path / CONFIG_FILE).is_file() or not path.is_dir():
            found.append(path)
            continue
        inside = sorted(
            d
            for d in path.iterdir()
            if d.is_dir() and not d.name.startswith(".") and (d / CONFIG_FILE).is_file()
        )
        if not inside:
            raise ModelDirError(f"{path}: no {CONFIG_FILE}, and no model directory in it")
        found += inside
    return list(dict.fromkeys(found))


def model_names(dirs: Sequence[Path]) -> list[str]:
    """A name for each model directory, unique among them, for clients and the ``model`` label of
    metrics: its own name (``multi30k-de-en``), or with its parent's where two share it (training
    writes ``runs/de-en/model`` and ``runs/en-de/model``: ``de-en/model``, ``en-de/model``)."""
    names = [d.name or str(d) for d in dirs]
    shared = Counter(names)
    names = [
        f"{d.parent.name}/{n}" if shared[n] > 1 and d.parent.name else n
        for d, n in zip(dirs, names, strict=True)
    ]
    shared = Counter(names)
    return [f"{n}#{i}" if shared[n] > 1 else n for i, n in enumerate(names)]


def load_calibration(model_dir: Path) -> Calibration:
    """The directory's confidence calibration (``Calibration.load``: the default without one);
    ``ModelDirError`` naming a file that is not one, as for the directory's other files."""
    try:
        return Calibration.load(model_dir)
    except ValueError as e:
        raise ModelDirError(str(e)) from e


@dataclass(frozen=True, eq=False)
class ServedModel:
    name: str  # unique among the served models (``model_names``): never its full path
    info: ModelInfo
    tokenizer: Tokenizer
    description: ModelDescription  # device, dtype, quantization, as the workers report them
    workers: int = 1  # its worker processes
    options: DecodeOptions = DecodeOptions()  # how its workers decode (NMT_* decoding settings)
    # Its confidence.json (``Calibration.load``), or the uncalibrated default.
    calibration: Calibration = DEFAULT

    @classmethod
    def open(cls, model_dir: Path) -> tuple[ModelInfo, Tokenizer]:
        """The directory's metadata and vocabulary; ``ModelDirError`` naming a missing or broken file."""
        return read_info_and_tokenizer(model_dir)

    @property
    def max_input_tokens(self) -> int:
        return self.options.input_limit(self.info.config.max_positions)

    def source_ids(self, sentences: list[str], target: str | None = None) -> list[list[int]]:
        """Each sentence's token ids, truncated, then eos: what a worker decodes. A multilingual
        model's are preceded by the token that asks for ``target`` (``source_prefix``)."""
        return self.options.source_ids(self.info, self.tokenizer, sentences, target)

    def constraints(self, terms: Sequence[str]) -> Constraints:
        """Each term's target-side token ids: what the decoder must produce for it."""
        return tuple(map(tuple, self.tokenizer.encode(list(terms), target=True))) if terms else ()

    def render(
        self, results: list[SentenceResult], terms: Sequence[Sequence[str]] = (), *, pieces: bool = False
    ) -> list[SentenceResult]:
        """Each sentence's result with its hypotheses' texts written (their token ids and token
        log-probs dropped: the answer, and the segment cache, keep the text and the confidence):
        each constraint's tokens as its term exactly (``Tokenizer.decode_spans_with_offsets``)
        where a hypothesis's ``spans`` say the search realised one of ``terms`` (per sentence), and
        where the best text put them (``placed``); the others as ``texts`` decodes them. Where the
        hypotheses carry token log-probs, their ``confidence`` (with each piece's probability when
        ``pieces``)."""
        plain = self.texts(results)
        out = []
        results = [self.scored(r, pieces) for r in results]
        for i, (result, texts) in enumerate(zip(results, plain, strict=True)):
            mine = terms[i] if i < len(terms) else ()
            if not mine or not any(h.spans for h in result.hypotheses):
                hyps = tuple(
                    replace(h, tokens=[], token_log_probs=(), text=t)
                    for h, t in zip(result.hypotheses, texts, strict=True)
                )
                out.append(replace(result, hypotheses=hyps))
                continue
            written: list[Hypothesis] = []
            placed: Placed = ()
            for k, h in enumerate(result.hypotheses):
                text, where = self.tokenizer.decode_spans_with_offsets(h.tokens, h.spans, mine)
                written.append(replace(h, tokens=[], token_log_probs=(), text=text))
                if k == 0:  # the response's order: (term index, start, end), in text order
                    placed = tuple((term, start, end) for start, end, term in where)
            out.append(replace(result, hypotheses=tuple(written), placed=placed))
        return out

    def scored(self, result: SentenceResult, pieces: bool) -> SentenceResult:
        """``result`` with each hypothesis's ``Confidence`` (before its tokens are dropped), where
        every hypothesis kept its token log-probs; as it is otherwise."""
        hyps = result.hypotheses
        if not hyps or not all(h.token_log_probs for h in hyps):
            return result
        found = []
        for h in hyps:
            value = self.calibration.of(h)
            assert value is not None  # (token log-probs, and a served signal: no runner-up needed)
            found.append(Confidence(value, self.token_probabilities(h) if pieces else ()))
        return replace(result, confidence=tuple(found))

    def token_probabilities(self, h: Hypothesis) -> tuple[tuple[str, float], ...]:
        """Each shown piece of ``h`` (the output prefix's tokens, which decode to nothing, and eos
        left out) with the probability the model gave it, rounded to 4 places."""
        skip = len(self.info.output_prefix)
        ids, lprobs = h.tokens[skip:], h.token_log_probs[skip : len(h.tokens)]
        return tuple(
            (piece, round(math.exp(lp), 4))
            for piece, lp in zip(self.tokenizer.pieces(ids), lprobs, strict=True)
        )

    def texts(self, results: list[SentenceResult]) -> list[list[str]]:
        """The texts of each sentence's hypotheses, as the model wrote them (no terms)."""
        flat = self.tokenizer.decode([h.tokens for result in results for h in result.hypotheses])
        out, start = [], 0
        for result in results:
            out.append(flat[start : start + len(result.hypotheses)])
            start += len(result.hypotheses)
        return out
