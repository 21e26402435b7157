"""The search state on the device (``model.decoding.device_search``, issue 45): a running batch of
inputs without constraints reads nothing back from the device between its reads of which inputs
finished (every ``sync_every`` steps), and every input gets exactly the hypotheses of the host path
(``Beam``, ``Search.step``: the path constrained inputs keep), bit for bit.

On the CPU there is no device to wait for, so reads are counted as calls: every tensor-to-Python
conversion (``tolist``, ``item``, ``cpu``, ``numpy``, ``bool``/``int``/``float``/``index``) of a
non-empty tensor, and every ``aten._local_scalar_dense`` or ``aten.item`` (what a scalar read
dispatches to)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from test_search import ScriptedModel, as_model, hashed
from torch.utils._python_dispatch import TorchDispatchMode

from model import cache as model_cache
from model.decoding.batch import RunningBatch, Source
from model.decoding.options import DecodeOptions
from model.decoding.search import Hypothesis, Search
from model.runtime.runners import EagerRunner, load_runner
from model.runtime.step import DecodeStep
from model.tokenizer import EOS_ID
from model.transformer import Transformer

READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


class _ScalarReads(TorchDispatchMode):
    def __init__(self, counter: ReadCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # (Under inference mode a scalar read dispatches as ``item``, not further.)
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default):
            self.counter.reads.append(str(func))
        return func(*args, **(kwargs or {}))


class ReadCounter:
    """Counts device-to-host reads while active: ``with counter:`` starts a fresh ``reads`` list of
    what the block read (the tensor methods are patched once, for the test)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reads: list[str] = []
        self.active = False
        for name in READS:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))

    def _wrap(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self.active and tensor.numel() > 0:
                self.reads.append(name)
            return method(tensor, *args, **kwargs)

        return counted

    def __enter__(self) -> ReadCounter:
        self.reads = []
        self._mode = _ScalarReads(self)
        self._mode.__enter__()
        self.active = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.active = False
        self._mode.__exit__(*exc)


# A plan: (the step at which they join, the inputs that join then).
Plan = list[tuple[int, list[Source[int]]]]


@dataclass
class Run:
    results: dict[int, list[Hypothesis]]  # each input's n-best
    reads: list[int]  # reads made by each step (with a counter)
    synced: list[int]  # the steps at which the batch read which inputs finished

    @property
    def steps(self) -> int:
        return len(self.reads)


def run_plan(
    model: Any,
    runner: Any,
    plan: Plan,
    options: DecodeOptions,
    *,
    sync_every: int,
    greedy_scores: bool = True,
    counter: ReadCounter | None = None,
) -> Run:
    """Decode ``plan`` in one running batch (the inputs join before the steps their plan says)."""
    capacity = sum(s.beam_size for _, group in plan for s in group)
    batch: RunningBatch[int] = RunningBatch(
        model,
        runner,
        capacity=capacity,
        options=options,
        greedy_scores=greedy_scores,
        sync_every=sync_every,
        device_search=True,  # (on the CPU the default is Beam's path: the device path is tested here)
    )
    waiting = sorted(plan, key=lambda p: p[0])
    run = Run({}, [], [])
    while waiting or len(batch):
        while waiting and waiting[0][0] <= run.steps:
            batch.add(waiting.pop(0)[1])
        if counter is None:
            finished = batch.step()
        else:
            with counter:
                finished = batch.step()
        if batch.steps_since_read == 0:
            run.synced.append(run.steps)
        run.reads.append(len(counter.reads) if counter is not None else 0)
        for key, hyps in finished:
            assert key not in run.results
            run.results[key] = hyps
        assert run.steps < 1000
    return run


def reference(
    monkeypatch: pytest.MonkeyPatch, model: Any, runner: Any, plan: Plan, options: DecodeOptions, **kw: Any
) -> dict[int, list[Hypothesis]]:
    """The host path for every input: ``Beam`` and ``Search.step``, a read per step (what every
    input took before the search moved to the device; constrained inputs still do)."""
    with monkeypatch.context() as m:
        m.setattr(Search, "on_device", lambda self, constraints: False)
        return run_plan(model, runner, plan, options, sync_every=1, **kw).results


def assert_identical(got: dict[int, list[Hypothesis]], want: dict[int, list[Hypothesis]]) -> None:
    assert sorted(got) == sorted(want)
    for key in want:
        assert [(h.tokens, h.score, h.log_prob) for h in got[key]] == [
            (h.tokens, h.score, h.log_prob) for h in want[key]
        ], f"input {key}"


def sources(
    vocab: int, lengths: list[int], beams: list[int], n_best: int, seed: int, first: int = 0
) -> list[Source[int]]:
    g = torch.Generator().manual_seed(seed)
    ids = [[*torch.randint(4, vocab, (n - 1,), generator=g).tolist(), EOS_ID] for n in lengths]
    return [Source(first + i, s, k, min(n_best, k)) for i, (s, k) in enumerate(zip(ids, beams, strict=True))]


@pytest.fixture(scope="module")
def model() -> Transformer:
    from conftest import random_model

    return random_model(
        seed=1, sharpen=2.0, eos_boost=1.5, share_embeddings=False, tie_output=False, pre_norm=True
    )


def runner_for(model: Transformer, options: DecodeOptions, top: int) -> Any:
    return load_runner(model, top=top, capacity=64, positions=options.positions(128), compile=False)


# -- reads ------------------------------------------------------------------------------------------

MIXES = {
    "greedy": ([1] * 6, 1),
    "beam4": ([4] * 6, 4),
    "mixed": ([1, 4, 2, 1, 3, 5], 3),
}


@pytest.mark.parametrize("greedy_scores", [True, False])
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_steps_between_reads_read_nothing(
    monkeypatch: pytest.MonkeyPatch, model: Transformer, mix: str, greedy_scores: bool
) -> None:
    """Inputs without constraints, some joining mid-way: only the steps that read which inputs
    finished make reads (one per ``sync_every`` steps, or earlier where an input reaches its length
    limit), and the results are the host path's."""
    beams, n_best = MIXES[mix]
    k_sync = 8
    options = DecodeOptions(beam_size=max(beams), max_length_a=1.5, max_length_b=6)
    runner = runner_for(model, options, 2 * max(beams))
    vocab = model.cfg.vocab_size
    lengths = [5, 9, 3, 12, 7, 4]
    plan: Plan = [
        (0, sources(vocab, lengths[:3], beams[:3], n_best, seed=3)),
        (5, sources(vocab, lengths[3:], beams[3:], n_best, seed=4, first=3)),
    ]
    counter = ReadCounter(monkeypatch)
    # The cache's rows copied by index ops, as on a device (the CPU's own copies read the indices).
    monkeypatch.setattr(model_cache, "copies_on_host", lambda device: False)
    with torch.inference_mode():
        run = run_plan(
            model, runner, plan, options, sync_every=k_sync, greedy_scores=greedy_scores, counter=counter
        )
        want = reference(monkeypatch, model, runner, plan, options, greedy_scores=greedy_scores)
    assert_identical(run.results, want)
    reads, synced, steps = run.reads, run.synced, run.steps
    reading = [i for i, n in enumerate(reads) if n]
    assert set(reading) <= set(synced), (reads, synced)  # the steps between reads read nothing
    # A read every sync_every steps, and earlier only where an input reached its length limit
    # (certainly done: its rows must not be stepped past it).
    inputs = sum(len(group) for _, group in plan)
    assert len(synced) <= math.ceil(steps / k_sync) + inputs
    gaps = [b - a for a, b in zip([-1, *synced], synced, strict=False)]
    assert max(gaps) <= k_sync and reading == synced
    assert sum(n == 0 for n in reads) >= steps // 2  # most steps read nothing


def test_a_batch_with_a_constrained_input_may_read(
    monkeypatch: pytest.MonkeyPatch, model: Transformer
) -> None:
    """A constrained input keeps the host path (a read per step); the unconstrained ones beside it
    still get the host path's results."""
    options = DecodeOptions(beam_size=3, max_length_a=1.5, max_length_b=6)
    runner = runner_for(model, options, 6)
    vocab = model.cfg.vocab_size
    group = sources(vocab, [6, 8, 4], [3, 3, 3], 2, seed=9)
    group[1] = Source(1, group[1].ids, 3, 2, ((7, 8),))
    counter = ReadCounter(monkeypatch)
    with torch.inference_mode():
        run = run_plan(model, runner, [(0, group)], options, sync_every=8, counter=counter)
        want = reference(monkeypatch, model, runner, [(0, group)], options)
    assert_identical(run.results, want)
    assert run.reads[0] > 0  # (not required: allowed)


def test_the_counter_sees_todays_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The counter counts each kind of read (so that a step that reads cannot pass unseen)."""
    counter = ReadCounter(monkeypatch)
    t = torch.tensor([3.0, 1.0])
    with counter:
        t.tolist(), t[0].item(), bool(t[0]), int(t[1]), float(t[0]), t.cpu(), [0, 1][t.long()[1]]
    assert len(counter.reads) >= 7
    with counter:
        _ = t + 1, t.argmax(), torch.empty(0).tolist()
    assert counter.reads == []
    with counter, torch.inference_mode():
        torch.ops.aten.item(t[0])  # (what a read in C++ code dispatches, unseen by the wrappers)
    assert counter.reads


# -- identical results ------------------------------------------------------------------------------


@pytest.mark.parametrize("sync_every", [1, 3, 8])
@pytest.mark.parametrize("alpha", [0.6, 1.0])
@pytest.mark.parametrize("beam_size", [1, 2, 3, 4, 5])
def test_device_search_equals_the_host_path(
    monkeypatch: pytest.MonkeyPatch, model: Transformer, beam_size: int, alpha: float, sync_every: int
) -> None:
    """The real model, every beam size, n-best, both length penalties, inputs joining mid-way and
    at their limits: the same tokens, scores and log-probs as ``Beam``, bit for bit where the
    same rows share every step (``sync_every=1``). Between reads finished rows stay, so the step's
    batches differ from the host path's: the scripted test below is the exact check for those (a
    real model's float rounding may depend on the rows beside it)."""
    options = DecodeOptions(beam_size=beam_size, length_penalty=alpha, max_length_a=1.2, max_length_b=4)
    runner = runner_for(model, options, 2 * beam_size)
    vocab = model.cfg.vocab_size
    plan: Plan = [
        (0, sources(vocab, [4, 9, 2], [beam_size] * 3, beam_size, seed=beam_size)),
        (2, sources(vocab, [7], [beam_size], beam_size, seed=10 + beam_size, first=3)),
        (7, sources(vocab, [3, 11], [beam_size] * 2, 2, seed=20 + beam_size, first=4)),
    ]
    with torch.inference_mode():
        got = run_plan(model, runner, plan, options, sync_every=sync_every).results
        want = reference(monkeypatch, model, runner, plan, options)
    if sync_every > 1:  # finished rows stay a few steps: other batch sizes, other float rounding
        for key in want:
            assert [h.tokens for h in got[key]] == [h.tokens for h in want[key]], key
            for a, b in zip(got[key], want[key], strict=True):
                assert a.log_prob == pytest.approx(b.log_prob, abs=1e-4)
                assert a.score == pytest.approx(b.score, abs=1e-4)
    else:
        assert_identical(got, want)


@pytest.mark.parametrize("sync_every", [1, 2, 5, 8])
@pytest.mark.parametrize("alpha", [0.6, 1.0])
@pytest.mark.parametrize("greedy_scores", [True, False])
def test_scripted_mixed_beams_equal_the_host_path_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch, sync_every: int, alpha: float, greedy_scores: bool
) -> None:
    """A decoder whose log-probs do not depend on the batch (``ScriptedModel``): whatever rows share
    a step, the device search gives exactly the host path's hypotheses, for a mix of beam sizes
    1 to 5 in one batch, inputs joining at several steps, some ending at their length limit."""
    rng = random.Random(sync_every)
    plan: Plan = []
    key = 0
    for at in (0, 1, 4, 9):
        group = []
        for _ in range(3):
            k = rng.randint(1, 5)
            words = [rng.randrange(4, 16) for _ in range(rng.randint(1, 6))]
            group.append(Source(key, [*words, EOS_ID], k, rng.randint(1, k)))
            key += 1
        plan.append((at, group))
    options = DecodeOptions(beam_size=5, length_penalty=alpha, max_length_a=0.5, max_length_b=3)
    results = []
    for on_device in (True, False):
        scripted = ScriptedModel(hashed)
        runner = EagerRunner(DecodeStep(as_model(scripted), top=10))
        if on_device:
            results.append(
                run_plan(
                    as_model(scripted),
                    runner,
                    plan,
                    options,
                    sync_every=sync_every,
                    greedy_scores=greedy_scores,
                ).results
            )
        else:
            results.append(
                reference(monkeypatch, as_model(scripted), runner, plan, options, greedy_scores=greedy_scores)
            )
    assert_identical(*results)
    limits = [options.output_limit(len(s.ids), 64) for _, g in plan for s in g]
    ends = [max(len(h.tokens) + 1 for h in results[1][s.key]) for _, g in plan for s in g]
    assert any(e == lim for e, lim in zip(ends, limits, strict=True))  # some ended at their limit
    assert any(e < lim for e, lim in zip(ends, limits, strict=True))  # some before


def test_dropped_inputs_leave_the_others_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    """An input dropped between reads (finished or not): the others' rows move, their search state
    with them."""
    plan_sources = [Source(i, [*range(4 + i, 8 + i), EOS_ID], k, k) for i, k in enumerate([3, 1, 4, 2, 1])]
    options = DecodeOptions(beam_size=4, max_length_a=1.0, max_length_b=3)
    results: list[dict[int, list[Hypothesis]]] = []
    for on_device in (True, False):
        with monkeypatch.context() as m:
            if not on_device:
                m.setattr(Search, "on_device", lambda self, constraints: False)
            scripted = ScriptedModel(hashed)
            runner = EagerRunner(DecodeStep(as_model(scripted), top=8))
            batch: RunningBatch[int] = RunningBatch(
                as_model(scripted), runner, capacity=16, options=options, sync_every=8, device_search=True
            )
            batch.add(plan_sources)
            done: dict[int, list[Hypothesis]] = {}
            for step in range(40):
                if step == 3:
                    assert set(batch.drop(lambda key: key in (0, 3))) <= {0, 3}
                if not len(batch):
                    break
                done.update(batch.step())
            results.append({key: hyps for key, hyps in done.items() if key not in (0, 3)})
    assert sorted(results[0]) == [1, 2, 4]
    assert_identical(*results)
