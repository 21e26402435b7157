"""Greedy and beam search (model.decoding), on tiny random Transformers and on a scripted decoder.

The scripted decoder (``ScriptedModel``) has what ``RunningBatch`` and ``DecodeStep`` use of a
model (``cfg``, ``dtype``, ``device``, ``encode``, ``source_kv``, ``step``) but its next-token
distribution is a hand-written function of the source and the prefix, so that tests can build cases
with a known answer: a sentence where greedy search is lured into an improbable continuation,
sentences that end after a known number of steps, a decoder that wants to repeat itself. The
prefix and the source travel in the real ``KVCache`` (token ids stored as its keys and values, with
L = H = Dh = 1), so the running batch's own reordering, removing and moving of cache rows decides
what the decoder reads back; and it runs inside the real ``DecodeStep`` (the runner decoding calls),
so the step's argmax and top-k are the ones decoding uses.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from copy import deepcopy

import pytest
import torch
from torch import Tensor

from model.config import ModelConfig
from model.decoding.batch import RunningBatch, Source, decode
from model.decoding.beam import Beam, banned_tokens
from model.decoding.options import GUARD_MARGIN, DecodeOptions
from model.decoding.search import Hypothesis, Search
from model.runtime.runners import EagerRunner, load_runner
from model.runtime.step import DecodeStep, StepChoice, argmax_rows, topk_rows
from model.tokenizer import BOS_ID, EOS_ID, PAD_ID
from model.transformer import EncoderOutput, Transformer

V = 16  # scripted vocabulary: 0-3 special, 4-15 words
A, B, C = 4, 5, 6

Rule = Callable[[list[int], list[int]], dict[int, float]]


def distribution(probs: dict[int, float]) -> list[float]:
    """Log-probabilities over V tokens: ``probs`` as given, the rest of the mass spread evenly."""
    rest = (1.0 - sum(probs.values())) / (V - len(probs))
    assert rest > 0
    return [math.log(probs.get(i, rest)) for i in range(V)]


class ScriptedModel:
    """A decoder whose next-token log-probs are ``rule(source_words, generated_tokens)``.

    ``source_kv`` stores each row's source ids as its cross-attention keys and values, ``step``
    returns the fed tokens as the new self-attention keys and values; ``step`` then reads row r's
    source back from ``cross_kv[j, 0, k|v, 0, :, 0]`` where ``src_bias[j]`` is 0, j = ``sources[r]``
    (its slot), and its prefix from ``self_kv[r, 0, k|v, 0, :positions[r], 0]``: whatever the batch
    did to the cache is what this decoder sees.
    """

    def __init__(self, rule: Rule, max_positions: int = 64) -> None:
        self.cfg = ModelConfig(
            vocab_size=V,
            d_model=1,
            n_heads=1,
            encoder_layers=1,
            decoder_layers=1,
            max_positions=max_positions,
        )
        self.dtype, self.device = torch.float32, torch.device("cpu")  # the cache's
        self.rule = rule
        self.batch_sizes: list[int] = []  # rows fed to every step

    def encode(self, src: Tensor) -> EncoderOutput:
        return EncoderOutput(memory=src.float()[:, :, None], src_mask=src != PAD_ID)

    def source_kv(self, enc: EncoderOutput) -> Tensor:
        b, s, _ = enc.memory.shape
        return enc.memory[:, None, None, None].expand(b, 1, 2, 1, s, 1).clone()  # (B, L, 2, H, S, Dh)

    def step(
        self,
        tokens: Tensor,
        positions: Tensor,
        self_kv: Tensor,
        cross_kv: Tensor,
        src_bias: Tensor,
        sources: Tensor,
    ) -> tuple[Tensor, Tensor]:
        rows = len(tokens)
        self.batch_sizes.append(rows)
        assert self_kv.shape[:4] == (rows, 1, 2, 1) and len(sources) == rows
        assert cross_kv.shape[1:4] == (1, 2, 1) and src_bias.shape[0] == cross_kv.shape[0] <= rows
        out = []
        for r, j in enumerate(sources.tolist()):
            n = int(positions[r])
            assert torch.equal(self_kv[r, 0, 0], self_kv[r, 0, 1]) or n == 0
            prefix = [*self_kv[r, 0, 0, 0, :n, 0].long().tolist(), int(tokens[r])]
            assert prefix[0] == BOS_ID, "a row's cache was mixed up with another row's"
            real = src_bias[j, 0, 0] == 0
            src = cross_kv[j, 0, 0, 0, :, 0][real].long().tolist()
            assert src == cross_kv[j, 0, 1, 0, :, 0][real].long().tolist()
            assert src[-1] == EOS_ID and PAD_ID not in src
            out.append(distribution(self.rule(src[:-1], prefix[1:])))
        new_kv = tokens.float()[:, None, None, None, None].expand(rows, 1, 2, 1, 1).clone()
        return torch.tensor(out), new_kv  # (R, V), (R, L, 2, H, Dh)


def as_model(m: ScriptedModel) -> Transformer:
    return m  # type: ignore[return-value]  # duck-typed: cfg, dtype, device, encode, source_kv and step


def scripted_decode(
    model: ScriptedModel,
    words: list[list[int]],
    options: DecodeOptions,
    capacity: int = 64,
    top: int | None = None,
) -> list[list[Hypothesis]]:
    """``decode`` with ``model`` run by the real ``DecodeStep`` (``top``: 2 x the beam size, as
    ``Translator``, unless given)."""
    runner = EagerRunner(DecodeStep(as_model(model), top=top or 2 * options.beam_size))
    return decode(as_model(model), runner, [[*w, EOS_ID] for w in words], options, capacity=capacity)


def real_decode(
    model: Transformer, sources: Sequence[Sequence[int]], options: DecodeOptions, capacity: int = 32
) -> list[list[Hypothesis]]:
    positions = options.positions(model.cfg.max_positions)
    runner = load_runner(
        model, top=2 * options.beam_size, capacity=capacity, positions=positions, compile=False
    )
    with torch.inference_mode():
        return decode(model, runner, sources, options, capacity=capacity)


def limit_of(options: DecodeOptions, ids: Sequence[int], max_positions: int = 64) -> int:
    return options.output_limit(len(ids), max_positions)


def random_sources(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    """Source ids of the given lengths (eos included)."""
    g = torch.Generator().manual_seed(seed)
    return [[*torch.randint(4, vocab, (n - 1,), generator=g).tolist(), EOS_ID] for n in lengths]


# -- rules ------------------------------------------------------------------------------------------


def trap(source: list[int], out: list[int]) -> dict[int, float]:
    """The likeliest first token A leads only to unlikely continuations; B is then almost surely
    followed by eos. Greedy: A C eos, p = .5 * .1 * .9 = .045. Best: B eos, p = .4 * .99 = .396."""
    if not out:
        return {A: 0.5, B: 0.4}
    if out == [B]:
        return {EOS_ID: 0.99}
    if out == [A]:
        return {C: 0.1, **{t: 0.08 for t in range(7, V)}}
    return {EOS_ID: 0.9}


def copy(source: list[int], out: list[int]) -> dict[int, float]:
    """Copy the source, then eos; an alternative token keeps the beams busy; off track, stop."""
    if out == source[: len(out)]:
        nxt = source[len(out)] if len(out) < len(source) else EOS_ID
        alt = A + (nxt - A + 1) % (V - A) if nxt != EOS_ID else A
        return {nxt: 0.7, alt: 0.2}
    return {EOS_ID: 0.6}


def never_ends(source: list[int], out: list[int]) -> dict[int, float]:
    return {A + len(out) % (V - A): 0.9}


def hashed(source: list[int], out: list[int]) -> dict[int, float]:
    """A distribution drawn afresh for every (source, prefix): read the wrong source or prefix and
    the log-probs change. Five likely tokens, eos likelier as the output grows."""
    rng = random.Random(f"{source}/{out}")
    tokens = rng.sample([EOS_ID, *range(A, V)], 5)
    weights = [rng.uniform(1.0, 2.0) for _ in tokens]
    if EOS_ID in tokens:
        weights[tokens.index(EOS_ID)] *= 1 + len(out) / 2
    total = sum(weights)
    return {t: 0.9 * w / total for t, w in zip(tokens, weights, strict=True)}


# A B A B ... preferred; every token has its own probability (no ties), eos the least likely.
REPEAT_ORDER = [[A, B, *range(C, V), 1, EOS_ID], [B, A, *range(C, V), 1, EOS_ID]]
_GEOMETRIC = [0.5**i for i in range(V - 2)]
REPEAT_PROBS = [p / sum(_GEOMETRIC) * 0.999 for p in _GEOMETRIC]  # pad and bos share the last 0.001


def repeats(source: list[int], out: list[int]) -> dict[int, float]:
    return dict(zip(REPEAT_ORDER[len(out) % 2], REPEAT_PROBS, strict=True))


def rule_log_prob(rule: Rule, source: list[int], tokens: list[int]) -> float:
    """log P(tokens + eos | source) under ``rule``, recomputed token by token."""
    seq = [*tokens, EOS_ID]
    return sum(distribution(rule(source, seq[:t]))[seq[t]] for t in range(len(seq)))


# -- greedy ---------------------------------------------------------------------------------------


def assert_same_hypotheses(a: list[list[Hypothesis]], b: list[list[Hypothesis]]) -> None:
    assert len(a) == len(b)
    for i, (ha, hb) in enumerate(zip(a, b, strict=True)):
        assert [h.tokens for h in ha] == [h.tokens for h in hb], f"input {i}"
        for x, y in zip(ha, hb, strict=True):
            assert x.log_prob == pytest.approx(y.log_prob, abs=1e-4), f"input {i}"
            assert x.score == pytest.approx(y.score, abs=1e-4), f"input {i}"


def test_greedy_equals_argmax_over_the_whole_prefix(make_model: Callable[..., Transformer]) -> None:
    """The greedy path (``Beam.extend``) against the definition: per input, no cache, no batch,
    append the argmax of ``decode`` over the whole prefix until eos or the length limit."""
    model = make_model(
        seed=1, sharpen=2.0, eos_boost=1.5, share_embeddings=False, tie_output=False, pre_norm=True
    )
    sources = random_sources(model.cfg.vocab_size, [3, 9, 5, 12, 2, 7], seed=3)
    options = DecodeOptions(beam_size=1, max_length_a=1.5, max_length_b=5)
    got = real_decode(model, sources, options)
    ended = 0
    with torch.no_grad():
        for i, ids in enumerate(sources):
            limit = options.output_limit(len(ids), model.cfg.max_positions)
            enc = model.encode(torch.tensor([ids]))
            prefix, log_prob = [BOS_ID], 0.0
            while True:
                lprobs = torch.log_softmax(model.decode(torch.tensor([prefix]), enc)[0, -1], dim=-1)
                # The last allowed token is eos; before it, the most probable one.
                token = EOS_ID if len(prefix) == limit else int(lprobs.argmax())
                log_prob += float(lprobs[token])
                if token == EOS_ID:
                    break
                prefix.append(token)
            ended += len(prefix) < limit
            assert got[i][0].tokens == prefix[1:], f"input {i}"
            assert got[i][0].log_prob == pytest.approx(log_prob, abs=1e-4), f"input {i}"
            # Length-normalised by the output length with eos (len(prefix): bos + tokens).
            assert got[i][0].score == pytest.approx(log_prob / len(prefix), abs=1e-4), f"input {i}"
    assert 0 < ended < len(sources)  # both ways of ending are covered: eos, and the length limit


@pytest.mark.parametrize(
    ("rows", "vocab"), [(1, 128), (8, 8000), (64, 8000), (64, 1024), (13, 100), (16, 58101), (9, 1000)]
)
def test_argmax_rows_is_torch_argmax_ties_included(rows: int, vocab: int) -> None:
    """Vocabularies that are and are not a multiple of the block (58,101: OPUS-MT's), the max in the
    last, partial block, ties across and inside blocks."""
    torch.manual_seed(rows + vocab)
    x = torch.randn(rows, vocab)
    x[0, vocab // 3] = x[0, vocab - 1] = 50.0  # a tie across blocks: the first index wins
    x[-1, 5] = x[-1, 6] = 50.0  # a tie inside a block
    if rows > 2:
        x[1, vocab - 1] = 60.0  # the max in the last column (the partial block, where there is one)
    x[rows // 2, :] = -1.0  # a constant row: index 0
    assert torch.equal(argmax_rows(x), x.argmax(-1))
    assert torch.equal(argmax_rows(x, min_rows=0), x.argmax(-1))  # as DecodeStep calls it


@pytest.mark.parametrize(
    ("rows", "vocab", "k"),
    [(1, 8000, 16), (7, 8000, 4), (33, 4096, 10), (3, 100, 8), (5, 58101, 16), (4, 3000, 8)],
)
def test_topk_rows_is_torch_topk(rows: int, vocab: int, k: int) -> None:
    """The k best of each row, best first, from the k best blocks only: the same as torch's topk,
    also when the best values crowd into one block, spread one per block, or lie in the last,
    partial block (vocabularies that are not a multiple of the block: 58,101 is OPUS-MT's)."""
    torch.manual_seed(rows)
    x = torch.randn(rows, vocab)
    x[0, 128 : 128 + k] += 50.0  # row 0: its best all in one block
    for i in range(1, rows):
        x[i, torch.arange(k) * 64 % vocab] += 30.0 + torch.arange(k)  # one per block, ordered
    tail = vocab - vocab % 64 if vocab % 64 else vocab - 64
    x[-1, tail : tail + min(k, vocab - tail)] += 80.0  # the last row's best in the last block
    values, indices = topk_rows(x, k)
    expected = x.topk(k, dim=-1)
    assert torch.equal(values, expected.values) and torch.equal(indices, expected.indices)


def step_choice(logits: Tensor, beam_rows: Tensor, top: int, eos: int = EOS_ID) -> StepChoice:
    """What ``DecodeStep`` makes of ``logits``, computed here with torch's own ops."""
    lp = torch.log_softmax(logits, dim=-1)[beam_rows]
    values, tokens = lp.topk(top, dim=-1)
    return StepChoice(logits.argmax(-1), tokens, values, lp[:, eos])


def test_greedy_without_scores_chooses_the_same_tokens() -> None:
    torch.manual_seed(0)
    logits = torch.randn(16, 100) * 3
    limits = [1 if i % 5 == 0 else 10 for i in range(16)]  # some rows at their limit: eos forced
    scored = [Beam.start(1, limit) for limit in limits]
    unscored = [Beam.start(1, limit) for limit in limits]
    with_scores, without = Search(eos=EOS_ID), Search(eos=EOS_ID, greedy_scores=False)
    assert all(with_scores.wants_candidates(b) for b in scored)
    assert not any(without.wants_candidates(b) for b in unscored)
    keep_a, tokens_a = with_scores.step(scored, step_choice(logits, torch.arange(16), 2))
    keep_b, tokens_b = without.step(unscored, step_choice(logits, torch.zeros(1, dtype=torch.long), 2))
    assert torch.equal(tokens_a, tokens_b) and (keep_a is None) == (keep_b is None)
    assert [b.done for b in scored] == [b.done for b in unscored] == [i % 5 == 0 for i in range(16)]
    lprobs = torch.log_softmax(logits, -1)
    for i, (a, b) in enumerate(zip(scored, unscored, strict=True)):
        if i % 5 == 0:  # ended at once, with eos's own log-prob
            assert a.finished[0].log_prob == pytest.approx(float(lprobs[i, EOS_ID]))
            assert b.finished[0].log_prob == 0.0
        else:
            assert a.scores[0] == pytest.approx(float(lprobs[i].max())) and b.scores[0] == 0.0
            assert a.history == b.history == [[int(logits[i].argmax())]]


def test_running_batch_without_greedy_scores_decodes_the_same_tokens(
    make_model: Callable[..., Transformer],
) -> None:
    """End to end: the service's unscored greedy rows (no candidates asked of the step) decode
    exactly the tokens of scored ones, and report scores of 0."""
    model = make_model(
        seed=1, sharpen=2.0, eos_boost=1.5, share_embeddings=False, tie_output=False, pre_norm=True
    )
    sources = random_sources(model.cfg.vocab_size, [4, 11, 7, 2], seed=5)
    options = DecodeOptions(beam_size=1, max_length_a=1.5, max_length_b=5)
    runner = load_runner(model, top=2, capacity=8, positions=options.positions(128), compile=False)
    results: dict[bool, dict[int, list[Hypothesis]]] = {}
    with torch.inference_mode():
        for scores in (True, False):
            batch: RunningBatch[int] = RunningBatch(
                model, runner, capacity=8, options=options, greedy_scores=scores
            )
            batch.add([Source(i, ids) for i, ids in enumerate(sources)])
            done: dict[int, list[Hypothesis]] = {}
            while len(batch):
                done.update(batch.step())
            results[scores] = done
    assert sorted(results[True]) == sorted(results[False]) == list(range(len(sources)))
    for i in range(len(sources)):
        (scored,), (unscored,) = results[True][i], results[False][i]
        assert scored.tokens == unscored.tokens, f"input {i}"
        assert scored.log_prob < 0 and unscored.log_prob == unscored.score == 0.0


def test_beam_of_one_through_the_candidates_equals_greedy_on_scripted_model() -> None:
    """A beam of one goes through the argmax (``Beam.extend``), or, with the repetition guard on,
    through the candidates (``Beam.advance``); a guard too long to ever ban anything must change
    nothing."""
    words = [[7, 8, 9], [10], [11, 12, 13, 14, 15, 4], [A]]
    options = DecodeOptions(beam_size=1, max_length_a=1.5, max_length_b=10)
    greedy = scripted_decode(ScriptedModel(copy), words, options)
    guarded = scripted_decode(ScriptedModel(copy), words, options.but(no_repeat_ngram_size=40))
    assert_same_hypotheses(greedy, guarded)
    assert [h[0].tokens for h in greedy] == words
    # Each: n words at p=.7 then eos at p=.7.
    for w, h in zip(words, greedy, strict=True):
        assert h[0].log_prob == pytest.approx((len(w) + 1) * math.log(0.7), abs=1e-5)
        assert h[0].score == pytest.approx(h[0].log_prob / (len(w) + 1), abs=1e-5)


# -- beam search finds what greedy misses -----------------------------------------------------------


@pytest.mark.parametrize("beam_size", [2, 4])
def test_beam_finds_more_probable_sequence_than_greedy(beam_size: int) -> None:
    words = [[7, 8], [9]]
    options = DecodeOptions(beam_size=1, max_length_a=1.5, max_length_b=10)
    greedy = scripted_decode(ScriptedModel(trap), words, options)
    beam = scripted_decode(ScriptedModel(trap), words, options.but(beam_size=beam_size))
    for g, b in zip(greedy, beam, strict=True):
        assert g[0].tokens == [A, C]
        assert g[0].log_prob == pytest.approx(math.log(0.5 * 0.1 * 0.9), abs=1e-5)
        assert b[0].tokens == [B]
        assert b[0].log_prob == pytest.approx(math.log(0.4 * 0.99), abs=1e-5)
        assert b[0].log_prob > g[0].log_prob + 1.0


# -- n-best ---------------------------------------------------------------------------------------


def rescore(model: Transformer, src: list[int], tokens: list[int]) -> float:
    """log P(tokens + eos | src) by teacher forcing through the whole-prefix decoder."""
    tgt = torch.tensor([[BOS_ID, *tokens, EOS_ID]])
    with torch.inference_mode():
        enc = model.encode(torch.tensor([src]))
        lprobs = torch.log_softmax(model.decode(tgt[:, :-1], enc).float(), dim=-1)[0]
    return float(lprobs.gather(1, tgt[0, 1:, None]).sum())


@pytest.mark.parametrize("length_penalty", [1.0, 0.0])
def test_n_best_sorted_distinct_and_scored_correctly(
    make_model: Callable[..., Transformer], length_penalty: float
) -> None:
    model = make_model(seed=1, sharpen=2.0, eos_boost=1.5, share_embeddings=False, tie_output=False)
    sources = [[10, 11, 12, 13, EOS_ID], [20, 21, 22, 23, 24, 25, EOS_ID], [30, EOS_ID]]
    options = DecodeOptions(
        beam_size=4, n_best=3, length_penalty=length_penalty, max_length_a=1.0, max_length_b=4
    )
    results = real_decode(model, sources, options)
    assert len(results) == 3
    for i, hyps in enumerate(results):
        assert len(hyps) == 3, f"input {i}"
        scores = [h.score for h in hyps]
        assert scores == sorted(scores, reverse=True), f"input {i}"
        assert len({tuple(h.tokens) for h in hyps}) == 3, f"input {i}: duplicate hypotheses"
        for h in hyps:
            n = len(h.tokens) + 1  # eos counts
            assert n <= len(sources[i]) + 4
            assert h.score == pytest.approx(h.log_prob / n**length_penalty, abs=1e-5)
            # The reported log-prob is the model's probability of exactly these tokens.
            assert h.log_prob == pytest.approx(rescore(model, sources[i], h.tokens), abs=1e-3)


def test_n_best_on_scripted_model_finds_the_alternatives() -> None:
    options = DecodeOptions(beam_size=3, n_best=3, max_length_a=0, max_length_b=10)
    (hyps,) = scripted_decode(ScriptedModel(copy), [[7, 8]], options)
    assert hyps[0].tokens == [7, 8]
    assert hyps[0].log_prob == pytest.approx(3 * math.log(0.7), abs=1e-5)
    assert len({tuple(h.tokens) for h in hyps}) == 3
    assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
    for h in hyps:  # each one's log-prob is the rule's, recomputed
        assert h.log_prob == pytest.approx(rule_log_prob(copy, [7, 8], h.tokens), abs=1e-5)


# -- length limits --------------------------------------------------------------------------------


def test_output_limit_is_the_formula_clamped() -> None:
    """floor(a * source length + b), never below 1 (eos must fit) nor above the output cap or the
    model's positions."""
    for a in (0.0, 0.25, 0.5, 1.0, 1.5, 2.0, 3.75):
        for b in (0, 1, 3, 10, 200):
            for cap in (1, 7, 16, 256):
                options = DecodeOptions(max_length_a=a, max_length_b=b, max_output_tokens=cap)
                for max_positions in (5, 64, 1024):
                    for n in (1, 2, 3, 7, 10, 63, 100, 400):
                        expected = max(1, min(math.floor(a * n + b), cap, max_positions))
                        assert options.output_limit(n, max_positions) == expected, (
                            a,
                            b,
                            cap,
                            max_positions,
                            n,
                        )
    options = DecodeOptions(max_length_a=1.5, max_length_b=10, max_output_tokens=1000)
    assert [options.output_limit(n, 1000) for n in (1, 4, 10, 100)] == [11, 16, 25, 160]
    assert [options.output_limit(n, 20) for n in (1, 4, 10, 100)] == [11, 16, 20, 20]
    half = DecodeOptions(max_length_a=0.5, max_length_b=0)
    assert [half.output_limit(n, 1000) for n in (1, 4, 10, 100)] == [1, 2, 5, 50]


@pytest.mark.parametrize("a, b", [(0.5, 1), (1.0, 0), (1.5, 3)])
@pytest.mark.parametrize("beam_size", [1, 3])
def test_outputs_never_exceed_max_length(beam_size: int, a: float, b: int) -> None:
    """A decoder that never wants to stop: every output is cut at exactly a*src_len+b tokens
    (eos included, forced with its own probability)."""
    words = [[7], [7, 8, 9], [7, 8, 9, 10, 11, 12, 13]]
    options = DecodeOptions(beam_size=beam_size, n_best=beam_size, max_length_a=a, max_length_b=b)
    limits = [limit_of(options, [*w, EOS_ID]) for w in words]
    assert limits == [max(1, math.floor(a * (len(w) + 1) + b)) for w in words]
    model = ScriptedModel(never_ends)
    results = scripted_decode(model, words, options)
    for hyps, limit in zip(results, limits, strict=True):
        assert hyps[0].tokens == [A + t % (V - A) for t in range(limit - 1)]
        assert len(hyps) == beam_size
        for h in hyps:
            assert len(h.tokens) + 1 <= limit
    assert len(model.batch_sizes) == max(limits)


@pytest.mark.parametrize("beam_size", [1, 3])
def test_length_limit_of_one_allows_only_eos(beam_size: int) -> None:
    """With room for one token only, eos is forced at the first step: one empty hypothesis, whose
    log-prob is eos's (the beams that are not alive yet at step 0 must not produce hypotheses)."""
    model = ScriptedModel(copy)
    options = DecodeOptions(beam_size=beam_size, n_best=beam_size, max_length_a=0, max_length_b=0)
    assert limit_of(options, [7, 8, EOS_ID]) == 1
    (hyps,) = scripted_decode(model, [[7, 8]], options)
    rest = (1 - 0.7 - 0.2) / (V - 2)  # eos is neither the copied token nor its alternative
    assert [(h.tokens, pytest.approx(h.log_prob)) for h in hyps] == [([], math.log(rest))]
    assert model.batch_sizes == [beam_size]


@pytest.mark.parametrize("beam_size", [1, 4])
def test_transformer_outputs_respect_max_length(
    make_model: Callable[..., Transformer], beam_size: int
) -> None:
    model = make_model(seed=7)  # random weights, plain: it essentially never predicts eos
    sources = [[9, 9, EOS_ID], [5, 6, 7, 8, EOS_ID]]
    options = DecodeOptions(beam_size=beam_size, n_best=beam_size, max_length_a=0.5, max_length_b=2)
    limits = [options.output_limit(len(s), model.cfg.max_positions) for s in sources]
    assert limits == [3, 4]
    for hyps, limit in zip(real_decode(model, sources, options), limits, strict=True):
        assert len(hyps) == beam_size and all(len(h.tokens) + 1 <= limit for h in hyps)


# -- finished rows leave the batch --------------------------------------------------------------------


def test_greedy_drops_finished_rows() -> None:
    words = [[7], [8, 9, 10], [11, 12, 13, 14, 15, 4]]  # ends after 2, 4 and 7 steps
    model = ScriptedModel(copy)
    results = scripted_decode(model, words, DecodeOptions(beam_size=1, max_length_a=2.0, max_length_b=10))
    assert [h[0].tokens for h in results] == words
    # A row with n words is fed at steps 0..n (n words, then eos is predicted).
    assert model.batch_sizes == [sum(len(w) >= t for w in words) for t in range(7)] == [3, 3, 2, 2, 1, 1, 1]


def test_beam_drops_finished_sentences() -> None:
    words = [[7], [8, 9, 10], [11, 12, 13, 14, 15, 4]]
    # k = 2: a sentence is done once k hypotheses have ended, and with this rule the beams that
    # leave the copy end at once; with a larger k they would fill the finished set before the
    # 6-word copy ends (the stopping rule of fairseq, which this search follows).
    k = 2
    model = ScriptedModel(copy)
    options = DecodeOptions(beam_size=k, max_length_a=2.0, max_length_b=10)
    results = scripted_decode(model, words, options)
    assert [h[0].tokens for h in results] == words
    sizes = model.batch_sizes
    assert sizes[0] == k * len(words) and sizes[-1] == k
    assert all(s % k == 0 for s in sizes) and sizes == sorted(sizes, reverse=True)
    assert len(set(sizes)) == 3  # the batch shrank twice: one sentence left each time
    assert len(sizes) < max(limit_of(options, [*w, EOS_ID]) for w in words)  # stopped long before


@pytest.mark.parametrize("beam_size", [1, 3])
def test_inputs_are_independent_of_their_batch(
    make_model: Callable[..., Transformer], beam_size: int
) -> None:
    """Each input's search result is the same alone and in a batch of other inputs: all joined at
    once (padded to the longest source), or joining as others leave (a cache of two inputs' rows:
    rows at different steps side by side, finished rows replaced by the last ones)."""
    model = make_model(
        seed=1, sharpen=2.0, eos_boost=1.5, share_embeddings=False, tie_output=False, pre_norm=True
    )
    sources = random_sources(model.cfg.vocab_size, [4, 6, 2, 9, 5], seed=7)
    options = DecodeOptions(beam_size=beam_size, n_best=beam_size, max_length_a=1.5, max_length_b=5)
    alone = [real_decode(model, [s], options)[0] for s in sources]
    assert len({len(h[0].tokens) for h in alone}) > 1  # inputs end at different steps
    for capacity in (32, 2 * beam_size):
        assert_same_hypotheses(real_decode(model, sources, options, capacity=capacity), alone)


@pytest.mark.parametrize("capacity", [64, 6])
@pytest.mark.parametrize("beam_size", [1, 3])
def test_scripted_rows_read_their_own_source_and_prefix(beam_size: int, capacity: int) -> None:
    """Every hypothesis' log-prob is the rule's for exactly its tokens, and each input's result is
    the one it gets alone: the decoder read its own source and prefix at every step, through beams
    changing parents (``reorder``), finished inputs leaving and the last rows moving into their
    places (``remove``), and inputs joining beside rows at other steps (``capacity`` 6)."""
    rng = random.Random(1)
    words = [[rng.randrange(A, V) for _ in range(n)] for n in (3, 1, 6, 2, 4, 5, 2, 7)]
    options = DecodeOptions(beam_size=beam_size, n_best=beam_size, max_length_a=1.0, max_length_b=4)
    model = ScriptedModel(hashed)
    results = scripted_decode(model, words, options, capacity=capacity)
    alone = [scripted_decode(ScriptedModel(hashed), [w], options)[0] for w in words]
    assert_same_hypotheses(results, alone)
    lengths = set()
    for w, hyps in zip(words, results, strict=True):
        assert len(hyps) == beam_size
        for h in hyps:
            assert h.log_prob == pytest.approx(rule_log_prob(hashed, w, h.tokens), abs=1e-4), (w, h.tokens)
            lengths.add(len(h.tokens))
    assert len(lengths) > 2  # inputs end at different steps, before and at their limits
    assert max(model.batch_sizes) <= capacity  # capacity 6: inputs joined as others left


@pytest.mark.parametrize("greedy_scores", [True, False])
@pytest.mark.parametrize("k", [2, 4])
def test_choosing_among_each_rows_best_2k_is_searching_the_whole_vocabulary(
    k: int, greedy_scores: bool
) -> None:
    """``Search.step`` given each beam row's best 2K log-probs (what ``DecodeStep`` keeps) advances
    greedy and beam inputs side by side exactly as given every token of the vocabulary, limits
    and finished hypotheses included."""
    torch.manual_seed(k)
    vocab, eos = 40, 3
    search = Search(eos=eos, greedy_scores=greedy_scores)
    full = [Beam.start(size, limit) for size, limit in ((k, 2), (1, 5), (k, 9), (1, 9), (k, 14), (1, 3))]
    chosen = deepcopy(full)
    steps = 0
    while any(not b.done for b in full):
        live = [i for i, b in enumerate(full) if not b.done]
        sizes = [full[i].k for i in live]
        logits = torch.randn(sum(sizes), vocab) * 3
        logits[:, eos] -= 2.0  # hypotheses end, but not all at once
        starts = [sum(sizes[:j]) for j in range(len(live))]
        wanted = [
            s + r
            for s, i in zip(starts, live, strict=True)
            if search.wants_candidates(full[i])
            for r in range(full[i].k)
        ]
        beam_rows = torch.tensor(wanted or [0])  # at least one row, as the running batch passes
        expected = search.step([full[i] for i in live], step_choice(logits, beam_rows, vocab, eos))
        got = search.step([chosen[i] for i in live], step_choice(logits, beam_rows, 2 * k, eos))
        for e, g in zip(expected, got, strict=True):
            assert (e is None and g is None) or (e is not None and g is not None and torch.equal(e, g))
        for a, b in zip(full, chosen, strict=True):
            assert (a.history, a.scores, a.done) == (b.history, b.scores, b.done)
            assert [(h.tokens, h.score) for h in a.finished] == [(h.tokens, h.score) for h in b.finished]
        steps += 1
    assert steps >= 9  # the longer limits are reached: many steps after the first inputs ended


# -- the repetition guard -----------------------------------------------------------------------------


def repeats_an_ngram(seq: list[int], n: int) -> bool:
    """Whether the last n-gram of ``seq`` appears earlier in it."""
    if n == 0 or len(seq) < n:
        return False
    return any(seq[i : i + n] == seq[-n:] for i in range(len(seq) - n))


def has_repeated_ngram(seq: list[int], n: int) -> bool:
    return any(repeats_an_ngram(seq[:end], n) for end in range(len(seq) + 1))


def test_banned_tokens_are_those_that_would_repeat_an_ngram() -> None:
    rng = random.Random(0)
    for _ in range(600):
        alphabet = rng.randint(1, 5)
        history = [rng.randrange(alphabet) for _ in range(rng.randint(0, 14))]
        for n in range(6):
            expected = {t for t in range(alphabet + 1) if repeats_an_ngram([*history, t], n)}
            assert banned_tokens(history, n) == expected, (history, n)


def guarded_greedy(rule: Rule, source: list[int], limit: int, n: int) -> list[int]:
    """Greedy search by the definition: the likeliest token that repeats no n-gram, eos at the
    limit."""
    out: list[int] = []
    while len(out) + 1 < limit:
        lp = distribution(rule(source, out))
        token = max((t for t in range(V) if not repeats_an_ngram([*out, t], n)), key=lambda t: lp[t])
        if token == EOS_ID:
            break
        out.append(token)
    return out


@pytest.mark.parametrize("beam_size", [1, 3])
def test_no_repeat_ngram_guard(beam_size: int) -> None:
    """A decoder that wants A B A B ...: with the guard, no output repeats a bigram; without it,
    the best output is A B A B ... to its limit."""
    words = [[7, 8, 9], [10, 11, 12, 13, 14]]
    options = DecodeOptions(beam_size=beam_size, n_best=beam_size, max_length_a=1.0, max_length_b=6)
    free = scripted_decode(ScriptedModel(repeats), words, options)
    guarded = scripted_decode(ScriptedModel(repeats), words, options.but(no_repeat_ngram_size=2))
    for w, hyps_free, hyps_guarded in zip(words, free, guarded, strict=True):
        limit = limit_of(options, [*w, EOS_ID])
        assert hyps_free[0].tokens == [A, B] * ((limit - 1) // 2) + [A] * ((limit - 1) % 2)
        assert has_repeated_ngram(hyps_free[0].tokens, 2)
        assert len(hyps_guarded) == beam_size
        for h in hyps_guarded:
            assert not has_repeated_ngram(h.tokens, 2), h.tokens
        assert hyps_guarded[0].tokens[:3] == [A, B, A]  # a token may repeat, a bigram may not


@pytest.mark.parametrize(
    ("beam_size", "top"),
    [
        (1, V),
        (3, V),
        (3, 6 + GUARD_MARGIN),
        (1, 2 + GUARD_MARGIN),  # what the Translator keeps for greedy with the guard
    ],
)
def test_guarded_search_follows_the_definition(beam_size: int, top: int) -> None:
    """Greedy with the guard is the likeliest allowed token at every step (by the definition, over
    the whole vocabulary); every guarded hypothesis' log-prob is the rule's, eos included; a guarded
    beam finds at least what guarded greedy does."""
    words = [[7, 8, 9], [10, 11, 12, 13, 14]]
    options = DecodeOptions(
        beam_size=beam_size, n_best=beam_size, max_length_a=1.0, max_length_b=6, no_repeat_ngram_size=2
    )
    results = scripted_decode(ScriptedModel(repeats), words, options, top=top)
    for w, hyps in zip(words, results, strict=True):
        greedy = guarded_greedy(repeats, w, limit_of(options, [*w, EOS_ID]), 2)
        for h in hyps:
            assert not has_repeated_ngram(h.tokens, 2), h.tokens
            assert h.log_prob == pytest.approx(rule_log_prob(repeats, w, h.tokens), abs=1e-4), h.tokens
        if beam_size == 1:
            assert hyps[0].tokens == greedy
        else:
            assert hyps[0].score >= rule_log_prob(repeats, w, greedy) / (len(greedy) + 1) - 1e-5


def test_a_source_within_the_input_limit_decodes(make_model: Callable[..., Transformer]) -> None:
    model = make_model(seed=1)
    options = DecodeOptions(beam_size=1, max_input_tokens=100, max_output_tokens=20)
    source = [5] * options.input_limit(model.cfg.max_positions) + [EOS_ID]  # 100 tokens, then eos
    (hyps,) = real_decode(model, [source], options, capacity=2)
    assert len(hyps[0].tokens) < 20
