"""The batching engine: shared batches give the same answers as translating alone, continuous
batching lets short requests overtake long ones, and limits (queue, deadline, cancellation) hold."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from unittest.mock import patch

import pytest
import torch
from conftest import synthetic_sentences

from app.engine import (
    JOIN_RATIO,
    JOIN_WAIT_STEPS,
    DeadlineExceeded,
    Engine,
    EngineStopped,
    Job,
    QueueFull,
)
from app.metrics import Metrics
from model.cache import CacheSlots
from model.checkpoint import load_model, load_tokenizer, read_info
from model.translator import Translator

LONG = [
    "Zwei kleinen Kinder sitzen auf dem roten Ball vor einem großen Gebäude im Park mit Hut und Hund.",
    "Der Hund läuft im Wasser und schaut auf die Straße vor dem großen blauen Gebäude im Park.",
]
SHORT = ["Ein Mann."]


def never_ending(model_dir: Path) -> Translator:
    """The tiny model, changed so that eos is never the best token: every output runs to its length
    limit (a*source_length + b), so long sources take many steps and short ones few."""
    info = read_info(model_dir)
    model = load_model(model_dir, info)
    with torch.no_grad():
        assert model.decoder_norm is not None and model.out_proj is not None
        model.decoder_norm.weight[0] = 0.0  # feature 0 of the final LayerNorm is the constant 1...
        model.decoder_norm.bias[0] = 1.0
        model.out_proj.weight[model.cfg.eos_id] = 0.0
        model.out_proj.weight[model.cfg.eos_id, 0] = -100.0  # ...so eos's logit is always -100
    return Translator(model, load_tokenizer(model_dir), info, torch.device("cpu"))


def counter(metrics: Metrics, name: str, labels: dict[str, str] | None = None) -> float:
    value = metrics.registry.get_sample_value(name, labels or {})
    return float(value or 0.0)


async def wait_for(condition: object, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < end, "condition not reached"
        await asyncio.sleep(0.002)


def test_concurrent_requests_share_batches_and_match_translating_alone(translator: Translator) -> None:
    texts = synthetic_sentences(40, seed=7)[::2]  # the German-looking ones
    beams = [1 if i % 3 else 3 for i in range(len(texts))]
    alone = [
        translator.translate_batch([t], beam_size=b)[0].hypotheses[0]
        for t, b in zip(texts, beams, strict=True)
    ]
    metrics = Metrics()
    engine = Engine(translator, max_batch_size=32, metrics=metrics)
    moved = []  # rows moved into the places of finished ones, per removal
    remove = CacheSlots.remove

    def counting_remove(slots: CacheSlots, leaving: list[int]) -> dict[int, int]:
        moves = remove(slots, leaving)
        moved.append(len(moves))
        return moves

    engine.start()

    async def main() -> list[str]:
        # Staggered arrivals: later requests join a batch that is already decoding.
        async def one(i: int) -> str:
            await asyncio.sleep(0.001 * i)
            return (await engine.translate([texts[i]], beam_size=beams[i]))[0].hypotheses[0]

        return await asyncio.gather(*(one(i) for i in range(len(texts))))

    try:
        with patch.object(CacheSlots, "remove", counting_remove):
            shared = asyncio.run(main())
    finally:
        engine.stop()
    assert shared == alone
    steps = counter(metrics, "nmt_batch_size_sequences_count")
    rows = counter(metrics, "nmt_batch_size_sequences_sum")
    assert steps > 0 and rows / steps > 1.0  # the model really ran shared batches
    assert counter(metrics, "nmt_sentences_total", {"outcome": "translated"}) == len(texts)
    assert engine.active_sequences == 0 and engine.queue_depth == 0
    # Finished rows left while others ran on: rows from the end of the batch took their places,
    # beams included (jobs of 3 rows), without changing anyone's result.
    assert max(moved) > 0


def test_n_best_and_blank_sentences(translator: Translator) -> None:
    engine = Engine(translator)
    engine.start()
    try:
        results = asyncio.run(engine.translate([SHORT[0], "  ", ""], beam_size=3, n_best=2))
    finally:
        engine.stop()
    expected = translator.translate_batch(SHORT, beam_size=3, n_best=2)[0]
    assert results[0].hypotheses == expected.hypotheses
    assert results[0].scores == pytest.approx(expected.scores, abs=1e-4)
    assert results[1].hypotheses == results[2].hypotheses == ["", ""]


@pytest.mark.parametrize("mode", ["continuous", "dynamic"])
def test_short_request_overtakes_a_long_batch_only_with_continuous_batching(
    model_dir: Path, mode: str
) -> None:
    metrics = Metrics()
    engine = Engine(never_ending(model_dir), mode=mode, max_wait_ms=1.0, metrics=metrics)  # type: ignore[arg-type]
    engine.start()
    steps = lambda: counter(metrics, "nmt_decode_steps_total")  # noqa: E731

    async def main() -> tuple[float, float, bool]:
        long_task = asyncio.create_task(engine.translate(LONG, beam_size=2))
        await wait_for(lambda: steps() >= 3)  # the long batch is decoding
        await engine.translate(SHORT, beam_size=1)
        short_done, long_finished_first = steps(), long_task.done()
        await long_task
        return short_done, steps(), long_finished_first

    try:
        short_done, long_done, long_finished_first = asyncio.run(main())
    finally:
        engine.stop()
    if mode == "continuous":
        # It joined the running batch, finished and left while the long batch decoded on.
        assert not long_finished_first and short_done < long_done - 10
    else:
        assert long_finished_first  # it waited for the whole long batch


def test_full_queue_is_refused(model_dir: Path) -> None:
    engine = Engine(never_ending(model_dir), max_batch_size=2, max_queue=3)
    engine.start()

    async def main() -> None:
        running = asyncio.create_task(engine.translate(LONG[:1], beam_size=2))  # fills the batch
        await wait_for(lambda: engine.active_sequences == 1)
        waiting = asyncio.create_task(engine.translate(SHORT * 3, beam_size=1))  # fills the queue
        await wait_for(lambda: engine.queue_depth == 3)
        with pytest.raises(QueueFull):
            await engine.translate(SHORT, beam_size=1)
        await asyncio.gather(running, waiting)  # the others are unaffected

    try:
        asyncio.run(main())
    finally:
        engine.stop()


def test_newcomers_join_a_running_batch_in_groups(model_dir: Path) -> None:
    """While 5 long sentences decode, a lone newcomer joins only JOIN_WAIT_STEPS steps after the
    last join; two newcomers (>= JOIN_RATIO x 5 running) join at the next step."""
    metrics = Metrics()
    # Outputs of 3 x the source length: the long sentences outlast both short requests.
    engine = Engine(never_ending(model_dir), max_length_a=3.0, max_length_b=0, metrics=metrics)
    joins: list[tuple[int, float, int]] = []  # (steps since the last join, step count, newcomers)
    take = engine._take

    def recording_take() -> list[Job]:
        running, since = bool(engine._running.jobs), engine._steps_since_join
        taken = take()
        if taken and running:
            joins.append((since, counter(metrics, "nmt_decode_steps_total"), len(taken)))
        return taken

    engine._take = recording_take  # type: ignore[method-assign]
    engine.start()

    async def main() -> float:
        long_run = asyncio.create_task(engine.translate(LONG * 2 + LONG[:1], beam_size=1))
        await wait_for(lambda: engine.active_sequences == 5)
        await engine.translate(SHORT, beam_size=1)
        submitted = counter(metrics, "nmt_decode_steps_total")
        await engine.translate(SHORT * 2, beam_size=1)
        assert not long_run.done()  # the newcomers joined a running batch
        await long_run
        return submitted

    try:
        submitted = asyncio.run(main())
    finally:
        engine.stop()
    assert 1 < JOIN_RATIO * 5 <= 2  # the arithmetic this test relies on
    assert len(joins) == 2, joins
    assert joins[0][0] == JOIN_WAIT_STEPS and joins[0][2] == 1, joins
    assert joins[1][1] - submitted <= 1 and joins[1][2] == 2, (joins, submitted)


def test_deadline_and_cancellation_free_the_batch(model_dir: Path) -> None:
    metrics = Metrics()
    engine = Engine(never_ending(model_dir), max_length_b=400, metrics=metrics)
    engine.start()

    async def main() -> None:
        with pytest.raises(DeadlineExceeded):
            await engine.translate(LONG, beam_size=2, timeout_s=0.05)
        await wait_for(lambda: engine.active_sequences == 0)
        task = asyncio.create_task(engine.translate(LONG, beam_size=2))  # a client that goes away
        await wait_for(lambda: engine.active_sequences == 2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_for(lambda: engine.active_sequences == 0 and engine.queue_depth == 0)
        ok = await engine.translate(SHORT, beam_size=1)  # and the engine still serves others
        assert ok[0].hypotheses[0]

    try:
        asyncio.run(main())
    finally:
        engine.stop()
    assert counter(metrics, "nmt_sentences_total", {"outcome": "abandoned"}) == 4


def test_engine_restarts_after_stop(translator: Translator) -> None:
    engine = Engine(translator)
    for _ in range(2):
        engine.start()
        try:
            assert asyncio.run(engine.translate(SHORT, beam_size=1))[0].hypotheses[0]
        finally:
            engine.stop()
        assert not engine.alive


def test_stopped_engine_refuses_and_fails_pending(model_dir: Path) -> None:
    engine = Engine(never_ending(model_dir), max_length_b=400)

    async def refused() -> None:
        with pytest.raises(EngineStopped):
            await engine.translate(SHORT)

    asyncio.run(refused())
    engine.start()

    async def pending() -> None:
        task = asyncio.create_task(engine.translate(LONG, beam_size=1))
        await wait_for(lambda: engine.active_sequences == 2)
        await asyncio.get_running_loop().run_in_executor(None, engine.stop)
        with pytest.raises(EngineStopped):
            await task

    asyncio.run(pending())
