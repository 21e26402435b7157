"""Greedy and beam search (model.search), on tiny random Transformers and on a scripted decoder.

The scripted decoder (``ScriptedModel``) has the interface the search functions use (``cfg``,
``start_cache``, ``decode_step``) but its next-token distribution is a hand-written function of the
source and the prefix, so that tests can build cases with a known answer: a sentence where greedy
search is lured into an improbable continuation, sentences that end after a known number of steps.
The prefix and the source travel in a real ``KVCache`` (token ids stored as its keys and values), so
the searches' own reordering and dropping of cache rows decides what the decoder sees.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from copy import deepcopy

import pytest
import torch
from torch import Tensor

from model.cache import KVCache
from model.config import ModelConfig
from model.search import (
    Beam,
    Hypothesis,
    argmax_rows,
    beam_search,
    choose_step,
    greedy_search,
    max_lengths,
    search_step,
    topk_rows,
)
from model.static_slots import StepChoice
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

    Row b's source ids live in ``cache.cross_kv[0, 0, b, 0, :, 0]`` and its prefix (bos and the
    tokens fed so far) in ``cache.self_kv[0, 0, b, 0, :length, 0]``, so whatever the search does to
    the cache (``index_select``, ``reserve``) is what this decoder reads back.
    """

    def __init__(self, rule: Rule) -> None:
        self.cfg = ModelConfig(vocab_size=V, d_model=4, n_heads=1, encoder_layers=1, decoder_layers=1)
        self.rule = rule
        self.batch_sizes: list[int] = []  # rows fed to every decode_step call

    def encode(self, src: Tensor) -> EncoderOutput:
        return EncoderOutput(memory=src.float()[:, :, None], src_mask=src != PAD_ID)

    def start_cache(self, enc: EncoderOutput, capacity: int = 2) -> KVCache:
        b, s, _ = enc.memory.shape
        cross = enc.memory[None, None, :, None].expand(1, 2, b, 1, s, 1).clone()  # (L, 2, B, H, S, Dh)
        return KVCache(
            self_kv=torch.zeros(1, 2, b, 1, capacity, 1),
            cross_kv=cross,
            src_mask=enc.src_mask,
            lengths=torch.zeros(b, dtype=torch.long),
            max_length=0,
            uniform=True,
        )

    def decode_step(self, tokens: Tensor, cache: KVCache) -> tuple[Tensor, KVCache]:
        self.batch_sizes.append(len(tokens))
        cache.reserve(cache.max_length + 1)
        rows = torch.arange(len(tokens))
        cache.self_kv[0, 0, rows, 0, cache.lengths, 0] = tokens.float()
        cache.lengths = cache.lengths + 1
        cache.max_length += 1
        out = []
        for b in range(len(tokens)):
            prefix = cache.self_kv[0, 0, b, 0, : int(cache.lengths[b]), 0].long().tolist()
            assert prefix[0] == BOS_ID, "a row's cache was mixed up with another row's"
            src = cache.cross_kv[0, 0, b, 0, :, 0][cache.src_mask[b]].long().tolist()
            assert src[-1] == EOS_ID
            out.append(distribution(self.rule(src[:-1], prefix[1:])))
        return torch.tensor(out), cache


def as_model(m: ScriptedModel) -> Transformer:
    return m  # type: ignore[return-value]  # duck-typed: the searches only use cfg/start_cache/decode_step


def scripted_sources(words: list[list[int]]) -> Tensor:
    """Right-padded (B, S) source ids: each row's words, then eos."""
    src = torch.full((len(words), max(map(len, words)) + 1), PAD_ID, dtype=torch.long)
    for i, w in enumerate(words):
        src[i, : len(w) + 1] = torch.tensor([*w, EOS_ID])
    return src


def src_lengths(src: Tensor) -> Tensor:
    return (src != PAD_ID).sum(1)


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


# -- beam size 1 is greedy --------------------------------------------------------------------------


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
    model = make_model(seed=1, sharpen=2.0, eos_boost=1.5, tie_embeddings=False, pre_norm=True)
    g = torch.Generator().manual_seed(3)
    lengths = [3, 9, 5, 12, 2, 7]
    src = torch.full((len(lengths), max(lengths)), PAD_ID, dtype=torch.long)
    for i, n in enumerate(lengths):
        src[i, : n - 1] = torch.randint(4, model.cfg.vocab_size, (n - 1,), generator=g)
        src[i, n - 1] = EOS_ID
    limits = max_lengths(src_lengths(src), 1.5, 5, 64)
    got = greedy_search(model, model.encode(src), limits)
    ended = 0
    with torch.no_grad():
        for i, n in enumerate(lengths):
            enc = model.encode(src[i : i + 1, :n])
            prefix, log_prob = [BOS_ID], 0.0
            while True:
                lprobs = torch.log_softmax(model.decode(torch.tensor([prefix]), enc)[0, -1], dim=-1)
                # The last allowed token is eos; before it, the most probable one.
                token = EOS_ID if len(prefix) == int(limits[i]) else int(lprobs.argmax())
                log_prob += float(lprobs[token])
                if token == EOS_ID:
                    break
                prefix.append(token)
            ended += len(prefix) < int(limits[i])
            assert got[i][0].tokens == prefix[1:], f"input {i}"
            assert got[i][0].log_prob == pytest.approx(log_prob, abs=1e-4), f"input {i}"
            # Length-normalised by the output length with eos (len(prefix): bos + tokens).
            assert got[i][0].score == pytest.approx(log_prob / len(prefix), abs=1e-4), f"input {i}"
    assert 0 < ended < len(lengths)  # both ways of ending are covered: eos, and the length limit


@pytest.mark.parametrize(("rows", "vocab"), [(1, 128), (8, 8000), (64, 8000), (64, 1024), (13, 100)])
def test_argmax_rows_is_torch_argmax_ties_included(rows: int, vocab: int) -> None:
    torch.manual_seed(rows + vocab)
    x = torch.randn(rows, vocab)
    x[0, vocab // 3] = x[0, vocab - 1] = 50.0  # a tie across blocks: the first index wins
    x[-1, 5] = x[-1, 6] = 50.0  # a tie inside a block
    x[rows // 2, :] = -1.0  # a constant row: index 0
    assert torch.equal(argmax_rows(x), x.argmax(-1))


@pytest.mark.parametrize(("rows", "vocab", "k"), [(1, 8000, 16), (7, 8000, 4), (33, 4096, 10), (3, 100, 8)])
def test_topk_rows_is_torch_topk(rows: int, vocab: int, k: int) -> None:
    """The k best of each row, best first, from the k best blocks only: the same as torch's topk,
    also when the best values crowd into one block or spread one per block."""
    torch.manual_seed(rows)
    x = torch.randn(rows, vocab)
    x[0, 128 : 128 + k] += 50.0  # row 0: its best all in one block
    for i in range(1, rows):
        x[i, torch.arange(k) * 64 % vocab] += 30.0 + torch.arange(k)  # one per block, ordered
    values, indices = topk_rows(x, k)
    expected = x.topk(k, dim=-1)
    assert torch.equal(values, expected.values) and torch.equal(indices, expected.indices)


def test_greedy_without_scores_chooses_the_same_tokens() -> None:
    torch.manual_seed(0)
    logits = torch.randn(16, 100) * 3
    limits = [1 if i % 5 == 0 else 10 for i in range(16)]  # some rows at their limit: eos forced
    scored = [Beam.start(1, limit) for limit in limits]
    unscored = [Beam.start(1, limit) for limit in limits]
    keep_a, tokens_a = search_step(scored, logits, eos=EOS_ID)
    keep_b, tokens_b = search_step(unscored, logits, eos=EOS_ID, greedy_scores=False)
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


def test_beam_size_1_equals_greedy_on_scripted_model() -> None:
    words = [[7, 8, 9], [10], [11, 12, 13, 14, 15, 4], [A]]
    src = scripted_sources(words)
    limits = max_lengths(src_lengths(src), 1.5, 10, 64)
    model = ScriptedModel(copy)
    enc = model.encode(src)
    greedy = greedy_search(as_model(model), enc, limits)
    beam = beam_search(as_model(model), enc, limits, beam_size=1)
    assert_same_hypotheses(greedy, beam)
    assert [h[0].tokens for h in greedy] == words
    # Each: n words at p=.7 then eos at p=.7.
    for w, h in zip(words, greedy, strict=True):
        assert h[0].log_prob == pytest.approx((len(w) + 1) * math.log(0.7), abs=1e-5)
        assert h[0].score == pytest.approx(h[0].log_prob / (len(w) + 1), abs=1e-5)


# -- beam search finds what greedy misses -----------------------------------------------------------


@pytest.mark.parametrize("beam_size", [2, 4])
def test_beam_finds_more_probable_sequence_than_greedy(beam_size: int) -> None:
    src = scripted_sources([[7, 8], [9]])
    limits = max_lengths(src_lengths(src), 1.5, 10, 64)
    model = ScriptedModel(trap)
    enc = model.encode(src)
    greedy = greedy_search(as_model(model), enc, limits)
    beam = beam_search(as_model(model), enc, limits, beam_size=beam_size)
    for g, b in zip(greedy, beam, strict=True):
        assert g[0].tokens == [A, C]
        assert g[0].log_prob == pytest.approx(math.log(0.5 * 0.1 * 0.9), abs=1e-5)
        assert b[0].tokens == [B]
        assert b[0].log_prob == pytest.approx(math.log(0.4 * 0.99), abs=1e-5)
        assert b[0].log_prob > g[0].log_prob + 1.0


# -- n-best ---------------------------------------------------------------------------------------


def rescore(model: Transformer, src: Tensor, tokens: list[int]) -> float:
    """log P(tokens + eos | src) by teacher forcing through the whole-prefix decoder."""
    tgt = torch.tensor([[BOS_ID, *tokens, EOS_ID]])
    with torch.inference_mode():
        lprobs = torch.log_softmax(model.decode(tgt[:, :-1], model.encode(src[None])).float(), dim=-1)[0]
    return float(lprobs.gather(1, tgt[0, 1:, None]).sum())


@pytest.mark.parametrize("length_penalty", [1.0, 0.0])
def test_n_best_sorted_distinct_and_scored_correctly(
    make_model: Callable[..., Transformer], length_penalty: float
) -> None:
    model = make_model(seed=1, sharpen=2.0, eos_boost=1.5, tie_embeddings=False)
    src = torch.tensor(
        [
            [10, 11, 12, 13, EOS_ID, PAD_ID, PAD_ID],
            [20, 21, 22, 23, 24, 25, EOS_ID],
            [30, EOS_ID, 0, 0, 0, 0, 0],
        ]
    )
    limits = max_lengths(src_lengths(src), 1.0, 4, 64)
    results = beam_search(
        model, model.encode(src), limits, beam_size=4, n_best=3, length_penalty=length_penalty
    )
    assert len(results) == 3
    for i, hyps in enumerate(results):
        assert len(hyps) == 3, f"input {i}"
        scores = [h.score for h in hyps]
        assert scores == sorted(scores, reverse=True), f"input {i}"
        assert len({tuple(h.tokens) for h in hyps}) == 3, f"input {i}: duplicate hypotheses"
        for h in hyps:
            n = len(h.tokens) + 1  # eos counts
            assert n <= int(limits[i])
            assert h.score == pytest.approx(h.log_prob / n**length_penalty, abs=1e-5)
            # The reported log-prob is the model's probability of exactly these tokens.
            assert h.log_prob == pytest.approx(rescore(model, src[i][src[i] != PAD_ID], h.tokens), abs=1e-3)


def test_n_best_on_scripted_model_finds_the_alternatives() -> None:
    src = scripted_sources([[7, 8]])
    model = ScriptedModel(copy)
    hyps = beam_search(as_model(model), model.encode(src), torch.tensor([10]), beam_size=3, n_best=3)[0]
    assert hyps[0].tokens == [7, 8]
    assert hyps[0].log_prob == pytest.approx(3 * math.log(0.7), abs=1e-5)
    assert len({tuple(h.tokens) for h in hyps}) == 3
    assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)


# -- length limits --------------------------------------------------------------------------------


def test_max_lengths() -> None:
    n = torch.tensor([1, 4, 10, 100])
    assert max_lengths(n, 1.5, 10, 1000).tolist() == [11, 16, 25, 160]
    assert max_lengths(n, 0.5, 0, 1000).tolist() == [1, 2, 5, 50]  # never below 1: eos must fit
    assert max_lengths(n, 1.5, 10, 20).tolist() == [11, 16, 20, 20]


@pytest.mark.parametrize("a, b", [(0.5, 1), (1.0, 0), (1.5, 3)])
@pytest.mark.parametrize("beam_size", [1, 3])
def test_outputs_never_exceed_max_length(beam_size: int, a: float, b: int) -> None:
    """A decoder that never wants to stop: every output is cut at exactly a*src_len+b tokens
    (eos included, forced with its own probability)."""
    words = [[7], [7, 8, 9], [7, 8, 9, 10, 11, 12, 13]]
    src = scripted_sources(words)
    limits = max_lengths(src_lengths(src), a, b, 64)
    assert limits.tolist() == [max(1, math.floor(a * (len(w) + 1) + b)) for w in words]
    model = ScriptedModel(never_ends)
    enc = model.encode(src)
    if beam_size == 1:
        results = greedy_search(as_model(model), enc, limits)
    else:
        results = beam_search(as_model(model), enc, limits, beam_size=beam_size, n_best=beam_size)
    for hyps, limit in zip(results, limits.tolist(), strict=True):
        assert hyps[0].tokens == [A + t % (V - A) for t in range(limit - 1)]
        for h in hyps:
            assert len(h.tokens) + 1 <= limit
    assert len(model.batch_sizes) == max(limits.tolist())


@pytest.mark.parametrize("beam_size", [1, 3])
def test_length_limit_of_one_allows_only_eos(beam_size: int) -> None:
    """With room for one token only, eos is forced at the first step: one empty hypothesis, whose
    log-prob is eos's (the beams that are not alive yet at step 0 must not produce hypotheses)."""
    src = scripted_sources([[7, 8]])
    model = ScriptedModel(copy)
    enc = model.encode(src)
    limits = torch.tensor([1])
    if beam_size == 1:
        (hyps,) = greedy_search(as_model(model), enc, limits)
    else:
        (hyps,) = beam_search(as_model(model), enc, limits, beam_size=beam_size, n_best=beam_size)
    rest = (1 - 0.7 - 0.2) / (V - 2)  # eos is neither the copied token nor its alternative
    assert [(h.tokens, pytest.approx(h.log_prob)) for h in hyps] == [([], math.log(rest))]
    assert model.batch_sizes == [beam_size]


@pytest.mark.parametrize("beam_size", [1, 4])
def test_transformer_outputs_respect_max_length(
    make_model: Callable[..., Transformer], beam_size: int
) -> None:
    model = make_model(seed=7)  # random weights, plain: it essentially never predicts eos
    src = torch.tensor([[9, 9, EOS_ID, PAD_ID, PAD_ID], [5, 6, 7, 8, EOS_ID]])
    limits = max_lengths(src_lengths(src), 0.5, 2, 64)  # 3 and 4 tokens
    enc = model.encode(src)
    if beam_size == 1:
        results = greedy_search(model, enc, limits)
    else:
        results = beam_search(model, enc, limits, beam_size=beam_size, n_best=beam_size)
    for hyps, limit in zip(results, limits.tolist(), strict=True):
        assert hyps and all(len(h.tokens) + 1 <= limit for h in hyps)


# -- finished rows leave the batch --------------------------------------------------------------------


def test_greedy_drops_finished_rows() -> None:
    words = [[7], [8, 9, 10], [11, 12, 13, 14, 15, 4]]  # ends after 2, 4 and 7 steps
    model = ScriptedModel(copy)
    src = scripted_sources(words)
    results = greedy_search(as_model(model), model.encode(src), max_lengths(src_lengths(src), 2.0, 10, 64))
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
    src = scripted_sources(words)
    limits = max_lengths(src_lengths(src), 2.0, 10, 64)
    results = beam_search(as_model(model), model.encode(src), limits, beam_size=k)
    assert [h[0].tokens for h in results] == words
    sizes = model.batch_sizes
    assert sizes[0] == k * len(words) and sizes[-1] == k
    assert all(s % k == 0 for s in sizes) and sizes == sorted(sizes, reverse=True)
    assert len(set(sizes)) == 3  # the batch shrank twice: one sentence left each time
    assert len(sizes) < max(limits.tolist())  # and the search stopped long before its limit


def test_inputs_are_independent_of_their_batch(make_model: Callable[..., Transformer]) -> None:
    """Each input's search result is the same alone and in a padded batch of other inputs."""
    model = make_model(seed=1, sharpen=2.0, eos_boost=1.5, tie_embeddings=False, pre_norm=True)
    src = torch.tensor(
        [[10, 11, 12, EOS_ID, PAD_ID, PAD_ID], [20, 21, 22, 23, 24, EOS_ID], [30, EOS_ID, 0, 0, 0, 0]]
    )
    limits = max_lengths(src_lengths(src), 1.5, 5, 64)
    for beam_size in (1, 3):
        batched = beam_search(model, model.encode(src), limits, beam_size=beam_size, n_best=beam_size)
        for i in range(len(src)):
            row = src[i : i + 1, : int(src_lengths(src)[i])]
            alone = beam_search(
                model, model.encode(row), limits[i : i + 1], beam_size=beam_size, n_best=beam_size
            )
            assert_same_hypotheses(alone, batched[i : i + 1])


@pytest.mark.parametrize("k", [2, 4])
def test_choosing_among_each_rows_best_2k_is_searching_the_whole_vocabulary(k: int) -> None:
    """``choose_step`` (the compiled step's candidates: every row's argmax, and for the beam inputs'
    rows only, their best 2K log-probs and eos's) advances greedy and beam inputs side by side
    exactly as ``search_step`` over the full logits, limits and finished ones included."""
    torch.manual_seed(k)
    vocab, eos = 40, 3
    full = [Beam.start(size, limit) for size, limit in ((k, 2), (1, 5), (k, 9), (1, 9), (k, 14), (1, 3))]
    chosen = deepcopy(full)
    while any(not b.done for b in full):
        live = [i for i, b in enumerate(full) if not b.done]
        sizes = [full[i].k for i in live]
        logits = torch.randn(sum(sizes), vocab) * 3
        logits[:, eos] -= 2.0  # hypotheses end, but not all at once
        lp = torch.log_softmax(logits, dim=-1)
        starts = [sum(sizes[:j]) for j in range(len(live))]
        beam_rows = torch.tensor(
            [s + r for s, n in zip(starts, sizes, strict=True) if n > 1 for r in range(n)]
        )
        beam_rows = beam_rows if len(beam_rows) else torch.zeros(1, dtype=torch.long)  # as the executor
        values, tokens = lp[beam_rows].topk(2 * k, dim=-1)
        step = StepChoice(logits.argmax(-1), tokens, values, lp[beam_rows, eos])
        expected = search_step([full[i] for i in live], logits, eos=eos, greedy_scores=False)
        got = choose_step([chosen[i] for i in live], step, eos=eos)
        for e, g in zip(expected, got, strict=True):
            assert (e is None and g is None) or (e is not None and g is not None and torch.equal(e, g))
        for a, b in zip(full, chosen, strict=True):
            assert (a.history, a.scores, a.done) == (b.history, b.scores, b.done)
            assert [(h.tokens, h.score) for h in a.finished] == [(h.tokens, h.score) for h in b.finished]
