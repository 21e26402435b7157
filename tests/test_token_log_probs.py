"""Every returned hypothesis carries the log-prob the search gave each of its tokens
(``Hypothesis.token_log_probs``), and they are the model's: a teacher-forced forward pass of the
shipped model over the chosen tokens (``Transformer.forward``, the training path, not the cached
step) gives the same values, greedy and beam, on the host's ``Beam`` and the device search, with
constraints, in float32 and int8; a sentence gets the same values alone as batched (under the
compiled step, as deployed: the eager float32 step's matrix products round differently with the
number of rows, ~1e-7, as ``tests/test_determinism.py`` says of its tokens)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from benchmarks.common import DEFAULT_MODEL
from model.decoding.batch import RunningBatch, Source, pad_batch
from model.decoding.hypothesis import Hypothesis
from model.translator import Translator
from tests.conftest import compile_cache_dir

SENTENCES = [
    "Ein Mann fährt Fahrrad.",
    "Zwei Hunde spielen im Schnee mit einem roten Ball.",
    "Ein Kind lacht.",
    "Eine Frau in einem blauen Kleid steht vor einem Gebäude und wartet auf den Bus.",
    "Leute.",
]
# Float rounding only: the cached step and the full forward pass sum in different orders
# (measured: at most 2e-6 in float32). In int8 each activation row is quantized on its own, and that
# rounding can move a value of the full pass across an int8 step: up to 4e-3 measured (a runner-up
# hypothesis of the longest sentence here; its best hypothesis's values within 2e-6).
TOLERANCE = {"none": 1e-4, "int8": 1e-2}


@pytest.fixture(scope="module", params=["none", "int8"])
def translator(request: pytest.FixtureRequest) -> Translator:
    return Translator.load(DEFAULT_MODEL, device="cpu", quantization=request.param)


@pytest.fixture(scope="module", params=["none", "int8"])
def compiled(request: pytest.FixtureRequest) -> Translator:
    t = Translator.load(
        DEFAULT_MODEL, device="cpu", quantization=request.param, compile=True, cache_dir=compile_cache_dir()
    )
    assert t.runner.kind == "compiled"
    return t


def teacher_forced(t: Translator, source: Sequence[int], hyp: Hypothesis) -> list[float]:
    """The model's log-prob of each of ``hyp``'s tokens then eos, from one forward pass."""
    cfg = t.model.cfg
    target = [*hyp.tokens, cfg.eos_id]
    with torch.inference_mode():
        logits = t.model(pad_batch([source], cfg.pad_id, t.device), torch.tensor([[cfg.bos_id, *hyp.tokens]]))
        lprobs = logits.float().log_softmax(-1)[0]
    return lprobs.gather(1, torch.tensor(target)[:, None])[:, 0].tolist()


def assert_model_log_probs(t: Translator, sources: list[list[int]], nbests: list[list[Hypothesis]]) -> None:
    for source, nbest in zip(sources, nbests, strict=True):
        assert nbest
        for hyp in nbest:
            assert len(hyp.token_log_probs) == len(hyp.tokens) + 1  # eos's last
            tolerance = TOLERANCE[t.quantization]
            assert hyp.token_log_probs == pytest.approx(teacher_forced(t, source, hyp), abs=tolerance)
            assert sum(hyp.token_log_probs) == pytest.approx(hyp.log_prob, abs=1e-4)


def run_batch(
    t: Translator,
    sources: list[list[int]],
    *,
    beam: int,
    n_best: int = 1,
    device_search: bool = False,
    greedy_scores: bool = True,
    scored: bool = False,
    constraints: Sequence[tuple[tuple[int, ...], ...]] | None = None,
) -> list[list[Hypothesis]]:
    """Every source decoded together in one running batch, as the service's executor runs them."""
    batch: RunningBatch[int] = RunningBatch(
        t.model,
        t.runner,
        capacity=64,
        options=t.options.but(beam_size=beam, n_best=n_best),
        greedy_scores=greedy_scores,
        device_search=device_search,
        word_continuations=t.tokenizer.word_continuations() if constraints else frozenset(),
    )
    cs = constraints or [()] * len(sources)
    batch.add(
        [
            Source(i, s, beam, n_best, c, scored=scored)
            for i, (s, c) in enumerate(zip(sources, cs, strict=True))
        ]
    )
    results: dict[int, list[Hypothesis]] = {}
    while len(batch):
        results.update(batch.step())
    return [results[i] for i in range(len(sources))]


@pytest.mark.parametrize("device_search", [False, True], ids=["host", "device"])
@pytest.mark.parametrize("beam", [1, 4])
def test_token_log_probs_match_a_teacher_forced_pass(
    translator: Translator, beam: int, device_search: bool
) -> None:
    sources = translator.source_ids(SENTENCES)
    nbests = run_batch(translator, sources, beam=beam, n_best=min(beam, 3), device_search=device_search)
    assert_model_log_probs(translator, sources, nbests)


@pytest.mark.parametrize("device_search", [False, True], ids=["host", "device"])
@pytest.mark.parametrize("beam", [1, 4])
def test_token_log_probs_are_the_same_alone_and_batched(
    compiled: Translator, beam: int, device_search: bool
) -> None:
    sources = compiled.source_ids(SENTENCES)
    together = run_batch(compiled, sources, beam=beam, device_search=device_search)
    for source, batched in zip(sources, together, strict=True):
        (alone,) = run_batch(compiled, [source], beam=beam, device_search=device_search)
        assert alone[0].tokens == batched[0].tokens
        assert alone[0].token_log_probs == batched[0].token_log_probs  # bit for bit


@pytest.mark.parametrize("device_search", [False, True], ids=["host", "device"])
def test_unscored_greedy_rows_keep_log_probs_only_for_sources_that_ask(
    translator: Translator, device_search: bool
) -> None:
    """The service's greedy rows are unscored (no candidates asked of the step); a sentence that
    asks for log-probs (``Source.scored``) gets the scored search's values and tokens, the others
    none, in one batch."""
    sources = translator.source_ids(SENTENCES)
    reference = run_batch(translator, sources, beam=1, device_search=device_search)
    batch: RunningBatch[int] = RunningBatch(
        translator.model,
        translator.runner,
        capacity=64,
        options=translator.options.but(beam_size=1),
        greedy_scores=False,
        device_search=device_search,
    )
    batch.add([Source(i, s, 1, 1, scored=i % 2 == 0) for i, s in enumerate(sources)])
    results: dict[int, list[Hypothesis]] = {}
    while len(batch):
        results.update(batch.step())
    for i, ref in enumerate(reference):
        (hyp,) = results[i]
        assert hyp.tokens == ref[0].tokens
        if i % 2 == 0:
            assert hyp.token_log_probs == ref[0].token_log_probs
        else:
            assert hyp.token_log_probs == () and hyp.log_prob == 0.0


def test_constrained_hypotheses_carry_the_model_log_probs_of_forced_tokens(translator: Translator) -> None:
    """With constraints (the host's ``Beam``, dynamic beam allocation): the forced tokens' values
    are the model's log-probs of them too, however badly they rank."""
    sources = translator.source_ids(SENTENCES[:3])
    terms = ["bicycle", "puppies", "giggles"]
    encoded = translator.tokenizer.encode(terms, target=True)
    constraints = [(tuple(ids),) for ids in encoded]
    nbests = run_batch(translator, sources, beam=4, n_best=2, constraints=constraints)
    for nbest in nbests:
        assert all(h.spans for h in nbest)  # the terms were placed
    assert_model_log_probs(translator, sources, nbests)
