"""Where a model lives among the workers (``app.serving.frontend.placement.homes`` and the
scheduler's choice of worker): each model is one worker's own, so that the machine holds it once;
its sentences go to the worker that owns it; a hot model spreads to another worker once its owner
has a batch's worth in hand; a single model is every worker's."""

from __future__ import annotations

from test_scheduler import FakeWorker, run, scheduler, sources

from app.serving.frontend.placement import homes


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


def test_a_hot_model_spreads_to_another_worker_once_its_owner_has_a_batch_in_hand() -> None:
    async def main() -> None:
        w0, w1 = FakeWorker("w0"), FakeWorker("w1")
        s = scheduler([w0, w1], max_batch_size=2, models=("a", "b"))  # each holds 3 rows
        await s.start()
        s.submit(sources(3, tag=1), beam_size=1, n_best=1, model="a")
        # Two rows make w0's batch: the third goes to w1, which then loads a too.
        assert len(w0.given()) == 2 and [j.model for j in w1.given()] == ["a"]
        s.stop()

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
