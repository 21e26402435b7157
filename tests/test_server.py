"""The service as deployed: ``uvicorn app.main:app`` in a subprocess, configured by NMT_* variables,
talked to over real HTTP (httpx)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import httpx
import pytest
from conftest import synthetic_sentences
from starlette.datastructures import State

from app.http.connections import SERVE_OPTIONS
from app.main import SHUTDOWN_SIGNALS, readiness_fails_on_shutdown
from app.main import logger as main_logger
from app.translation.segments import split_text
from model.translator import Translator

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 90.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    url: str
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def start_server(log: Path, **env: str) -> Server:
    """``uvicorn app.main:app`` as deployed, with only the given NMT_* variables (plus cpu, one
    worker with one thread, float32: answers are compared with ``translate_batch`` exactly)."""
    port = free_port()
    clean = {k: v for k, v in os.environ.items() if not k.startswith("NMT_")}
    full_env = {
        **clean,
        "NMT_DEVICE": "cpu",
        "NMT_REPLICAS": "1",
        "NMT_THREADS": "1",
        "NMT_QUANTIZATION": "none",
        "NMT_COMPILE": "false",  # compiling takes 20-30 s a start; the test of shared batches compiles
        **env,
    }
    with log.open("wb") as out:  # a file, not a pipe: a full pipe would block the server
        process = subprocess.Popen(
            [
                *[sys.executable, "-m", "uvicorn", "app.main:app", *SERVE_OPTIONS],
                *["--host", "127.0.0.1", "--port", str(port)],
            ],
            cwd=REPO,
            env=full_env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return Server(process, f"http://127.0.0.1:{port}", log)


def wait_ready(server: Server) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            pytest.fail(f"server exited with {server.process.returncode}:\n{server.output()}")
        try:
            if httpx.get(f"{server.url}/health/ready", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass  # not listening yet
        time.sleep(0.2)
    pytest.fail(f"server not ready after {START_TIMEOUT_S} s:\n{server.output()}")


def stop(server: Server) -> int:
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
    try:
        return server.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()
        raise


@contextmanager
def running_server(log: Path, **env: str) -> Iterator[Server]:
    """``start_server``, ready; stopped (SIGTERM) when the block ends."""
    server = start_server(log, **env)
    try:
        wait_ready(server)
        yield server
    finally:
        stop(server)


def children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return out


def worker_pids(server: Server) -> list[int]:
    """The server's model workers: its children started by multiprocessing's ``spawn`` (not its
    resource tracker)."""
    pids = [
        pid
        for pid in children(server.process.pid)
        if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    assert pids, "no model worker found"
    return pids


@contextmanager
def held(workers: list[int]) -> Iterator[None]:
    """The workers stopped (SIGSTOP) for the block: what they were sent stays unanswered until it
    ends (SIGCONT), so a request is in flight for as long as the test needs, however fast or slow
    the machine. The front end, a process of its own, goes on."""
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in workers:
            os.kill(pid, signal.SIGCONT)


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    """Poll until ``condition()``; the timeout only bounds a test that would otherwise hang."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


THINGS = (
    "Hut",
    "Ball",
    "Hund",
    "Buch",
    "Korb",
    "Schal",
    "Helm",
    "Stock",
    "Eimer",
    "Drachen",
    "Apfel",
    "Brot",
)


def long_sentences(n: int) -> list[str]:
    """``n`` different sentences (a sentence repeated in one request is decoded once), each long
    enough to keep a worker busy for a while."""
    return [
        f"Zwei kleinen Kinder sitzen auf dem roten Ball vor einem großen Gebäude im Park mit {thing}."
        for thing in THINGS[:n]
    ]


def waiting_sentences(server: Server) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return metric(text, 'nmt_queue_depth_sentences{model="tiny-de-en"}')


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # One sentence in the running batch at a time: a request's other sentences wait in the front
    # end's queue, where nmt_queue_depth_sentences shows that it was admitted while its worker is held.
    log = tmp_path_factory.mktemp("server") / "uvicorn.log"
    srv = start_server(log, NMT_MODEL_DIR=str(model_dir), NMT_MAX_BATCH_SIZE="1")
    try:
        wait_ready(srv)
        yield srv
    finally:
        code = stop(srv)
    # A graceful shutdown (lifespan finished, engine stopped); uvicorn then re-raises SIGTERM.
    assert code in (0, -signal.SIGTERM), srv.output()
    assert "Application shutdown complete" in srv.output()


def metric(text: str, sample: str) -> float:
    """The value of the sample line starting with ``sample`` (name and labels), or 0."""
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_translate_over_http(server: Server, translator: Translator) -> None:
    text = "Ein Mann spielt.\n\nDer Hund läuft im Wasser."
    one, two = (
        r.hypotheses[0] for r in translator.translate_batch(["Ein Mann spielt.", "Der Hund läuft im Wasser."])
    )
    response = httpx.post(
        f"{server.url}/translate", json={"q": text, "source": "de", "target": "en"}, timeout=30
    )
    assert response.status_code == 200, response.text
    assert response.json() == {"translatedText": f"{one}\n\n{two}"}
    form = httpx.post(
        f"{server.url}/translate",
        data={"q": ["Ein Mann spielt.", ""], "source": "de", "target": "en"},
        timeout=30,
    )
    assert form.json() == {"translatedText": [one, ""]}
    bad = httpx.post(f"{server.url}/translate", json={"q": "Hallo", "target": "fr"}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"] == "fr is not supported"
    assert "de->en" in bad.json()["supportedPairs"]


def fork_servers(server: Server) -> list[int]:
    return [
        pid
        for pid in children(server.process.pid)
        if b"multiprocessing.forkserver" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]


def test_the_document_readers_fork_server_starts_with_the_first_document(server: Server) -> None:
    # (No test of this module before this one sends a document.)
    assert fork_servers(server) == []  # a service that has read no document holds no format library
    form = {"source": "de", "target": "en"}
    files = {"file": ("a.txt", b"Ein Mann spielt.")}
    response = httpx.post(f"{server.url}/translate_file", data=form, files=files, timeout=60)
    assert response.status_code == 200, response.text
    assert len(fork_servers(server)) == 1


def test_metrics_over_http(server: Server) -> None:
    httpx.get(f"{server.url}/languages", timeout=10).raise_for_status()
    response = httpx.get(f"{server.url}/metrics", timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    assert metric(response.text, 'nmt_requests_total{endpoint="/languages",status="200"}') >= 1
    assert metric(response.text, 'nmt_model_load_seconds{model="tiny-de-en"}') > 0
    assert "nmt_queue_depth_sentences" in response.text


def test_client_disconnect_abandons_the_translation(server: Server) -> None:
    texts = long_sentences(8)
    body = {"q": texts, "source": "de", "target": "en", "beam_size": 4}
    with held(worker_pids(server)):  # nothing is translated: the client gives up first, for sure
        with pytest.raises(httpx.ReadTimeout):  # and closes the connection
            httpx.post(f"{server.url}/translate", json=body, timeout=httpx.Timeout(10, read=2))
        status = 'nmt_requests_total{endpoint="/translate",status="499"}'
        wait_until(
            lambda: metric(httpx.get(f"{server.url}/metrics", timeout=10).text, status) >= 1,
            "the abandoned request was never recorded as 499",
        )
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    abandoned = metric(text, 'nmt_sentences_total{model="tiny-de-en",outcome="abandoned"}')
    assert abandoned > 0, text  # dropped from the engine, not translated for nobody
    assert metric(text, 'nmt_queue_depth_sentences{model="tiny-de-en"}') == 0


def test_health_and_metrics_answer_while_a_translation_waits_for_its_worker(server: Server) -> None:
    """The model runs in a worker process, never on the event loop: while a translation is
    unfinished (its worker held, so it stays unfinished however fast the machine), /health and
    /metrics answer; the translation is answered once the worker goes on."""
    texts = long_sentences(8)
    body = {"q": texts, "source": "de", "target": "en", "beam_size": 4}
    answers: list[httpx.Response] = []
    busy = threading.Thread(
        target=lambda: answers.append(httpx.post(f"{server.url}/translate", json=body, timeout=120))
    )
    with held(worker_pids(server)):
        busy.start()
        wait_until(lambda: waiting_sentences(server) >= 1, "the translation was never admitted")
        for _ in range(3):
            assert httpx.get(f"{server.url}/health", timeout=2).status_code == 200
            assert httpx.get(f"{server.url}/metrics", timeout=2).status_code == 200
        assert busy.is_alive() and not answers  # answered while the translation was unfinished
    busy.join(timeout=120)
    assert [a.status_code for a in answers] == [200]
    assert len(answers[0].json()["translatedText"]) == len(texts)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"NMT_MODEL_DIR": "{tmp}/no-such-model"},
            "cannot load model: {tmp}/no-such-model/config.json: missing",
        ),
        ({"NMT_MODEL_DIR": "{tmp}", "NMT_MAX_QUEUE": "0"}, "invalid configuration: NMT_MAX_QUEUE"),
        (
            {"NMT_MODEL_DIR": "{tmp}", "NMT_NO_REPEAT_NGRAM_SIZE": "-1"},
            "invalid configuration: NMT_NO_REPEAT_NGRAM_SIZE",
        ),
    ],
)
def test_bad_start_exits_nonzero_with_a_clear_message(
    tmp_path: Path, env: dict[str, str], message: str
) -> None:
    server = start_server(tmp_path / "uvicorn.log", **{k: v.format(tmp=tmp_path) for k, v in env.items()})
    try:
        code = server.process.wait(timeout=START_TIMEOUT_S)
    finally:
        stop(server)
    assert code != 0
    assert message.format(tmp=tmp_path) in server.output()


def test_a_worker_that_cannot_load_its_model_stops_the_start_with_the_reason(
    model_dir_copy: Path, tmp_path: Path
) -> None:
    (model_dir_copy / "model.safetensors").write_bytes(b"not weights")
    server = start_server(tmp_path / "uvicorn.log", NMT_MODEL_DIR=str(model_dir_copy))
    try:
        code = server.process.wait(timeout=START_TIMEOUT_S)
    finally:
        stop(server)
    assert code != 0
    assert "cannot start a model worker" in server.output() and "model.safetensors" in server.output()


def test_64_concurrent_requests_share_model_batches(
    model_dir: Path, tmp_path: Path, translator: Translator
) -> None:
    """64 clients at once: /metrics shows decoding steps over more than one sequence, and every
    answer equals its text translated alone."""
    texts = synthetic_sentences(128, seed=11)[::2][:64]  # the German-looking ones
    beams = [1 if i % 2 else 3 for i in range(len(texts))]
    expected = []
    for text, beam in zip(texts, beams, strict=True):
        layout = split_text(text, "de")
        alone = [translator.translate_batch([s], beam_size=beam)[0].hypotheses[0] for s in layout.sentences]
        expected.append(layout.join(alone))
    # With the compiled decoding step, as deployed: ready only once compiled; the encoder compiled
    # too, in the background (whichever encodes a batch, the same bits).
    srv = start_server(
        tmp_path / "uvicorn.log", NMT_MODEL_DIR=str(model_dir), NMT_COMPILE="true", NMT_COMPILE_ENCODER="true"
    )
    try:
        wait_ready(srv)

        async def clients() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
                return await asyncio.gather(
                    *(
                        client.post(
                            "/translate", json={"q": t, "source": "de", "target": "en", "beam_size": b}
                        )
                        for t, b in zip(texts, beams, strict=True)
                    )
                )

        responses = asyncio.run(clients())
        scrape = httpx.get(f"{srv.url}/metrics", timeout=10).text
    finally:
        stop(srv)
    assert [r.status_code for r in responses] == [200] * 64
    assert [r.json()["translatedText"] for r in responses] == expected
    steps = metric(scrape, 'nmt_batch_size_sequences_count{model="tiny-de-en"}')
    rows = metric(scrape, 'nmt_batch_size_sequences_sum{model="tiny-de-en"}')
    assert steps > 0 and rows / steps > 1.0, (rows, steps)  # shared batches, not one sentence at a time
    assert metric(scrape, 'nmt_requests_total{endpoint="/translate",status="200"}') == 64


def test_sigterm_fails_readiness_refuses_connections_and_answers_the_requests_in_flight(
    model_dir: Path, tmp_path: Path
) -> None:
    """SIGTERM (docker stop; Kubernetes, after the preStop hook): readiness fails at the signal and
    uvicorn closes its listening socket, so a readiness probe or a new client is answered 503 or
    refused; what was accepted is answered before the process exits, with the workers stopped
    after. The worker is held from before the request until those checks are done: the request is
    in flight during them (the drain not finished), however fast or slow the machine."""
    texts = long_sentences(12)
    srv = start_server(tmp_path / "uvicorn.log", NMT_MODEL_DIR=str(model_dir), NMT_MAX_BATCH_SIZE="2")
    try:
        wait_ready(srv)
        answers: list[httpx.Response] = []
        body = {"q": texts, "source": "de", "target": "en", "beam_size": 2}
        busy = threading.Thread(
            target=lambda: answers.append(httpx.post(f"{srv.url}/translate", json=body, timeout=120))
        )
        spawned = children(srv.process.pid)  # the workers, and multiprocessing's resource tracker
        with held(worker_pids(srv)):
            busy.start()
            wait_until(lambda: waiting_sentences(srv) >= 1, "the request was never admitted")
            srv.process.send_signal(signal.SIGTERM)
            probes = readiness_until_refused(srv)
            assert all(code == 503 for code in probes), probes  # never "ready" after the signal
            wait_until(lambda: "SIGTERM: not ready" in srv.output(), f"readiness kept:\n{srv.output()}")
            assert busy.is_alive() and not answers  # all this while the drain was still going on
            assert "Application shutdown complete" not in srv.output()
        busy.join(timeout=120)
        code = srv.process.wait(timeout=60)
    finally:
        stop(srv)
    assert [a.status_code for a in answers] == [200], srv.output()
    assert len(answers[0].json()["translatedText"]) == len(texts)
    assert code in (0, -signal.SIGTERM) and "Application shutdown complete" in srv.output()
    wait_until(  # stopped with it, not orphaned
        lambda: not any(Path(f"/proc/{pid}").exists() for pid in spawned), f"children left: {spawned}", 10
    )


def readiness_until_refused(server: Server) -> list[int]:
    """Ask /health/ready on new connections until one is refused; the status of every answer."""
    codes: list[int] = []
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            codes.append(httpx.get(f"{server.url}/health/ready", timeout=5).status_code)
        except httpx.ConnectError:
            return codes
        except httpx.TransportError:
            pass  # accepted just before the listening socket closed, then dropped: not an answer
        time.sleep(0.01)
    pytest.fail(f"new connections were still accepted 20 s after SIGTERM; answers {codes}")


@pytest.mark.parametrize("sig", SHUTDOWN_SIGNALS, ids=lambda sig: signal.Signals(sig).name)
def test_a_shutdown_signal_fails_readiness_then_reaches_the_servers_handler(
    sig: signal.Signals, caplog: pytest.LogCaptureFixture
) -> None:
    """In the lifespan, uvicorn's handler (here a spy in its place) still runs on SIGTERM and SIGINT,
    and finds readiness already failed; the spy is back in place after the lifespan."""
    state = State()
    seen: list[tuple[int, bool]] = []

    def servers_handler(received: int, frame: FrameType | None) -> None:
        seen.append((received, state.ready))

    async def lifespan() -> None:
        with readiness_fails_on_shutdown(state):
            state.ready = True
            signal.raise_signal(sig)  # its Python handler has run when this returns
            assert seen == [(sig, False)]
            await asyncio.sleep(0)  # the log line is written from the event loop

    original = signal.signal(sig, servers_handler)
    # On the module's logger itself: uvicorn's logging setup, where a test made it, stops
    # "uvicorn.*" records from reaching the root logger and caplog's handler there.
    main_logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger=main_logger.name):
            asyncio.run(lifespan())
        assert signal.getsignal(sig) is servers_handler
    finally:
        main_logger.removeHandler(caplog.handler)
        signal.signal(sig, original)
    assert f"{sig.name}: not ready; answering the requests in flight" in caplog.text
