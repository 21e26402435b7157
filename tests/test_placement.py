"""Where a model lives among the workers (``app.serving.frontend.placement.homes`` and the
scheduler's choice of worker): each model is one worker's own, so that the machine holds it once;
its sentences go to the worker that owns it; a model hot for a while spreads to another worker
(``app.serving.frontend.spreading``); a single model is every worker's."""

from __future__ import annotations

from test_scheduler import FakeWorker, run, scheduler, sources

from app.serving.frontend.placement import homes
from app.serving.frontend.spreading import SPREAD_AFTER_S
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
