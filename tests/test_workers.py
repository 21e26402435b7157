"""Model workers as real child processes behind the app: requests spread over them translate as
one model would, their metrics reach /metrics (prometheus_client's multiprocess mode), a worker
killed with SIGKILL under load is started again and its sentences are translated by a live worker
(never failed), a hung worker cannot hold a request past its deadline, and a worker that cannot
load its model stops the start-up with the reason."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
from conftest import synthetic_sentences
from fastapi.testclient import TestClient
from test_api import assert_error, best, make_settings, serve

from app.main import worker_count, worker_threads
from app.models.served import ServedModel
from app.monitoring.metrics import Metrics
from app.serving.frontend.handle import WorkerProcess, WorkerThread
from app.serving.frontend.scheduler import Scheduler
from app.serving.protocol import ModelSpec, ToWorker, Translate
from model.translator import Translator

# Two workers, in a process each (NMT_WORKER_PROCESSES=0) or as two threads of one process (1).
PROCESSES = pytest.mark.parametrize("processes", [0, 1], ids=["a-process-each", "one-process"])


@pytest.fixture(scope="module", params=[0, 1], ids=["a-process-each", "one-process"])
def two_workers(model_dir: Path, request: pytest.FixtureRequest) -> Iterator[TestClient]:
    with serve(make_settings(model_dir, replicas=2, threads=1, worker_processes=request.param)) as client:
        yield client


def scheduler_of(client: TestClient) -> Scheduler:
    scheduler = client.app.state.services.scheduler  # type: ignore[attr-defined]
    assert isinstance(scheduler, Scheduler)
    return scheduler


def metrics_of(client: TestClient) -> Metrics:
    metrics: Metrics = client.app.state.services.metrics  # type: ignore[attr-defined]
    return metrics


def model_of(client: TestClient) -> ServedModel:
    """The one model these tests serve."""
    [model] = client.app.state.services.router.models  # type: ignore[attr-defined]
    assert isinstance(model, ServedModel)
    return model


def pids(client: TestClient) -> list[int | None]:
    return [state.worker.pid for state in scheduler_of(client).workers]


def translate_all(client: TestClient, texts: list[str], beam_size: int) -> list[list[str]]:
    """Every text as its own request, all at once, through the scheduler; each one's best."""
    model = model_of(client)
    scheduler = scheduler_of(client)

    async def all_at_once() -> list[list[str]]:
        found = await asyncio.gather(
            *(
                scheduler.translate(model.source_ids([t]), beam_size=beam_size, n_best=1, timeout_s=60)
                for t in texts
            )
        )
        return [[nbest[0] for nbest in model.texts(f)] for f in found]

    return client.portal.call(all_at_once)  # type: ignore[union-attr]


def test_requests_spread_over_the_workers_translate_as_one_model(
    two_workers: TestClient, translator: Translator
) -> None:
    scheduler = scheduler_of(two_workers)
    processes = 1 if scheduler.workers[0].worker.name.startswith("nmt-workers") else 2
    assert len(scheduler.workers) == 2 and len(set(pids(two_workers))) == processes
    sentences = synthetic_sentences(24, seed=3)
    given: list[str] = []
    sends = {id(s.worker): s.worker.send for s in scheduler.workers}

    def counting(worker: WorkerThread):  # type: ignore[no-untyped-def]
        def send(message: ToWorker) -> bool:
            if isinstance(message, Translate):
                given.extend([worker.name] * len(message.sentences))
            return sends[id(worker)](message)

        return send

    patches = [
        mock.patch.object(s.worker, "send", counting(s.worker))  # type: ignore[arg-type]
        for s in scheduler.workers
    ]
    for p in patches:
        p.start()
    try:
        got = translate_all(two_workers, sentences, beam_size=2)
    finally:
        for p in patches:
            p.stop()
    assert [g[0] for g in got] == best(translator, sentences, beam_size=2)
    assert len(set(given)) == 2  # both workers translated some of them


def test_worker_metrics_reach_the_front_ends_view(two_workers: TestClient) -> None:
    metrics = metrics_of(two_workers)
    translated = {"model": "tiny-de-en", "outcome": "translated"}
    before = metrics.sample("nmt_sentences_total", translated)
    sentences = synthetic_sentences(10, seed=4)
    answer = two_workers.post("/translate", json={"q": sentences, "source": "de", "target": "en"})
    assert answer.status_code == 200, answer.text
    # Written by the worker processes into their own files, read back here at once: no relay.
    assert metrics.sample("nmt_sentences_total", translated) == before + 10
    text = two_workers.get("/metrics").text
    assert "nmt_decode_steps_total" in text and "nmt_batch_size_sequences_count" in text
    assert text.count("# TYPE nmt_sentences_total counter") == 1  # one consistent view


def test_large_requests_and_answers_cross_the_pipes_whole(
    two_workers: TestClient, translator: Translator
) -> None:
    batch = synthetic_sentences(300, seed=10)
    model = model_of(two_workers)

    async def one() -> list[str]:
        found = await scheduler_of(two_workers).translate(model.source_ids(batch), beam_size=2, n_best=1)
        return [nbest[0] for nbest in model.texts(found)]

    assert two_workers.portal.call(one) == best(translator, batch, beam_size=2)  # type: ignore[union-attr]


def test_workers_share_out_the_cores_by_default(model_dir: Path) -> None:
    cores = len(os.sched_getaffinity(0))
    assert worker_count(make_settings(model_dir, replicas=0)) == cores  # one per core on CPU
    assert worker_threads(make_settings(model_dir, replicas=0, threads=0)) == 1
    assert worker_threads(make_settings(model_dir, replicas=1, threads=0)) == cores
    assert worker_threads(make_settings(model_dir, replicas=2, threads=3)) == 3


def test_with_idle_cores_each_worker_has_a_slot_on_the_core_board_and_none_by_default(
    two_workers: TestClient, model_dir: Path
) -> None:
    """On CPU, with NMT_IDLE_CORES, a worker alone at work may take the other workers' threads
    (app.serving.cores); by default each keeps its own."""
    assert [state.worker.cores for state in scheduler_of(two_workers).workers] == [None, None]
    settings = make_settings(model_dir, replicas=2, threads=1, idle_cores=True, warmup=False)
    with serve(settings) as client:
        shares = [state.worker.cores for state in scheduler_of(client).workers]
        assert all(share is not None for share in shares)
        assert sorted(share.index for share in shares) == [0, 1]  # type: ignore[union-attr]
        assert {(share.own, share.alone) for share in shares} == {(1, 2)}  # type: ignore[union-attr]


@PROCESSES
def test_a_worker_killed_under_load_is_restarted_and_its_sentences_are_retried(
    model_dir: Path, translator: Translator, processes: int
) -> None:
    """Killed with its process: with a process per worker, the other worker translates its
    sentences; with one process, both workers go and come back, and nothing is lost either."""
    settings = make_settings(
        model_dir, replicas=2, threads=1, max_batch_size=4, warmup=False, worker_processes=processes
    )
    with serve(settings) as client:
        metrics = metrics_of(client)
        label = {"model": "tiny-de-en"}
        retried, restarts = (
            metrics.sample("nmt_retried_sentences_total", label),
            metrics.sample("nmt_worker_restarts_total"),  # (not per model: workers serve them all)
        )
        victim = scheduler_of(client).workers[0]
        old_pid = victim.worker.pid
        assert old_pid is not None
        texts = synthetic_sentences(60, seed=21)
        model = model_of(client)
        scheduler = scheduler_of(client)

        async def load_then_kill() -> list[list[str]]:
            tasks = [
                asyncio.ensure_future(
                    scheduler.translate(model.source_ids([t]), beam_size=3, n_best=1, timeout_s=120)
                )
                for t in texts
            ]
            while not victim.sentences:  # the victim is busy with some of them
                await asyncio.sleep(0.005)
            os.kill(old_pid, signal.SIGKILL)
            found = await asyncio.gather(*tasks)
            return [[nbest[0] for nbest in model.texts(f)] for f in found]

        got = client.portal.call(load_then_kill)  # type: ignore[union-attr]
        assert [g[0] for g in got] == best(translator, texts, beam_size=3)  # none failed, none lost
        assert metrics.sample("nmt_retried_sentences_total", label) > retried
        deadline = time.monotonic() + 120
        while not all(state.worker.running for state in scheduler_of(client).workers):
            assert time.monotonic() < deadline, "the workers were not started again"
            time.sleep(0.1)
        assert victim.worker.pid != old_pid
        gone = 1 if processes == 0 else 2  # the workers of the killed process
        assert metrics.sample("nmt_worker_restarts_total") == restarts + gone
        assert client.post("/translate", json={"q": texts[:3], "target": "en"}).status_code == 200


def test_a_hung_worker_holds_no_request_past_its_deadline(model_dir: Path) -> None:
    settings = make_settings(model_dir, replicas=1, threads=1, request_timeout_s=1.0, warmup=False)
    with serve(settings) as client:
        [pid] = pids(client)
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)  # frozen: alive, but answers nothing
        try:
            started = time.monotonic()
            late = client.post("/translate", json={"q": "Ein Hund.", "target": "en"})
            assert_error(late, 504, "timed out")
            assert time.monotonic() - started < 5
        finally:
            os.kill(pid, signal.SIGCONT)
        assert client.post("/translate", json={"q": "Ein Hund.", "target": "en"}).status_code == 200


def test_the_reason_a_worker_fails_is_reported(model_dir_copy: Path, tmp_path: Path) -> None:
    (model_dir_copy / "model.safetensors").write_bytes(b"not weights")
    spec = ModelSpec("broken", model_dir_copy)
    [worker] = WorkerProcess(
        make_settings(model_dir_copy), (spec,), threads=1, metrics_dir=str(tmp_path), name="w"
    ).workers

    async def start() -> None:
        await worker.start()

    with pytest.raises(RuntimeError, match="model.safetensors"):
        asyncio.run(start())
    assert not worker.running
    assert worker.process is not None and not worker.process.is_alive()
