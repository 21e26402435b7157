"""``DecodeOptions``: how a sentence is decoded, documented once.

Read by the library (``Translator``), the CLI (``python -m model.translate``), the service (its
``NMT_*`` settings build one) and the CTranslate2 exporter (``ctranslate2_options``: the same
decoding asked of CTranslate2). Torch-free: the service's front end truncates inputs with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from model.directory import ModelInfo, source_prefix
from model.tokenizer import Tokenizer

GUARD_MARGIN = 16  # candidates kept beyond 2K per row for the repetition guard to drop
# The largest beam a request may ask for, unless configured (the service's NMT_MAX_BEAM_SIZE, the
# CLI's --max-beam-size, ``Translator``'s max_beam_size). A decoding step keeps ``candidates`` of
# it per row, and constrained decoding reads every candidate kept: the library, the CLI and the
# service choose a constrained sentence's tokens alike only where they keep the same number.
MAX_BEAM_SIZE = 8
# The counts a decoding needs at least one of (a zero beam or budget decodes nothing): the CLI's
# flags for them reject a 0 as a usage error.
AT_LEAST_ONE = ("beam_size", "n_best", "max_input_tokens", "max_output_tokens")

_T = TypeVar("_T")


def option(default: _T, doc: str) -> _T:
    """A ``DecodeOptions`` field: its default and its one description (``metadata["doc"]``, which
    the CLI's ``--help`` shows beside the default)."""
    return field(default=default, metadata={"doc": doc})


@dataclass(frozen=True)
class DecodeOptions:
    beam_size: int = option(5, "hypotheses kept per input at every step; 1 is greedy search")
    n_best: int = option(1, "hypotheses returned per input, best first (at most beam_size)")
    length_penalty: float = option(
        1.0,
        "hypotheses are ranked by log-prob / length**this, length counting eos; 0 is no "
        "normalisation, which favours short outputs",
    )
    max_input_tokens: int = option(
        250,
        "source tokens kept per sentence, a target-language token included, eos not: longer "
        "sentences are truncated, and so are those longer than the model's positions",
    )
    max_length_a: float = option(1.5, "the a of: output tokens <= a * source tokens + b, eos counted in both")
    max_length_b: int = option(10, "the b of: output tokens <= a * source tokens + b")
    max_output_tokens: int = option(
        256, "output tokens at most, eos included, whatever a * source + b or the model's positions allow"
    )
    # CTranslate2's no_repeat_ngram_size. Candidates that would repeat an n-gram are dropped from
    # each row's best ``candidates(beam)`` of a step, so the guard is exact while at most
    # GUARD_MARGIN are banned at once (a token that would repeat an n-gram for the 17th time may
    # come through).
    no_repeat_ngram_size: int = option(
        0, "repetition guard: no n-gram of this size appears twice in an output; 0 is off"
    )

    def __post_init__(self) -> None:
        for name in AT_LEAST_ONE:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_best > self.beam_size:
            raise ValueError(f"n_best ({self.n_best}) must be at most beam_size ({self.beam_size})")
        if self.max_length_a < 0 or self.max_length_b < 0 or self.no_repeat_ngram_size < 0:
            raise ValueError("max_length_a, max_length_b and no_repeat_ngram_size must be >= 0")

    def but(self, **changes: Any) -> DecodeOptions:
        """A copy with ``changes`` (a request's own beam size and n-best)."""
        return replace(self, **changes)

    def input_limit(self, max_positions: int) -> int:
        """Source tokens kept per sentence before its eos, for a model of ``max_positions``."""
        return min(self.max_input_tokens, max_positions - 1)

    def source_ids(
        self, info: ModelInfo, tokenizer: Tokenizer, texts: Sequence[str], target: str | None = None
    ) -> list[list[int]]:
        """Each text's token ids, the one place a source is tokenized (the library's translator and
        the service's front end both call it): after the token that asks a multilingual model for
        ``target`` (``source_prefix``), truncated to ``input_limit``, then the model's eos if its
        sources end with one. A source is never empty: one with no tokens is eos alone (attention
        over nothing is undefined)."""
        config = info.config
        prefix = source_prefix(info, target)
        limit = self.input_limit(config.max_positions) - len(prefix)
        end = [config.eos_id] if config.source_eos else []
        return [[*prefix, *ids[:limit], *end] or [config.eos_id] for ids in tokenizer.encode(list(texts))]

    def candidates(self, max_beam_size: int) -> int:
        """Candidates a step keeps per row for beams of up to ``max_beam_size``: the best 2K
        extensions of K beams are among each beam's best 2K, and the guard bans some of them."""
        return 2 * max_beam_size + (GUARD_MARGIN if self.no_repeat_ngram_size else 0)

    def output_limit(self, source_length: int, max_positions: int) -> int:
        """Output tokens allowed (eos included) for a source of ``source_length`` tokens (eos
        included), at least 1."""
        budget = int(source_length * self.max_length_a + self.max_length_b)
        return max(1, min(budget, self.max_output_tokens, max_positions))

    def positions(self, max_positions: int) -> int:
        """The most positions a row of the cache needs: its source (with eos) or its output."""
        return min(max(self.input_limit(max_positions) + 1, self.max_output_tokens), max_positions)


def ctranslate2_options(options: DecodeOptions) -> dict[str, Any]:
    """``options`` as the keyword arguments of CTranslate2's ``Translator.translate_batch``.

    CTranslate2 has no a * source + b budget, only the cap (``max_decoding_length``, which does not
    count eos); its ``max_input_length`` counts eos."""
    return {
        "beam_size": options.beam_size,
        "num_hypotheses": options.n_best,
        "length_penalty": options.length_penalty,
        "max_input_length": options.max_input_tokens + 1,
        "max_decoding_length": options.max_output_tokens - 1,
        "no_repeat_ngram_size": options.no_repeat_ngram_size,
    }


def nonblank(texts: Sequence[str]) -> list[int]:
    """The indices of the texts with something to translate. A blank text (empty, or whitespace
    only) translates to "" without model work: the library, the service's sentence stage, its
    memory and cache, and a pivot's second hop all skip them by this one rule."""
    return [i for i, text in enumerate(texts) if text.strip()]
