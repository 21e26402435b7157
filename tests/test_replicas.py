"""Model replicas (``NMT_REPLICAS``): requests spread over child processes give the same
translations, the children's engine metrics reach /metrics, and a replica that dies
fails its own requests (never hangs them), leaves the others serving, and is started again."""

from __future__ import annotations

import asyncio
import functools
import os
import pickle
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
from conftest import synthetic_sentences
from fastapi.testclient import TestClient
from test_api import assert_error, best, make_settings, serve

from app.engine import DeadlineExceeded, EngineError, EngineStopped, SentenceResult
from app.main import replica_threads
from app.metrics import Metrics
from app.replicas import EnginePool, MetricEvents, RemoteEngine, replay
from model.translator import Translator


@pytest.fixture(scope="module")
def replicated(model_dir: Path) -> Iterator[TestClient]:
    with serve(make_settings(model_dir, replicas=2, threads=1)) as client:
        yield client


def pool_of(client: TestClient) -> EnginePool:
    pool = client.app.state.engine  # type: ignore[attr-defined]
    assert isinstance(pool, EnginePool)
    return pool


def sample(client: TestClient, name: str, labels: dict[str, str] | None = None) -> float:
    metrics: Metrics = client.app.state.metrics  # type: ignore[attr-defined]
    return float(metrics.registry.get_sample_value(name, labels or {}) or 0.0)


def test_requests_are_spread_over_the_replicas_and_translate_as_one_engine(
    replicated: TestClient, translator: Translator
) -> None:
    pool = pool_of(replicated)
    assert len(pool.engines) == 2 and all(isinstance(e, RemoteEngine) for e in pool.engines)
    sentences = synthetic_sentences(24, seed=3)
    served: list[int] = []
    real = [e.translate for e in pool.engines]

    def counting(i: int):  # type: ignore[no-untyped-def]
        async def translate(s: list[str], **kwargs: object) -> list[SentenceResult]:
            served.append(i)
            return await real[i](s, **kwargs)  # type: ignore[arg-type]

        return translate

    async def all_at_once() -> list[list[SentenceResult]]:
        return await asyncio.gather(*(pool.translate([s], beam_size=2) for s in sentences))

    translated_before = sample(replicated, "nmt_sentences_total", {"outcome": "translated"})
    with (
        mock.patch.object(pool.engines[0], "translate", counting(0)),
        mock.patch.object(pool.engines[1], "translate", counting(1)),
    ):
        results = replicated.portal.call(all_at_once)  # type: ignore[union-attr]
    assert [r[0].hypotheses[0] for r in results] == best(translator, sentences, beam_size=2)
    assert served.count(0) == served.count(1) == 12  # the least busy replica takes each request
    # The child's engine metrics arrive with its next status report.
    deadline = time.monotonic() + 10
    while sample(replicated, "nmt_sentences_total", {"outcome": "translated"}) < translated_before + 24:
        assert time.monotonic() < deadline, "the child's metric events never arrived"
        time.sleep(0.05)
    assert sample(replicated, "nmt_sentences_total", {"outcome": "translated"}) == translated_before + 24
    assert replicated.get("/health/ready").status_code == 200


def test_large_requests_and_answers_cross_the_pipes_whole(
    replicated: TestClient, translator: Translator
) -> None:
    """The server process reads a replica's pipe in its event loop: large answers (written as a
    header and a body), several on their way at once, must arrive whole and in the right futures."""
    pool = pool_of(replicated)
    batches = [synthetic_sentences(150, seed=10 + i) for i in range(4)]

    async def all_at_once() -> list[list[SentenceResult]]:
        return await asyncio.gather(*(pool.translate(b, beam_size=2) for b in batches))

    results = replicated.portal.call(all_at_once)  # type: ignore[union-attr]
    assert len(pickle.dumps(results[0])) > 16384  # multiprocessing writes header and body apart
    for batch, got in zip(batches, results, strict=True):
        assert [r.hypotheses[0] for r in got] == best(translator, batch, beam_size=2)


def test_http_requests_are_served_by_the_replicas(replicated: TestClient, translator: Translator) -> None:
    assert replicated.get("/info").json()["batching"]["replicas"] == 2
    sentences = synthetic_sentences(4, seed=5)
    answer = replicated.post("/translate", json={"q": sentences, "source": "de", "target": "en"})
    assert answer.status_code == 200, answer.text
    assert answer.json()["translatedText"] == best(translator, sentences)


def test_metric_events_replay_onto_the_service_metrics() -> None:
    events = MetricEvents()
    events.batch_size.observe(3)  # type: ignore[attr-defined]
    events.decode_steps.inc()  # type: ignore[attr-defined]
    events.sentences.labels("translated").inc()  # type: ignore[attr-defined]
    events.queue_depth.set(7)  # type: ignore[attr-defined]  # a gauge: reported as status instead
    metrics = Metrics()
    replay(metrics, events.drain())
    assert events.drain() == []
    get = metrics.registry.get_sample_value
    assert get("nmt_batch_size_sequences_count") == 1 and get("nmt_batch_size_sequences_sum") == 3
    assert get("nmt_decode_steps_total") == 1
    assert get("nmt_sentences_total", {"outcome": "translated"}) == 1
    assert get("nmt_queue_depth_sentences") == 0


def test_replicas_share_out_the_cores_unless_threads_are_set(model_dir: Path) -> None:
    cores = len(os.sched_getaffinity(0))
    assert replica_threads(make_settings(model_dir)) is None  # one replica: torch's default
    assert replica_threads(make_settings(model_dir, replicas=2)) == max(1, cores // 2)
    assert replica_threads(make_settings(model_dir, replicas=2, threads=3)) == 3


def test_a_replica_that_dies_fails_its_requests_and_is_started_again(model_dir: Path) -> None:
    with serve(make_settings(model_dir, replicas=2, threads=1, warmup=False)) as client:
        remote = pool_of(client).engines[1]
        assert isinstance(remote, RemoteEngine) and remote._process is not None
        pid = remote._process.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)  # frozen: the request below stays in flight
        try:
            pending = client.portal.start_task_soon(  # type: ignore[union-attr]
                remote.translate, ["Ein Mann schläft."]
            )
            time.sleep(0.2)
            assert not pending.done()
            # A request with a deadline does not wait for a hung child much past it.
            with mock.patch("app.replicas.DEADLINE_GRACE_S", 0.1), pytest.raises(DeadlineExceeded):
                client.portal.call(  # type: ignore[union-attr]
                    functools.partial(remote.translate, ["Ein Hund."], timeout_s=0.1)
                )
        finally:
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(EngineStopped):
            pending.result(timeout=10)
        assert not remote.alive or remote._process.pid != pid
        # Meanwhile the other replica serves every request.
        assert client.get("/health/ready").status_code == 200
        assert client.post("/translate", json={"q": "Hallo", "target": "en"}).status_code == 200
        deadline = time.monotonic() + 120
        while not remote.alive:
            assert time.monotonic() < deadline, "the replica was not started again"
            time.sleep(0.1)
        assert remote._process.pid != pid
        result = client.portal.call(remote.translate, ["Ein Mann schläft."])  # type: ignore[union-attr]
        assert len(result) == 1 and result[0].hypotheses[0]
        # With every engine stopped, the pool refuses: 503, not a hang.
        pool_of(client).stop()
        assert_error(client.get("/health/ready"), 503, "engine")
        assert_error(client.post("/translate", json={"q": "Hallo", "target": "en"}), 503)


def test_a_replica_that_cannot_load_its_model_fails_start_up_with_the_reason(tmp_path: Path) -> None:
    remote = RemoteEngine(make_settings(tmp_path / "missing"), threads=1, metrics=Metrics())
    with pytest.raises(EngineError, match="missing"):
        asyncio.run(remote.start())
    assert not remote.alive
    assert remote._process is not None and not remote._process.is_alive()
