"""Lexically constrained decoding (``model.decoding.constraints``, ``Search``/``Beam``, the step's
``forced`` log-probs, ``Tokenizer.decode_spans``, ``Translator.translate_batch(terms=...)``).

The references are independent of the search: constraints are checked by looking for their tokens
in the output, log-probs by teacher forcing the whole output through ``Transformer.decode``, the
forced log-probs against ``log_softmax`` of the full logits, and unconstrained inputs against a
decode in which nothing has constraints.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch
from conftest import compile_cache_dir, needs_cpu_package, random_model

from model.cache import KVCache
from model.decoding.batch import RunningBatch, Source, decode
from model.decoding.constraints import MAX_CONSTRAINED_BEAM, ConstraintSet, bank_sizes, beam_for
from model.decoding.options import DecodeOptions
from model.decoding.search import Hypothesis
from model.runtime.runners import EagerRunner, Runner, load_runner
from model.runtime.step import DecodeStep
from model.tokenizer import BOS_ID, EOS_ID, Tokenizer
from model.transformer import Transformer
from model.translator import Translator

Constraints = tuple[tuple[int, ...], ...]


@pytest.fixture(scope="module")
def model() -> Transformer:
    # Peaked, with eos likely enough that outputs end on their own (as test_search's).
    return random_model(
        seed=1, sharpen=2.0, eos_boost=1.5, share_embeddings=False, tie_output=False, pre_norm=True
    )


def sources_of(vocab: int, lengths: Sequence[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[*torch.randint(4, vocab, (n - 1,), generator=g).tolist(), EOS_ID] for n in lengths]


def run(
    model: Transformer,
    sources: Sequence[Sequence[int]],
    options: DecodeOptions,
    constraints: Sequence[Constraints] | None = None,
    *,
    capacity: int = 32,
    runner: Runner | None = None,
    top: int = 2 * MAX_CONSTRAINED_BEAM,
) -> list[list[Hypothesis]]:
    positions = options.positions(model.cfg.max_positions)
    if runner is None:
        runner = load_runner(model, top=top, capacity=capacity, positions=positions, compile=False)
    with torch.inference_mode():
        return decode(model, runner, sources, options, capacity=capacity, constraints=constraints)


def contains(seq: Sequence[int], sub: Sequence[int]) -> bool:
    return any(list(seq[i : i + len(sub)]) == list(sub) for i in range(len(seq) - len(sub) + 1))


def rescore(model: Transformer, src: list[int], tokens: list[int]) -> float:
    """log P(tokens + eos | src), teacher-forced through the whole-prefix decoder."""
    tgt = torch.tensor([[BOS_ID, *tokens, EOS_ID]])
    with torch.inference_mode():
        enc = model.encode(torch.tensor([src]))
        lprobs = torch.log_softmax(model.decode(tgt[:, :-1], enc).float(), dim=-1)[0]
    return float(lprobs.gather(1, tgt[0, 1:, None]).sum())


def assert_same(a: list[list[Hypothesis]], b: list[list[Hypothesis]]) -> None:
    """The same hypotheses: tokens and spans, and scores to float rounding (a plain model's
    products round differently at other batch sizes: test_search's independence tests allow it)."""
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert [(h.tokens, h.spans) for h in x] == [(h.tokens, h.spans) for h in y], f"input {i}"
        for g, w in zip(x, y, strict=True):
            assert g.log_prob == pytest.approx(w.log_prob, abs=1e-4), f"input {i}"
            assert g.score == pytest.approx(w.score, abs=1e-4), f"input {i}"


def random_constraints(
    rng: random.Random, vocab: int, n: int, avoid: Sequence[Sequence[int]] = ()
) -> Constraints:
    """``n`` constraints of 1 to 3 tokens that none of ``avoid`` contains (so the search must
    put them there)."""
    out: list[tuple[int, ...]] = []
    while len(out) < n:
        c = tuple(rng.randrange(4, vocab) for _ in range(rng.randint(1, 3)))
        if not any(contains(seq, c) for seq in avoid):
            out.append(c)
    return tuple(out)


# -- the state of one hypothesis ------------------------------------------------------------------


def test_beam_for_is_the_smallest_beam_with_a_slot_per_constraint_count() -> None:
    assert [beam_for(1, n) for n in range(4)] == [1, 2, 3, 4]
    assert [beam_for(5, n) for n in range(7)] == [5, 5, 6, 7, 8, 8, 8]
    assert beam_for(1, 50) == MAX_CONSTRAINED_BEAM and beam_for(12, 50) == 12


def test_a_mismatch_mid_constraint_resets_its_progress() -> None:
    cs = ConstraintSet([(5, 6, 7), (9,)])
    s = cs.start()
    for pos, t in enumerate([5, 6]):
        s = cs.advance(s, t, pos)
    assert (s.matched, s.bank, s.n_met) == (2, 2, 0)
    assert sorted(cs.allowed(s)) == [5, 7, 9]  # the continuation, and every unmet start
    s = cs.advance(s, 8, 2)  # mismatch: back to nothing in progress
    assert (s.matched, s.bank, s.n_met) == (0, 0, 0)
    s = cs.advance(s, 5, 3)  # ... and it starts again
    s = cs.advance(s, 5, 4)  # a mismatch that is itself a start: progress 1, not 0
    assert (s.matched, s.bank) == (1, 1)
    for pos, t in enumerate([6, 7, 9], start=5):
        s = cs.advance(s, t, pos)
    assert cs.complete(s) and s.spans == ((4, 7, 0), (7, 8, 1)) and s.bank == cs.tokens == 4
    assert cs.advance(s, 5, 8) == s  # nothing left to meet


def test_constraints_sharing_a_prefix_and_identical_ones_are_each_met() -> None:
    cs = ConstraintSet([(5, 6), (5, 7), (5, 6)])
    s = cs.start()
    for pos, t in enumerate([5, 7, 1, 5, 6, 5, 6]):
        s = cs.advance(s, t, pos)
    assert cs.complete(s) and s.spans == ((0, 2, 1), (3, 5, 0), (5, 7, 2))


def test_spans_are_where_the_constraints_are_on_random_outputs() -> None:
    """Whatever the output, each span holds its constraint's tokens, spans never overlap, each
    constraint is met at most once, and a constraint whose tokens never occur is never met."""
    rng = random.Random(0)
    for _ in range(2000):
        cs = ConstraintSet([tuple(rng.randrange(4, 8) for _ in range(rng.randint(1, 3))) for _ in range(3)])
        out = [rng.randrange(4, 8) for _ in range(rng.randint(0, 12))]
        s = cs.start()
        for pos, t in enumerate(out):
            s = cs.advance(s, t, pos)
        ends = 0
        for start, end, c in sorted(s.spans):
            assert out[start:end] == list(cs.seqs[c]) and start >= ends
            ends = end
        assert sorted(c for _, _, c in s.spans) == sorted(set(c for _, _, c in s.spans))
        assert s.met == sum(1 << c for _, _, c in s.spans)
        for c, seq in enumerate(cs.seqs):
            if not contains(out, seq):
                assert not s.met >> c & 1


def test_bank_sizes_fill_every_slot_they_can() -> None:
    rng = random.Random(1)
    for _ in range(500):
        k = rng.randint(1, 9)
        counts = [rng.randint(0, 4) for _ in range(rng.randint(1, 7))]
        sizes = bank_sizes(k, counts)
        assert all(0 <= s <= c for s, c in zip(sizes, counts, strict=True))
        assert sum(sizes) == min(k, sum(counts))
        if k >= len(counts):  # a bank with candidates keeps at least its even share
            assert all(s >= min(c, k // len(counts)) for s, c in zip(sizes, counts, strict=True))


# -- the search -----------------------------------------------------------------------------------


@pytest.mark.parametrize("beam_size", [1, 4])
def test_every_constraint_appears_in_every_hypothesis(model: Transformer, beam_size: int) -> None:
    """Single- and multi-token constraints, several per input, greedy (a beam of ``beam_for``)
    and beam: every returned hypothesis contains each constraint where its spans say, and its
    log-prob is the model's for exactly its tokens."""
    vocab = model.cfg.vocab_size
    sources = sources_of(vocab, [4, 7, 3, 9, 5, 6], seed=2)
    options = DecodeOptions(beam_size=beam_size, max_length_a=1.5, max_length_b=8)
    free = run(model, sources, options.but(n_best=beam_size))
    rng = random.Random(beam_size)
    constraints = [
        random_constraints(rng, vocab, n, [h.tokens for h in hyps])
        for n, hyps in zip([1, 2, 3, 1, 2, 3], free, strict=True)
    ]
    assert any(len(c) > 1 for cs in constraints for c in cs)
    n_best = [beam_for(beam_size, len(cs)) for cs in constraints]
    results = [
        run(model, [s], options.but(beam_size=beam_size, n_best=1), [cs])[0]
        for s, cs in zip(sources, constraints, strict=True)
    ]
    together = run(model, sources, options, constraints)
    for i, (src, cs, hyps) in enumerate(zip(sources, constraints, together, strict=True)):
        assert hyps[0].tokens == results[i][0].tokens
        for h in hyps:
            for c, seq in enumerate(cs):
                assert contains(h.tokens, seq), (i, c, h.tokens, seq)
            assert sorted(c for _, _, c in h.spans) == list(range(len(cs)))
            for start, end, c in h.spans:
                assert tuple(h.tokens[start:end]) == cs[c]
            assert h.log_prob == pytest.approx(rescore(model, src, h.tokens), abs=1e-3)
    # n-best: distinct hypotheses, at most as many as asked, each with every constraint.
    wide = run(model, sources, options.but(n_best=beam_size), constraints)
    for hyps, cs, k in zip(wide, constraints, n_best, strict=True):
        assert len({tuple(h.tokens) for h in hyps}) == len(hyps) and 1 <= len(hyps) <= beam_size <= k
        assert all(contains(h.tokens, seq) for h in hyps for seq in cs)
    assert beam_size == 1 or any(len(hyps) > 1 for hyps in wide)


@pytest.mark.parametrize("capacity", [32, 9])
def test_unconstrained_inputs_decode_as_if_no_input_had_constraints(
    model: Transformer, capacity: int
) -> None:
    """Inputs without constraints, in a running batch with constrained ones (capacity 9: inputs
    join as others leave, rows at different steps side by side, beams of different sizes): the
    same tokens and scores as a decode where nothing has constraints."""
    vocab = model.cfg.vocab_size
    sources = sources_of(vocab, [5, 8, 3, 6, 9, 4, 7, 2], seed=5)
    options = DecodeOptions(beam_size=3, n_best=2, max_length_a=1.5, max_length_b=14)
    plain = run(model, sources, options, capacity=capacity)
    rng = random.Random(3)
    constraints = [
        random_constraints(rng, vocab, 1 + i % 4, [h.tokens for h in plain[i]]) if i % 2 else ()
        for i in range(len(sources))
    ]
    mixed = run(model, sources, options, constraints, capacity=capacity)
    unconstrained = [i for i, cs in enumerate(constraints) if not cs]
    assert_same([mixed[i] for i in unconstrained], [plain[i] for i in unconstrained])
    for i, cs in enumerate(constraints):
        assert all(contains(h.tokens, seq) for h in mixed[i] for seq in cs)
        if cs:  # the constrained ones did change, and read their own rows' (forced) log-probs
            assert mixed[i][0].tokens != plain[i][0].tokens
            for h in mixed[i]:
                assert h.log_prob == pytest.approx(rescore(model, sources[i], h.tokens), abs=1e-3)


def test_a_constrained_input_decodes_the_same_alone_and_among_neighbours(model: Transformer) -> None:
    vocab = model.cfg.vocab_size
    sources = sources_of(vocab, [6, 3, 9, 5, 7], seed=9)
    options = DecodeOptions(beam_size=2, n_best=2, max_length_a=1.5, max_length_b=6)
    rng = random.Random(4)
    constraints = [random_constraints(rng, vocab, n) for n in (2, 0, 3, 1, 2)]
    alone = [run(model, [s], options, [c])[0] for s, c in zip(sources, constraints, strict=True)]
    for capacity in (32, 8):  # all at once; joining as others leave
        assert_same(run(model, sources, options, constraints, capacity=capacity), alone)


def test_a_forced_token_far_outside_the_top_k_gets_its_true_log_prob(model: Transformer) -> None:
    """The step's ``forced`` log-probs are log_softmax of the full logits, for the least likely
    tokens of each row (far outside its top 4), rows and widths varying."""
    step = DecodeStep(model, top=4)
    options = DecodeOptions()
    cache = KVCache(
        model.cfg,
        capacity=8,
        positions=options.positions(model.cfg.max_positions),
        dtype=model.dtype,
        device=model.device,
    )
    with torch.inference_mode():
        enc = model.encode(torch.tensor(sources_of(model.cfg.vocab_size, [5, 5, 5], seed=1)))
        cache.append(model.source_kv(enc), enc.src_mask)
        tokens = torch.full((3,), BOS_ID, dtype=torch.long)
        for width, beam_rows in ((1, [0]), (3, [0, 2]), (7, [2, 1, 0]), (2, [1])):
            logits, _ = model.step(tokens, *cache.views())
            lprobs = torch.log_softmax(logits.float(), dim=-1)[beam_rows]  # the reference
            forced = lprobs.argsort(dim=-1)[:, :width]  # the least likely first
            out = step(tokens, *cache.views(), torch.tensor(beam_rows), forced)
            assert (lprobs.gather(1, forced) < out[2][:, -1:]).all()  # none is in the top-k
            torch.testing.assert_close(out[5], lprobs.gather(1, forced), rtol=1e-5, atol=1e-5)
            cache.advance(out[4])
            tokens = out[0]


def test_a_constraint_that_cannot_fit_in_the_length_limit_does_not_hang(model: Transformer) -> None:
    """Limit 4 tokens (eos included): a 5-token constraint cannot be met, a 1-token one can. The
    input ends at its limit; its best hypothesis has met what fits."""
    options = DecodeOptions(beam_size=2, n_best=2, max_length_a=0.0, max_length_b=4)
    (src,) = sources_of(model.cfg.vocab_size, [5], seed=3)
    impossible = (tuple(range(10, 15)),)
    (hyps,) = run(model, [src], options, [impossible])
    assert hyps and all(len(h.tokens) + 1 <= 4 for h in hyps)
    (hyps,) = run(model, [src], options, [((20,), tuple(range(10, 15)))])
    assert 20 in hyps[0].tokens and [c for _, _, c in hyps[0].spans] == [0]


def test_a_beam_of_one_and_the_repetition_guard_still_meet_every_constraint(model: Transformer) -> None:
    """A source given a beam of 1 with constraints (a caller that did not apply ``beam_for``) and
    a search with the repetition guard: every constraint is still in the output (forced tokens
    are never banned), and the guarded output repeats no other bigram."""
    vocab = model.cfg.vocab_size
    sources = sources_of(vocab, [6, 4, 8], seed=14)
    options = DecodeOptions(beam_size=1, max_length_a=1.5, max_length_b=10)
    rng = random.Random(6)
    constraints = [random_constraints(rng, vocab, 2) for _ in sources]
    runner = load_runner(
        model, top=4, capacity=8, positions=options.positions(model.cfg.max_positions), compile=False
    )
    with torch.inference_mode():
        batch: RunningBatch[int] = RunningBatch(model, runner, capacity=8, options=options)
        batch.add(
            [Source(i, s, 1, 1, cs) for i, (s, cs) in enumerate(zip(sources, constraints, strict=True))]
        )
        done: dict[int, list[Hypothesis]] = {}
        while len(batch):
            done.update(batch.step())
    for i, cs in enumerate(constraints):
        assert all(contains(done[i][0].tokens, seq) for seq in cs), (done[i][0].tokens, cs)
    # A beam (beam_for: 5) larger than the step's top serves (2 per row: a Translator made for
    # greedy): its rows' candidates and the forced tokens are enough.
    many = [random_constraints(rng, vocab, 4) for _ in sources]
    for hyps, cs in zip(run(model, sources, options, many, top=2), many, strict=True):
        assert all(contains(hyps[0].tokens, seq) for seq in cs), (hyps[0].tokens, cs)
    repeated = tuple(rng.randrange(4, vocab) for _ in range(2))
    guarded = options.but(beam_size=2, no_repeat_ngram_size=2)
    for hyps in run(model, sources, guarded, [((repeated), repeated)] * len(sources)):
        tokens = hyps[0].tokens
        assert sum(tokens[j : j + 2] == list(repeated) for j in range(len(tokens) - 1)) >= 2
        others = [
            tuple(tokens[j : j + 2]) for j in range(len(tokens) - 1) if tuple(tokens[j : j + 2]) != repeated
        ]
        assert len(others) == len(set(others)), tokens


def test_a_hypothesis_does_not_end_as_soon_as_its_constraints_are_met() -> None:
    """A scripted decoder that copies its source (p .7), would rather say anything but eos before
    the copy is done (eos .001, the rest of the mass spread), and gives the constraint X .01: the
    best output with X is the whole copy with X in it, not a copy cut short once X is in (an
    eos ranked only among the few candidates of its bank would end it there)."""
    from test_search import ScriptedModel, V, as_model

    x = 15

    def copy_ignoring_x(source: list[int], out: list[int]) -> dict[int, float]:
        done = [t for t in out if t != x]
        if done == source[: len(done)]:
            nxt = source[len(done)] if len(done) < len(source) else EOS_ID
            return {nxt: 0.7, x: 0.01} if nxt == EOS_ID else {nxt: 0.7, x: 0.01, EOS_ID: 0.001}
        return {EOS_ID: 0.6}

    words = [[7, 8, 9, 10, 11], [12, 4], [5, 6, 7, 8, 9, 10, 11, 12]]
    model = ScriptedModel(copy_ignoring_x)
    for beam_size in (1, 3):
        options = DecodeOptions(beam_size=beam_size, max_length_a=2.0, max_length_b=4)
        runner = EagerRunner(DecodeStep(as_model(model), top=V))
        sources = [[*w, EOS_ID] for w in words]
        results = decode(as_model(model), runner, sources, options, capacity=64, constraints=[((x,),)] * 3)
        for w, hyps in zip(words, results, strict=True):
            assert x in hyps[0].tokens and [t for t in hyps[0].tokens if t != x] == w, hyps[0].tokens


def test_constraint_tokens_that_cannot_be_generated_are_refused(model: Transformer) -> None:
    """Before anything joins: a token outside the vocabulary would fail every row's step."""
    options = DecodeOptions(beam_size=2)
    runner = load_runner(
        model, top=4, capacity=8, positions=options.positions(model.cfg.max_positions), compile=False
    )
    batch: RunningBatch[int] = RunningBatch(model, runner, capacity=8, options=options)
    for bad in ((model.cfg.vocab_size,), (5, EOS_ID), (-1,)):
        with pytest.raises(ValueError, match="cannot be generated"):
            batch.add([Source(0, [5, EOS_ID], 2, 1, ((7,),)), Source(1, [6, EOS_ID], 2, 1, (bad,))])
        assert batch.rows == 0 and not len(batch)


# -- the compiled step ----------------------------------------------------------------------------


@torch.inference_mode()
def test_the_compiled_step_scores_and_chooses_as_the_eager_one(translator: Translator) -> None:
    """The AOT package (as test_runners compiles it: capacity 64, top 16) against the eager step:
    forced log-probs of any width to float rounding, and constrained decoding's tokens."""
    needs_cpu_package()
    model = translator.model
    options = DecodeOptions(beam_size=2, n_best=2)
    positions = options.positions(model.cfg.max_positions)

    def runner(compile: bool) -> Runner:
        return load_runner(
            model, top=16, capacity=64, positions=positions, compile=compile, cache_dir=compile_cache_dir()
        )

    compiled, eager = runner(True), runner(False)
    assert compiled.kind == "compiled"
    sources = sources_of(model.cfg.vocab_size, [7, 4, 11], seed=6)
    got: dict[str, list[torch.Tensor]] = {}
    for name, r in (("compiled", compiled), ("eager", eager)):
        cache = KVCache(
            model.cfg,
            capacity=64,
            positions=positions,
            dtype=model.dtype,
            device=model.device,
            align=r.align,
        )
        enc = model.encode(translator.batch(sources))
        cache.append(model.source_kv(enc), enc.src_mask)
        tokens = torch.full((3,), BOS_ID, dtype=torch.long)
        got[name] = []
        for width in (1, 5, 2, 40):
            forced = torch.arange(width).repeat(2, 1) * 3 % model.cfg.vocab_size  # (2, width)
            out = r(tokens, *cache.views(), torch.tensor([0, 2]), forced)
            cache.advance(out[4])
            got[name] += [out[0], out[1], out[5]]
            tokens = out[0]
    for i, (c, e) in enumerate(zip(got["compiled"], got["eager"], strict=True)):
        if c.dtype == torch.long:
            assert torch.equal(c, e), i
        else:
            torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-5)
    rng = random.Random(8)
    constraints = [random_constraints(rng, model.cfg.vocab_size, n) for n in (2, 1, 3)]
    a = run(model, sources, options, constraints, capacity=64, runner=compiled)
    b = run(model, sources, options, constraints, capacity=64, runner=eager)
    assert [[h.tokens for h in x] for x in a] == [[h.tokens for h in x] for x in b]
    assert all(contains(h.tokens, seq) for x, cs in zip(a, constraints, strict=True) for h in x for seq in cs)


# -- text -----------------------------------------------------------------------------------------


def test_decode_spans_renders_terms_exactly(tokenizer: Tokenizer) -> None:
    """A term with a character the vocabulary lacks comes out as given, with SentencePiece's
    spacing around it (a following piece that does not begin a word is glued to it); spans
    replaced by their own text give ``decode``."""
    before, term, after, glued = tokenizer.encode(["ein mann", "Ωmega straße", "spielt", "ein"])
    assert tokenizer.decode([term])[0] != "Ωmega straße"  # the vocabulary cannot spell it
    ids = before + term + after
    spans = [(len(before), len(before) + len(term), 0)]
    assert tokenizer.decode_spans(ids, spans, ["Ωmega straße"]) == "ein mann Ωmega straße spielt"
    text, offsets = tokenizer.decode_spans_with_offsets(term + after, [(0, len(term), 0)], ["Ωmega straße"])
    assert text == "Ωmega straße spielt" and offsets == [(0, 12, 0)]
    inner = next(i for i, p in enumerate(tokenizer.vocabulary()) if i > EOS_ID and p.isalpha())
    assert not tokenizer.pieces([inner])[0].startswith("\u2581")  # a piece inside a word: glued on
    assert (
        tokenizer.decode_spans(term + [inner], [(0, len(term), 0)], ["Ω"])
        == "Ω" + tokenizer.pieces([inner])[0]
    )
    rng = random.Random(2)
    for _ in range(50):
        ids = [rng.randrange(4, tokenizer.vocab_size) for _ in range(rng.randint(1, 15))]
        cut = sorted(rng.sample(range(len(ids) + 1), 2))
        if cut[0] == cut[1]:
            continue
        shown = tokenizer.decode([ids[cut[0] : cut[1]]])[0]
        if shown and tokenizer.pieces(ids[cut[0] : cut[0] + 1])[0].startswith("\u2581"):
            assert tokenizer.decode_spans(ids, [(cut[0], cut[1], 0)], [shown]) == tokenizer.decode([ids])[0]


def test_translator_terms(translator: Translator) -> None:
    """``translate_batch(terms=...)``: each term in every hypothesis, exactly, where its offsets
    say; blank terms ignored; texts without terms translated as without ``terms``; a greedy
    request decodes with ``beam_for``'s beam."""
    texts = ["Ein Mann spielt.", "Eine Katze", "Der Hund läuft im Wasser.", "Zwei Kinder"]
    terms = [["Ωmega", " "], [], ["big ball", "red"], []]
    for beam_size in (1, 3):
        plain = translator.translate_batch(texts, beam_size=beam_size)
        got = translator.translate_batch(texts, beam_size=beam_size, n_best=1, terms=terms)
        for i, (res, ts) in enumerate(zip(got, terms, strict=True)):
            wanted = [t.strip() for t in ts if t.strip()]
            if not wanted:
                assert (res.hypotheses, res.tokens, res.scores) == (
                    plain[i].hypotheses,
                    plain[i].tokens,
                    plain[i].scores,
                )
                assert res.spans == [[]]
                continue
            (text,), (offsets,) = res.hypotheses, res.spans
            assert sorted(term for _, _, term in offsets) == [j for j, t in enumerate(ts) if t.strip()]
            for start, end, term in offsets:
                assert text[start:end] == ts[term].strip()
    blank = translator.translate_batch(["  "], terms=[["x"]])
    assert blank[0].hypotheses == [""] and blank[0].spans == [[]]
    with pytest.raises(ValueError):
        translator.translate_batch(texts, terms=[["x"]])
