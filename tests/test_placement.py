"""Where a model lives among the workers (``app.serving.frontend.placement.homes`` and the
scheduler's choice of worker): each model is one worker's own, so that the machine holds it once;
its sentences go to the worker that owns it; a model hot for a while spreads to another worker
(``app.serving.frontend.spreading``); a single model is every worker's."""

from __future__ import annotations

from test_scheduler import FakeWorker, run, scheduler, sources

from app.serving.frontend.placement import homes
from app.serving.frontend.spreading import COOL_AFTER_S, LIGHT, SPREAD_AFTER_S
from app.serving.protocol import Load, Loaded


def test_homes_give_each_model_one_worker_and_every_worker_a_model() -> None:
    assert homes(["a", "b", "c"], 2) == [("a", "c"), ("b",)]
    assert homes(["a", "b", "c"], 1) == [("a", "b", "c")]
    assert homes(["m"], 2) == [("m",), ("m",)]  # one model: both workers hold it
    assert homes(["a", "b"], 3) == [("a",), ("b",), ("a",)]
    twenty = [f"m{i}" for i in range(20)]
    owned = [m for own in homes(twenty, 2) for m in own]
    assert sorted(owned) == sorted(twenty)  # each model once


def test_the_scheduler_tells_each_worker_its_own_models() -> None:
    workers = [FakeWorker("w0"), FakeWorker("w1")]
    scheduler(workers, models=("a", "b", "c"))
    assert [w.home for w in workers] == [("a", "c"), ("b",)]  # type: ignore[attr-defined]


def test_a_models_sentences_go_to_the_worker_that_owns_it_even_with_another_freer() -> None:
    async def main() -> None:
        w0, w1 = FakeWorker("w0"), FakeWorker("w1")
        s = scheduler([w0, w1], max_batch_size=4, models=("a", "b"))
        await s.start()
        s.submit(sources(1, tag=1), beam_size=1, n_best=1, model="a")
        s.submit(sources(1, tag=2), beam_size=1, n_best=1, model="a")  # w1 is freer, but not a's
        s.submit(sources(1, tag=3), beam_size=1, n_best=1, model="b")
        assert [j.model for j in w0.given()] == ["a", "a"]
        assert [j.model for j in w1.given()] == ["b"]
        s.stop()

    run(main)


def test_a_model_spreads_once_it_has_filled_half_its_owners_batch_for_a_while() -> None:
    """A model that has held half a batch of rows at its owner for ``SPREAD_AFTER_S`` has a lighter
    worker load it (``Load``), and its sentences go there once that worker holds it (none waits
    for the load there); a burst does not spread, nor a cold model whose owner other models keep
    busy (its sentences wait for the owner's room)."""

    async def main() -> None:
        w1, w2 = FakeWorker("w1"), FakeWorker("w2")
        # 12 rows each; a and c are w1's own models, b is w2's (``placement.homes``).
        s = scheduler([w1, w2], max_batch_size=8, models=("a", "b", "c"))
        now = [100.0]
        s.spreading.clock = lambda: now[0]

        def models(worker: FakeWorker, skip: int) -> list[tuple[str, int]]:
            return [(job.model, job.beam_size) for job in worker.given()[skip:]]

        def loads(worker: FakeWorker) -> list[str]:
            return [m.model for m in worker.sent if isinstance(m, Load)]

        s.submit(sources(8), beam_size=1, n_best=1, model="a")
        assert models(w1, 0) == [("a", 1)] * 8  # half a batch of a, and more: hot from now
        s.submit(sources(1, tag=1), beam_size=3, n_best=1, model="c")
        assert models(w1, 8) == [("c", 3)]  # c is cold: it stays with w1
        s.submit(sources(1, tag=2), beam_size=1, n_best=1, model="a")
        assert models(w1, 9) == [("a", 1)]  # a burst: w1 still has room
        assert not w2.given() and not loads(w2)
        now[0] += SPREAD_AFTER_S
        s.submit(sources(2, tag=3), beam_size=1, n_best=1, model="a")
        assert loads(w2) == ["a"] and not w2.given()  # hot for a while: w2 loads a, once
        assert len(w1.given()) == 10  # w1 is full: the two wait
        s.on_message(w2, Loaded(("b", "a")))
        assert models(w2, 0) == [("a", 1)] * 2  # w2 holds a now: they go there
        s.submit(sources(1, tag=4), beam_size=3, n_best=1, model="c")
        assert len(w1.given()) == 10 and len(w2.given()) == 2  # c waits for w1's room
        w1.answer(*w1.pending.values())
        assert models(w1, 10) == [("c", 3)] and loads(w2) == ["a"]

    run(main)


def test_a_cold_model_does_not_spread_while_its_owner_has_room_for_a_batch() -> None:
    async def main() -> None:
        w0, w1 = FakeWorker("w0"), FakeWorker("w1")
        s = scheduler([w0, w1], max_batch_size=4, models=("a", "b"))
        await s.start()
        for tag in range(3):
            s.submit(sources(1, tag=tag), beam_size=1, n_best=1, model="a")
        assert len(w0.given()) == 3 and w1.given() == []
        s.stop()

    run(main)


def test_a_single_model_uses_every_worker() -> None:
    async def main() -> None:
        w0, w1 = FakeWorker("w0"), FakeWorker("w1")
        s = scheduler([w0, w1], max_batch_size=4)
        await s.start()
        s.submit(sources(2), beam_size=1, n_best=1)
        assert len(w0.given()) == 1 and len(w1.given()) == 1  # the freer one each time
        s.stop()

    run(main)


def test_a_hot_models_dips_shorter_than_cool_after_s_do_not_restart_its_wait_and_longer_ones_do() -> None:
    """A batch whose sentences end together empties the owner's rows for a moment at each round:
    the model stays hot through it (it spreads ``SPREAD_AFTER_S`` after it first filled half a
    batch); a dip of ``COOL_AFTER_S`` or more ends the hot spell, with no change of rows to say
    so, and the next one starts the wait again."""

    async def main() -> None:
        w1, w2 = FakeWorker("w1"), FakeWorker("w2")
        s = scheduler([w1, w2], max_batch_size=8, models=("a", "b"))  # a is w1's, b is w2's
        now = [100.0]
        s.spreading.clock = lambda: now[0]

        def loads(worker: FakeWorker) -> list[str]:
            return [m.model for m in worker.sent if isinstance(m, Load)]

        def a_round(tag: int) -> None:
            """Half a batch of a, answered together a moment later."""
            s.submit(sources(4, tag=tag), beam_size=1, n_best=1, model="a")
            now[0] += 0.5
            w1.answer(*w1.pending.values())  # the batch ends: no row of a held
            now[0] += 0.3  # the next round comes within COOL_AFTER_S

        a_round(1)  # hot from 100
        a_round(2)
        a_round(3)  # 102.4: hot for 2.4 s through the dips
        s.submit(sources(1, tag=4), beam_size=1, n_best=1, model="a")
        assert loads(w2) == ["a"]

        # Another scheduler, a dip as long as COOL_AFTER_S: the wait starts again.
        w3, w4 = FakeWorker("w3"), FakeWorker("w4")
        s = scheduler([w3, w4], max_batch_size=8, models=("a", "b"))
        now[0] = 100.0
        s.spreading.clock = lambda: now[0]
        s.submit(sources(4, tag=5), beam_size=1, n_best=1, model="a")  # hot from 100
        now[0] += 0.5
        w3.answer(*w3.pending.values())  # cool from 100.5
        now[0] += COOL_AFTER_S  # and no change since
        s.submit(sources(4, tag=6), beam_size=1, n_best=1, model="a")  # hot again from 101.5
        now[0] = 101.5 + SPREAD_AFTER_S - 0.1
        s.submit(sources(1, tag=7), beam_size=1, n_best=1, model="a")
        assert not loads(w4)  # not hot since 100
        now[0] = 101.5 + SPREAD_AFTER_S
        s.submit(sources(1, tag=8), beam_size=1, n_best=1, model="a")
        assert loads(w4) == ["a"]

    run(main)


def test_a_worker_running_a_quarter_batch_of_its_own_models_is_not_asked_to_load_a_hot_one() -> None:
    """Its own models keep it busy (a skewed load's hot pair on each worker: each spreading to the
    other made both step both); once it runs less than ``LIGHT`` of a batch, it is asked."""

    async def main() -> None:
        w1, w2 = FakeWorker("w1"), FakeWorker("w2")
        s = scheduler([w1, w2], max_batch_size=8, models=("a", "b"))  # a is w1's, b is w2's
        now = [100.0]
        s.spreading.clock = lambda: now[0]
        s.submit(sources(2, tag=1), beam_size=1, n_best=1, model="b")  # a quarter of a batch at w2
        s.submit(sources(8, tag=2), beam_size=1, n_best=1, model="a")  # hot at w1 from 100
        now[0] += SPREAD_AFTER_S
        s.submit(sources(1, tag=3), beam_size=1, n_best=1, model="a")
        assert not [m for m in w2.sent if isinstance(m, Load)]
        w2.answer(*w2.pending.values())  # w2 idle now: the next sentence of a asks it
        s.submit(sources(1, tag=4), beam_size=1, n_best=1, model="a")
        assert [m.model for m in w2.sent if isinstance(m, Load)] == ["a"]
        assert LIGHT * 8 == 2  # (the quarter of a batch above)

    run(main)
