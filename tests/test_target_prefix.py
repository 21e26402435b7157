"""A forced output prefix (issue 46): an Argos package whose metadata.json has a ``target_prefix``
converts (the model directory's ``output_prefix``) and translates as CTranslate2's
``translate_batch(..., target_prefix=[[piece]])`` on the same weights, in float32; the served text
never shows the piece (as Argos strips it); prefixed and plain inputs share a running batch; the
device search (``model.decoding.device_search``) gives ``Beam``'s results.

The package is made here, offline: tests/test_convert_argos.py's tiny Marian model (trained a few
seconds on Multi30k), on a SentencePiece model that also holds two language tokens, converted by
CTranslate2's own converter and zipped with ``target_prefix`` "__en__". The scripted decoder of
tests/test_search.py checks the search's rules exactly, whatever rows share a step.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from test_device_search import Plan, assert_identical, reference, run_plan
from test_search import ScriptedModel, V, as_model, hashed

from app.models.served import ServedModel
from app.serving.protocol import ModelDescription, Sentence, SentenceResult
from app.serving.worker.executor import Executor
from app.serving.worker.inbox import Inbox
from app.serving.worker.models import ModelTable
from model.checkpoint import read_info_and_tokenizer
from model.convert.argos import convert
from model.convert.errors import ConversionError
from model.decoding.batch import RunningBatch, Source
from model.decoding.options import DecodeOptions, ctranslate2_options
from model.decoding.search import Hypothesis
from model.decoding.translator import Translator
from model.runtime.runners import EagerRunner
from model.runtime.step import DecodeStep
from model.tokenizer import EOS_ID
from tests.test_convert_argos import convert_ct2, make_marian, multi30k, pack, read_gz, train_joint_spm

ctranslate2 = pytest.importorskip("ctranslate2")
spm = pytest.importorskip("sentencepiece")

PREFIX = "__en__"  # the package's target_prefix: a language token, as multilingual Argos models have
N_SENTENCES = 16
LIMIT = 40  # output tokens, eos included (CTranslate2's max_decoding_length: 39)


def options(beam_size: int, n_best: int = 1) -> DecodeOptions:
    return DecodeOptions(
        beam_size=beam_size, n_best=n_best, max_length_a=0, max_length_b=LIMIT, max_output_tokens=LIMIT
    )


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The SentencePiece model, CTranslate2's conversion of the Marian model, the package with a
    target_prefix and our conversion of it, the test sentences."""
    root = tmp_path_factory.mktemp("prefix")
    spm_model = train_joint_spm(root, symbols=(PREFIX, "__de__"))  # two language tokens
    hf = make_marian(root / "hf", spm_model, target_prefix=PREFIX)  # trained to follow the prefix
    ct2 = convert_ct2(hf, root / "ct2", "float32")
    package = pack(ct2, spm_model, root / "en.argosmodel", target_prefix=PREFIX)
    ours = convert(package, root / "ours", command="pytest")
    sentences = read_gz(multi30k() / "test_2016_flickr.de.gz", N_SENTENCES)
    return {"root": root, "spm": spm_model, "ct2": ct2, "ours": ours, "sentences": sentences}


def ctranslate2_outputs(
    work: dict[str, Any], translator: Translator, sources: list[list[int]], chosen: DecodeOptions, **kw: Any
) -> list[Any]:
    """CTranslate2's results for our source ids (eos included, as its Marian model reads them),
    with the package's target_prefix, as Argos asks for them."""
    pieces = [translator.tokenizer.pieces(ids, source=True) for ids in sources]
    engine = ctranslate2.Translator(str(work["ct2"]), device="cpu", compute_type="float32", intra_threads=1)
    asked = {**ctranslate2_options(chosen), **kw}
    return list(engine.translate_batch(pieces, target_prefix=[[PREFIX]] * len(pieces), **asked))


def as_ids(translator: Translator, pieces: list[str]) -> list[int]:
    index = {p: i for i, p in enumerate(translator.tokenizer.vocabulary())}
    return [index[p] for p in pieces]


def assert_as_ctranslate2(mine: list[list[int]], theirs: list[list[int]], beam_size: int) -> None:
    """Our best hypotheses are CTranslate2's. With beams, only those CTranslate2 ends before the
    length limit are compared (most of them): at the limit it ranks its beams without eos and
    we with it (as without a prefix: tests/test_convert_marian.py compares beams on outputs that
    end by themselves)."""
    assert len(mine) == len(theirs)
    ended = [i for i, t in enumerate(theirs) if beam_size == 1 or len(t) < LIMIT - 1]
    assert len(ended) >= 0.75 * len(theirs)
    assert [mine[i] for i in ended] == [theirs[i] for i in ended]


# -- conversion ------------------------------------------------------------------------------------


def test_a_package_with_a_target_prefix_converts(work: dict[str, Any]) -> None:
    ours = work["ours"]
    info, tokenizer = read_info_and_tokenizer(ours)
    prefix_id = tokenizer.vocabulary().index(PREFIX)
    cfg = json.loads((ours / "config.json").read_text())
    assert cfg["output_prefix"] == info.output_prefix == [prefix_id]
    assert (cfg["source_lang"], cfg["target_lang"], cfg["format"]) == ("de", "en", 1)
    assert PREFIX in (ours / "README.md").read_text()
    assert tokenizer.decode([[prefix_id]]) == [""]  # never shown


@pytest.mark.parametrize(
    ("prefix", "message"),
    [
        ("__fr__", "not a piece of the model's target vocabulary"),
        ("</s>", "not word ids"),
        (7, "not a piece"),
    ],
)
def test_a_target_prefix_that_cannot_be_forced_is_refused(
    work: dict[str, Any], tmp_path: Path, prefix: Any, message: str
) -> None:
    package = pack(work["ct2"], work["spm"], tmp_path / "bad.argosmodel", target_prefix=prefix)
    with pytest.raises(ConversionError, match="bad.argosmodel") as e:
        convert(package, tmp_path / "out")
    assert message in str(e.value) and "target_prefix" in str(e.value)
    assert not (tmp_path / "out").exists()


def test_an_empty_target_prefix_forces_nothing(work: dict[str, Any], tmp_path: Path) -> None:
    package = pack(work["ct2"], work["spm"], tmp_path / "empty.argosmodel", target_prefix="")
    ours = convert(package, tmp_path / "out")
    assert "output_prefix" not in json.loads((ours / "config.json").read_text())


# -- the same outputs as CTranslate2 ----------------------------------------------------------------


@pytest.mark.parametrize("beam_size", [1, 4])
def test_outputs_are_ctranslate2s_with_target_prefix(work: dict[str, Any], beam_size: int) -> None:
    """Greedy and beam 4, float32: the tokens CTranslate2 returns (the prefix first) exactly (with
    beams, the outputs that end before the limit: ``assert_as_ctranslate2``)."""
    chosen = options(beam_size)
    tr = Translator.load(work["ours"], device="cpu", prepack=False, options=chosen)
    sources = tr.source_ids(work["sentences"])
    theirs = ctranslate2_outputs(work, tr, sources, chosen)
    expected = [as_ids(tr, r.hypotheses[0]) for r in theirs]
    mine = [nbest[0].tokens for nbest in tr.generate(sources)]
    assert_as_ctranslate2(mine, expected, beam_size)
    assert all(t[0] == tr.info.output_prefix[0] for t in mine)
    assert sum(len(t) for t in mine) > 4 * len(mine)  # real outputs, not the prefix alone


def test_greedy_log_probs_leave_the_prefix_out(work: dict[str, Any]) -> None:
    """CTranslate2 scores the forced tokens 0 (their log-prob is not counted): so do we. Its scores
    without length normalization are the hypotheses' log-probs, eos included, for the outputs that
    end before the limit (at the limit it ends them without eos, we with it)."""
    chosen = options(1)
    tr = Translator.load(work["ours"], device="cpu", prepack=False, options=chosen)
    sources = tr.source_ids(work["sentences"])
    theirs = ctranslate2_outputs(work, tr, sources, chosen, return_scores=True, length_penalty=0.0)
    mine = tr.generate(sources)
    ended = 0
    for nbest, r in zip(mine, theirs, strict=True):
        assert nbest[0].tokens == as_ids(tr, r.hypotheses[0])
        if len(r.hypotheses[0]) < LIMIT - 1:
            assert nbest[0].log_prob == pytest.approx(r.scores[0], abs=1e-4)
            ended += 1
    assert ended >= len(mine) // 2


def test_the_served_text_has_no_prefix(work: dict[str, Any]) -> None:
    """Through a worker's executor and the front end's detokenization: the text Argos shows
    (CTranslate2's tokens, the prefix piece dropped, SentencePiece's decoding), never the piece.
    (Argos drops the first piece only; we never show the piece, wherever a model puts it.)"""
    chosen = options(1)
    tr = Translator.load(work["ours"], device="cpu", prepack=False, options=chosen)
    sources = tr.source_ids(work["sentences"])
    inbox = Inbox()
    executor = Executor(ModelTable.single(tr, "m"), inbox)
    inbox.add([Sentence(i, i, src, 1, 1, None, time.monotonic(), "m") for i, src in enumerate(sources)])
    results: dict[int, SentenceResult] = {}
    with torch.inference_mode():
        for _ in range(5000):
            if not (inbox.waiting or executor.busy):
                break
            for done, outcome in executor.iteration():
                assert inbox.release(done) and not isinstance(outcome, BaseException), outcome
                results[done.id] = outcome
    info, tokenizer = ServedModel.open(work["ours"])
    served = ServedModel("m", info, tokenizer, ModelDescription("cpu", "float32", "none"))
    texts = [t[0] for t in served.texts([results[i] for i in range(len(sources))])]
    theirs = ctranslate2_outputs(work, tr, sources, chosen)
    sp = spm.SentencePieceProcessor(model_file=str(work["spm"]))
    argos = []
    for r in theirs:
        pieces = r.hypotheses[0]
        assert pieces[0] == PREFIX
        # argos-translate's remove_target_prefix, then SentencePiece (an unknown piece aside: Argos
        # puts a source token there, replace_unknowns; we show nothing).
        argos.append(sp.decode([p for p in pieces[1:] if p not in ("<unk>", PREFIX)]).strip())
    assert [results[i].hypotheses[0].tokens for i in range(len(sources))] == [
        as_ids(tr, r.hypotheses[0]) for r in theirs
    ]
    assert texts == argos
    assert not any(PREFIX in t for t in texts) and sum(map(bool, texts)) >= len(texts) // 2


# -- the running batch: prefixed and plain inputs together, Beam's path and the device's ------------


def batch_results(
    tr: Translator, chosen: DecodeOptions, plan: list[tuple[int, Source[int]]], *, device_search: bool
) -> dict[int, list[Hypothesis]]:
    """Decode ``plan`` ((step to join at, source)) in one running batch."""
    batch: RunningBatch[int] = RunningBatch(
        tr.model, tr.runner, capacity=64, options=chosen, device_search=device_search, sync_every=3
    )
    waiting, step = sorted(plan, key=lambda p: p[0]), 0
    done: dict[int, list[Hypothesis]] = {}
    with torch.inference_mode():
        while waiting or len(batch):
            joining = [s for at, s in waiting if at <= step]
            waiting = [(at, s) for at, s in waiting if at > step]
            batch.add(joining)
            for key, hyps in batch.step():
                done[key] = hyps
            step += 1
            assert step < 1000
    return done


@pytest.mark.parametrize("device_search", [False, True])
@pytest.mark.parametrize("beam_size", [1, 3])
def test_prefixed_and_plain_inputs_in_one_batch_get_what_they_get_alone(
    work: dict[str, Any], beam_size: int, device_search: bool
) -> None:
    """Inputs with a prefix and without, joining at several steps, on the device search or
    Beam's: each gets what it gets alone on Beam's path. (The prefix here is "__de__", which the
    model never puts first by itself: it puts "__en__" there.)"""
    chosen = options(beam_size, n_best=min(2, beam_size))
    tr = Translator.load(work["ours"], device="cpu", prepack=False, options=chosen)
    sources = tr.source_ids(work["sentences"][:8])
    prefix = (tr.tokenizer.vocabulary().index("__de__"),)
    inputs = [
        Source(i, ids, beam_size, chosen.n_best, (), prefix if i % 2 else ()) for i, ids in enumerate(sources)
    ]
    alone = {s.key: batch_results(tr, chosen, [(0, s)], device_search=False)[s.key] for s in inputs}
    together = batch_results(
        tr, chosen, [(i // 3 * 2, s) for i, s in enumerate(inputs)], device_search=device_search
    )
    for s in inputs:
        assert [h.tokens for h in together[s.key]] == [h.tokens for h in alone[s.key]], s.key
        for a, b in zip(together[s.key], alone[s.key], strict=True):
            assert a.log_prob == pytest.approx(b.log_prob, abs=1e-4)
        starts = [h.tokens[: len(prefix)] == list(prefix) for h in together[s.key]]
        assert starts == [bool(s.prefix)] * len(starts), s.key


@pytest.mark.parametrize("sync_every", [1, 4])
@pytest.mark.parametrize("greedy_scores", [True, False])
def test_scripted_prefixes_on_the_device_equal_beams_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch, sync_every: int, greedy_scores: bool
) -> None:
    """A decoder whose log-probs do not depend on the batch: prefixes of 0 to 3 tokens, beams of 1
    to 5, inputs joining at several steps, some whose length limit cuts the prefix: the device
    search gives Beam's hypotheses, tokens, scores and log-probs, bit for bit, and every hypothesis
    starts with its input's prefix (as much of it as the limit lets in)."""
    rng = random.Random(sync_every)
    plan: Plan = []
    prefixes: dict[int, tuple[int, ...]] = {}
    key = 0
    for at in (0, 1, 3, 6):
        group = []
        for _ in range(4):
            k = rng.randint(1, 5)
            words = [rng.randrange(4, V) for _ in range(rng.randint(1, 5))]
            prefixes[key] = tuple(rng.randrange(4, V) for _ in range(rng.randint(0, 3)))
            group.append(Source(key, [*words, EOS_ID], k, rng.randint(1, k), (), prefixes[key]))
            key += 1
        plan.append((at, group))
    chosen = DecodeOptions(beam_size=5, length_penalty=0.8, max_length_a=0.5, max_length_b=2)
    model = as_model(ScriptedModel(hashed))
    runner = EagerRunner(DecodeStep(model, top=10))
    got = run_plan(model, runner, plan, chosen, sync_every=sync_every, greedy_scores=greedy_scores).results
    want = reference(monkeypatch, model, runner, plan, chosen, greedy_scores=greedy_scores)
    assert_identical(got, want)
    lengths = {s.key: len(s.ids) for _, group in plan for s in group}
    cut = 0
    for k, hyps in want.items():
        wanted = prefixes[k][: chosen.output_limit(lengths[k], 64) - 1]
        cut += len(wanted) < len(prefixes[k])
        assert all(tuple(h.tokens[: len(wanted)]) == wanted for h in hyps), k
    assert cut  # some limits cut a prefix


def ends_after_prefix(source: list[int], out: list[int]) -> dict[int, float]:
    """After the prefix [4], eos is the second likeliest token (the first for a source [5])."""
    if out == [4]:
        return {EOS_ID: 0.6, 6: 0.3} if source == [5] else {6: 0.5, EOS_ID: 0.3, 7: 0.1}
    return {EOS_ID: 0.9}


@pytest.mark.parametrize("device_search", [False, True])
def test_eos_below_the_best_cannot_end_a_beam_right_after_the_prefix(
    monkeypatch: pytest.MonkeyPatch, device_search: bool
) -> None:
    """CTranslate2's rule (``model.decoding.prefix.drop_secondary_eos``): with beams, at the first
    step after the prefix only the best candidate may be eos; a lower one takes a dead beam's
    slot. Without the rule the prefix alone ([4], eos second) would be a finished hypothesis. The
    best may end (source [5])."""
    model = as_model(ScriptedModel(ends_after_prefix))
    runner = EagerRunner(DecodeStep(model, top=10))
    chosen = DecodeOptions(beam_size=2, n_best=2, max_length_a=0, max_length_b=6)
    plan: Plan = [(0, [Source(0, [4, EOS_ID], 2, 2, (), (4,)), Source(1, [5, EOS_ID], 2, 1, (), (4,))])]
    with monkeypatch.context() as m:
        if not device_search:
            m.setattr("model.decoding.search.Search.on_device", lambda self, constraints: False)
        found = run_plan(model, runner, plan, chosen, sync_every=1).results
    assert [h.tokens for h in found[0]][0] == [4, 6]
    assert [4] not in [h.tokens for h in found[0]]
    assert [h.tokens for h in found[1]] == [[4]]  # the best candidate is eos: the prefix alone


def test_a_constrained_input_starts_with_its_prefix() -> None:
    """Terms and a prefix together (Beam's path, the constrained search): the prefix first, then
    the term, its span counted in the output's tokens (the prefix's included)."""
    model = as_model(ScriptedModel(hashed))
    runner = EagerRunner(DecodeStep(model, top=10))
    chosen = DecodeOptions(beam_size=3, max_length_a=0, max_length_b=10)
    plan: Plan = [(0, [Source(0, [5, 6, EOS_ID], 3, 1, ((9, 10),), (4, 8))])]
    [best] = run_plan(model, runner, plan, chosen, sync_every=1).results[0]
    assert best.tokens[:2] == [4, 8]
    [(start, end, term)] = best.spans
    assert best.tokens[start:end] == [9, 10] and start >= 2 and term == 0
