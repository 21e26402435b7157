"""The quality rules of lexically constrained decoding (``model.decoding.constraints``, ``Beam``):
no word piece glued onto a met constraint, and a constrained input that does not stop while a live
hypothesis could still beat the best finished one.

Scripted decoders (``test_search.ScriptedModel``) give cases with a known answer, each one that
the rule's absence gets wrong (checked in the same test, where the rule can be switched off).
"""

from __future__ import annotations

import math
import random

import torch
from conftest import random_model
from test_constraints import random_constraints, run, sources_of
from test_search import ScriptedModel, as_model

from model.decoding.batch import decode
from model.decoding.beam import Beam, length_normalized
from model.decoding.constraints import ConstraintSet
from model.decoding.options import DecodeOptions
from model.decoding.search import Hypothesis
from model.runtime.runners import EagerRunner, load_runner
from model.runtime.step import DecodeStep
from model.tokenizer import EOS_ID, Tokenizer

V = 16  # test_search's scripted vocabulary
X, GLUE = 15, 14  # a constraint, and a piece that continues a word


def scripted(
    rule: ScriptedModel, words: list[list[int]], options: DecodeOptions, **kw: object
) -> list[list[Hypothesis]]:
    runner = EagerRunner(DecodeStep(as_model(rule), top=V))
    sources = [[*w, EOS_ID] for w in words]
    return decode(as_model(rule), runner, sources, options, capacity=64, **kw)  # type: ignore[arg-type]


def test_word_continuations_are_the_pieces_inside_a_word(tokenizer: Tokenizer) -> None:
    glue = tokenizer.word_continuations()
    pieces = tokenizer.vocabulary()
    assert glue and all(not pieces[i].startswith("\u2581") and pieces[i][:1].isalnum() for i in glue)
    for i, p in enumerate(pieces):
        if i > EOS_ID and not p.startswith("\u2581") and p[:1].isalnum():
            assert i in glue, p
    assert not glue & set(tokenizer.encode([".", ",", "ein Mann"])[2][:1])  # a word's first piece


def test_a_met_constraint_is_never_followed_by_a_word_continuation() -> None:
    """A decoder that copies its source and, right after X, would continue X's word (GLUE, p .9):
    with GLUE among the word continuations no hypothesis has it right after X; without, the best
    one does (so the rule, not the decoder, keeps it out)."""

    def copy_and_glue(source: list[int], out: list[int]) -> dict[int, float]:
        if out and out[-1] == X:
            return {GLUE: 0.9}
        done = [t for t in out if t not in (X, GLUE)]
        if done == source[: len(done)]:
            nxt = source[len(done)] if len(done) < len(source) else EOS_ID
            return {nxt: 0.7, X: 0.01} if nxt == EOS_ID else {nxt: 0.7, X: 0.01, EOS_ID: 0.001}
        return {EOS_ID: 0.6}

    words = [[7, 8, 9, 10], [12, 4], [5, 6, 7, 8, 9]]
    for beam_size in (1, 3):
        options = DecodeOptions(beam_size=beam_size, n_best=beam_size, max_length_a=2.0, max_length_b=4)
        glued = scripted(ScriptedModel(copy_and_glue), words, options, constraints=[((X,),)] * 3)
        assert all(h[0].tokens[h[0].spans[0][1]] == GLUE for h in glued)  # what the decoder wants
        kept = scripted(
            ScriptedModel(copy_and_glue),
            words,
            options,
            constraints=[((X,),)] * 3,
            word_continuations=frozenset({GLUE}),
        )
        for hyps in kept:
            assert hyps
            for h in hyps:
                assert X in h.tokens and all(h.tokens[end : end + 1] != [GLUE] for _, end, _ in h.spans)


def test_no_span_of_a_real_model_is_followed_by_a_word_continuation() -> None:
    """A random model, random multi-token constraints, half the vocabulary word continuations."""
    model = random_model(seed=3, sharpen=2.0, eos_boost=1.5, share_embeddings=False, tie_output=False)
    vocab = model.cfg.vocab_size
    rng = random.Random(5)
    glue = frozenset(rng.sample(range(4, vocab), vocab // 2))
    sources = sources_of(vocab, [5, 8, 3, 6], seed=7)
    constraints = [random_constraints(rng, vocab, n) for n in (1, 2, 3, 2)]
    options = DecodeOptions(beam_size=3, n_best=3, max_length_a=1.5, max_length_b=8)
    with torch.inference_mode():
        runner = load_runner(model, top=16, capacity=32, positions=options.positions(model.cfg.max_positions))
        results = decode(
            model, runner, sources, options, capacity=32, constraints=constraints, word_continuations=glue
        )
    plain = run(model, sources, options, constraints)
    assert any(
        h.tokens[end : end + 1] and h.tokens[end] in glue for hs in plain for h in hs for _, end, _ in h.spans
    )
    for hyps, cs in zip(results, constraints, strict=True):
        for h in hyps:
            assert len(h.spans) == len(cs)
            assert all(not (h.tokens[end : end + 1] and h.tokens[end] in glue) for _, end, _ in h.spans)


def test_a_constrained_input_goes_on_while_a_live_hypothesis_beats_the_best_finished() -> None:
    """X forced early ends at once (eos .5 after it), before the copy is done; the model puts X at
    the end of the copy (.6). The hypotheses that forced X early finish first, K of them within
    two steps; the copy with X at the end, live meanwhile with a far better normalized score,
    is the better translation and must be found."""

    def x_at_the_end(source: list[int], out: list[int]) -> dict[int, float]:
        done = [t for t in out if t != X]
        if done != source[: len(done)]:
            return {EOS_ID: 0.6}
        if len(done) < len(source):
            return {source[len(done)]: 0.4, EOS_ID: 0.5} if X in out else {source[len(done)]: 0.7, X: 0.001}
        return {EOS_ID: 0.9} if X in out else {X: 0.6, EOS_ID: 0.3}

    words = [[7, 8, 9, 10, 11], [12, 4, 5, 6]]
    for beam_size in (1, 2, 4):
        options = DecodeOptions(beam_size=beam_size, max_length_a=2.0, max_length_b=4)
        results = scripted(ScriptedModel(x_at_the_end), words, options, constraints=[((X,),)] * 2)
        for w, hyps in zip(words, results, strict=True):
            assert hyps[0].tokens == [*w, X], (beam_size, hyps[0].tokens)
            want = len(w) * math.log(0.7) + math.log(0.6) + math.log(0.9)
            assert math.isclose(hyps[0].log_prob, want, abs_tol=1e-4)


def test_the_stopping_rule_compares_normalized_scores() -> None:
    """One step of ``advance_constrained`` with a finished hypothesis of normalized score -1.0:
    the input goes on while a live beam's score over its length (eos to come) reaches it, and
    stops once none does, however few hypotheses have finished."""
    cs = ConstraintSet([(9,)])
    met = cs.advance(cs.start(), 9, 0)

    def after_one_step(live_score: float) -> bool:
        beam = Beam.start(2, limit=50, constraints=cs)
        beam.history, beam.scores, beam.states = [[9], [9]], [-0.5, -math.inf], [met, met]
        beam.finished = [Hypothesis([9, 4], -1.0, -3.0, ((0, 1, 0),))]
        top = [[(live_score + 0.5, 5), (-9.0, 6)], [(-9.0, 5), (-9.5, 6)]]
        beam.advance_constrained([(live_score, 5, 0)], top, [[], []], [-20.0, -20.0], EOS_ID, 1.0)
        return beam.done

    # A continuation [9, 5] would end with 3 tokens: normalized score live_score / 3.
    assert not after_one_step(-2.9)  # -0.97 >= -1.0: it may still win
    assert after_one_step(-3.1)  # -1.03 < -1.0: none can (in the rule's estimate)
    assert length_normalized(-2.9, 3, 1.0) > -1.0 > length_normalized(-3.1, 3, 1.0)
