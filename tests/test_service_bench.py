"""benchmarks.service without a model: its statistics, its report, the order in which a mode measures
its points and the reference (servers and CTranslate2 replaced by fakes), and its HTTP client and
load loops against a tiny asyncio HTTP server started here (answers at once, so every test takes
< 1 s)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest

import benchmarks.service as service
from benchmarks.service import (
    ClosedLoopResult,
    CpuUsage,
    Ct2Reference,
    HttpConnection,
    OpenLoopResult,
    Plan,
    ProtocolError,
    Record,
    Reference,
    Report,
    Server,
    ServerResult,
    add_ratios,
    check_answer,
    closed_loop,
    closed_loop_result,
    open_loop,
    open_loop_result,
    parse_head,
    percentile,
    plot,
    process_cpu_seconds,
    process_tree,
    read_memory,
    render,
    request_body,
    run_mode,
    summarize,
)

T = TypeVar("T")
CPU = CpuUsage(wall_s=1.0, client_cores=0.1, server_cores=0.9, other_cores=0.5)


# -- statistics -------------------------------------------------------------------------------------
def test_percentile_matches_numpy() -> None:
    rng = random.Random(0)
    for n in (1, 2, 7, 100, 1001):
        values = [rng.expovariate(1.0) for _ in range(n)]
        for q in (0, 1, 50, 95, 99, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12)
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0  # unsorted input
    assert math.isnan(percentile([], 50))


def test_summarize_reports_milliseconds() -> None:
    stats = summarize([0.001 * i for i in range(1, 101)])  # 1..100 ms
    assert stats.count == 100
    assert stats.p50_ms == pytest.approx(50.5)
    assert stats.p99_ms == pytest.approx(99.01)
    assert stats.mean_ms == pytest.approx(50.5)
    assert stats.max_ms == pytest.approx(100.0)
    assert math.isnan(summarize([]).p50_ms)


def test_closed_loop_counts_what_ends_in_the_window() -> None:
    records = [
        Record(0.0, 0.5, None),  # warm-up: ends before the window
        Record(0.5, 1.5, None),  # started in the warm-up, ends inside: counted
        Record(1.5, 2.0, None),
        Record(2.0, 2.1, "HTTP 503"),
        Record(2.1, 2.2, "ConnectionResetError"),
        Record(2.5, 3.5, None),  # ends after the window
    ]
    r = closed_loop_result("continuous", 4, records, (1.0, 3.0), CPU)
    assert (r.completed, r.errors) == (2, 2)
    assert r.error_kinds == {"HTTP 503": 1, "ConnectionResetError": 1}
    assert r.sentences_per_s == pytest.approx(1.0)  # 2 answers in 2 s
    assert r.latency.count == 2 and r.latency.mean_ms == pytest.approx(750.0)  # successes only


def test_open_loop_counts_late_answers_in_the_latency() -> None:
    records = [
        Record(0.5, 0.6, None),  # scheduled in the warm-up: not counted
        Record(1.0, 1.1, None),
        Record(2.9, 9.9, None),  # scheduled in the window, answered long after: its latency counts
        Record(2.95, 60.0, "unfinished"),
    ]
    r = open_loop_result("continuous", 10.0, records, (1.0, 3.0), 2, CPU)
    assert (r.sent, r.completed, r.errors) == (3, 2, 1)
    assert r.achieved_per_s == pytest.approx(0.5)  # only the answer at 1.1 s arrived in the 2 s window
    assert r.latency.max_ms == pytest.approx(7000.0)


def closed(mode: str, clients: int, rate: float) -> ClosedLoopResult:
    r = closed_loop_result(mode, clients, [], (0.0, 1.0), CPU)
    r.sentences_per_s = rate
    return r


def reference(*runs: float) -> Reference:
    return Reference("ctranslate2", 64, 1, 64, 2, 1, list(runs))


def test_reference_summary_is_the_median_of_every_measurement() -> None:
    ref = reference()
    assert ref.runs == [] and math.isnan(ref.sentences_per_s)
    for value in (300.0, 100.0, 250.0, 400.0):
        ref.add(value)
    assert ref.runs == [300.0, 100.0, 250.0, 400.0]  # in the order measured
    assert ref.sentences_per_s == pytest.approx(275.0)
    assert reference(80.0, 120.0, 90.0).sentences_per_s == 90.0


def test_ratios_to_ct2_and_to_no_batching() -> None:
    """Points without an adjacent reference fall back to the median of all measurements."""
    results = [closed("none", 8, 10.0), closed("continuous", 8, 40.0), closed("dynamic", 32, 30.0)]
    add_ratios(results, reference(60.0, 80.0, 100.0))
    assert [r.vs_ct2 for r in results] == pytest.approx([0.125, 0.5, 0.375])
    assert results[0].vs_no_batching is None  # the baseline itself
    assert results[1].vs_no_batching == pytest.approx(4.0)
    assert results[2].vs_no_batching is None  # no "none" run at 32 clients
    add_ratios(results, None)
    assert results[1].vs_no_batching == pytest.approx(4.0)


def test_render_and_plot(tmp_path: Path) -> None:
    report = Report(
        environment={
            "cpu": "test CPU",
            "cpus": 2,
            "torch": "2",
            "ctranslate2": "4",
            "threads": 2,
            "model": "m",
            "beam": 1,
            "sentences": 10,
            "duration_s": 1.0,
            "warmup_s": 0.5,
            "other_cpu_fraction": 0.25,
        },
        reference=Reference("ctranslate2", 10, 1, 64, 2, 3, [10.0, 40.0, 20.0]),
        closed_loop=[closed("none", 1, 10.0), closed("continuous", 1, 30.0)],
        servers=[ServerResult("continuous", 300.0, 250.0, 12.0)],
    )
    report.closed_loop[1].ct2_sentences_per_s = 15.0
    add_ratios(report.closed_loop, report.reference)
    text = render(report)
    assert "**20.0 sentences/s** (median of 3 measurements" in text
    assert "10.0-40.0, each the median of 3 runs" in text
    assert "| continuous | 1 | 30.0 |" in text
    assert "| 15.0 | 2.00× | 3.00× |" in text  # CT2 sent/s (adjacent), ×CT2, ×no batching
    assert "| — | 0.50× | — |" in text  # no adjacent reference: the median
    assert "| continuous | 300 | 250 | 12.0 |" in text
    assert "other processes used 25% of the CPUs" in text
    plot(report, tmp_path / "service.png")
    assert (tmp_path / "service.png").read_bytes()[:4] == b"\x89PNG"


def exited_server(mode: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Server:
    """A Server record for run_mode whose process has already exited; its memory and CPU read as
    unknown (its pid may be reused)."""
    process = subprocess.Popen([sys.executable, "-c", ""])
    process.wait()
    monkeypatch.setattr(service, "read_memory", lambda pid: (None, None))
    monkeypatch.setattr(service, "process_cpu_seconds", lambda pid: None)
    return Server(mode, process, 0, tmp_path / "log")


class FakeReference(Ct2Reference):
    """Measures the given speeds in turn, with no CTranslate2; logs each measurement in ``events``."""

    def __init__(self, speeds: list[float], events: list[str]) -> None:
        self.reference = Reference("ctranslate2", 64, 1, 64, 2, 1)
        self.speeds, self.events = iter(speeds), events

    def measure(self) -> float:
        value = next(self.speeds)
        self.events.append(f"reference {value:g}")
        self.reference.add(value)
        return value


def test_each_point_is_compared_with_the_reference_measured_around_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The reference is measured when the server is ready and after every closed-loop point, once
    the server is idle; a point's ×CT2 uses the mean of the measurements on either side of it, not
    the median of the whole run (which would give both points 60 / 300 = 0.2×)."""
    events: list[str] = []
    server = exited_server("continuous", monkeypatch, tmp_path)

    def point(server: Server, plan: Plan, clients: int) -> ClosedLoopResult:
        events.append(f"{clients} clients")
        return closed(server.mode, clients, 60.0)

    def open_point(server: Server, plan: Plan, rate: float) -> OpenLoopResult:
        events.append(f"{rate:g}/s")
        return open_loop_result(server.mode, rate, [], (0.0, 1.0), 0, CPU)

    monkeypatch.setattr(service, "start_server", lambda *args: server)
    monkeypatch.setattr(service, "wait_ready", lambda server: events.append("ready"))
    monkeypatch.setattr(service, "wait_idle", lambda server: events.append("idle"))
    monkeypatch.setattr(service, "stop_server", lambda server: events.append("stop"))
    monkeypatch.setattr(service, "closed_point", point)
    monkeypatch.setattr(service, "open_point", open_point)
    plan = Plan(tmp_path, [], 0, 1, [1, 8], [5.0], ["continuous"], 0.0, 1.0, 1.0, 0, tmp_path)
    report = Report(environment={}, reference=None)
    ref = FakeReference([100.0, 300.0, 500.0], events)
    report.reference = ref.reference
    run_mode("continuous", plan, report, lambda line: None, ref)
    assert events == [
        "ready",
        "reference 100",
        "1 clients",
        "idle",
        "reference 300",
        "8 clients",
        "idle",
        "reference 500",
        "5/s",  # the open loop needs no reference
        "idle",
        "stop",
    ]
    assert report.reference.runs == [100.0, 300.0, 500.0]
    assert report.reference.sentences_per_s == 300.0
    add_ratios(report.closed_loop, report.reference)
    assert [r.ct2_sentences_per_s for r in report.closed_loop] == [200.0, 400.0]
    assert [r.vs_ct2 for r in report.closed_loop] == pytest.approx([0.3, 0.15])


def test_no_reference_no_ratio(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """--no-ct2: the points carry no reference and no ×CT2."""
    server = exited_server("none", monkeypatch, tmp_path)
    monkeypatch.setattr(service, "start_server", lambda *args: server)
    monkeypatch.setattr(service, "wait_ready", lambda server: None)
    monkeypatch.setattr(service, "wait_idle", lambda server: None)
    monkeypatch.setattr(service, "stop_server", lambda server: None)
    monkeypatch.setattr(service, "closed_point", lambda server, plan, clients: closed("none", clients, 9.0))
    plan = Plan(tmp_path, [], 0, 1, [1], [], [], 0.0, 1.0, 1.0, 0, tmp_path)
    report = Report(environment={}, reference=None)
    run_mode("none", plan, report, lambda line: None)
    add_ratios(report.closed_loop, report.reference)
    assert report.closed_loop[0].ct2_sentences_per_s is None and report.closed_loop[0].vs_ct2 is None


# -- the HTTP client against a tiny server ----------------------------------------------------------
def test_parse_head_and_check_answer() -> None:
    status, headers = parse_head(
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 2\r\nRetry-After: 1\r\n\r\n"
    )
    assert status == 503 and headers == {"content-length": "2", "retry-after": "1"}
    with pytest.raises(ProtocolError):
        parse_head(b"garbage\r\n\r\n")
    assert check_answer(200, b'{"translatedText": "A dog."}') is None
    assert check_answer(200, b'{"error": "x"}') == "no translatedText"
    assert check_answer(200, b"not json") == "invalid JSON"
    assert check_answer(503, b'{"error": "busy"}') == "HTTP 503"


@dataclass
class FakeServer:
    port: int = 0
    connections: int = 0
    bodies: list[dict[str, object]] = field(default_factory=list)


async def answer(server: FakeServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A keep-alive HTTP/1.1 server: 200 with the text upper-cased, 503 for the text "busy"."""
    server.connections += 1
    try:
        while True:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
            length = next(
                int(h.split(":")[1]) for h in head.split("\r\n") if h.lower().startswith("content-length")
            )
            body = json.loads(await reader.readexactly(length))
            server.bodies.append(body)
            status, reply = (
                ("503 Service Unavailable", {"error": "busy"})
                if body["q"] == "busy"
                else ("200 OK", {"translatedText": str(body["q"]).upper()})
            )
            data = json.dumps(reply).encode()
            head = (
                f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n"
            )
            writer.write(head.encode() + data)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass  # the client closed the connection
    finally:
        writer.close()


@asynccontextmanager
async def fake_server() -> AsyncIterator[FakeServer]:
    state = FakeServer()
    server = await asyncio.start_server(lambda r, w: answer(state, r, w), "127.0.0.1", 0)
    state.port = server.sockets[0].getsockname()[1]
    async with server:
        yield state


def run_against_server(work: Callable[[FakeServer], Awaitable[T]]) -> tuple[T, FakeServer]:
    async def main() -> tuple[T, FakeServer]:
        async with fake_server() as server:
            return await work(server), server

    return asyncio.run(main())


def test_client_keeps_the_connection_alive() -> None:
    async def two_requests(server: FakeServer) -> list[tuple[int, bytes]]:
        conn = await HttpConnection.open("127.0.0.1", server.port)
        try:
            return [
                await conn.post("/translate", request_body("Ein Hund.", 1)),
                await conn.post("/translate", request_body("busy", 1)),
            ]
        finally:
            conn.close()

    answers, server = run_against_server(two_requests)
    assert answers[0] == (200, b'{"translatedText": "EIN HUND."}')
    assert answers[1][0] == 503
    assert server.connections == 1
    assert server.bodies[0] == {"q": "Ein Hund.", "source": "de", "target": "en", "beam_size": 1}


def test_closed_loop_counts_answers_and_errors() -> None:
    bodies = [request_body(q, 1) for q in ("eins", "zwei", "busy", "vier")]

    async def load(server: FakeServer) -> ClosedLoopResult:
        records, window = await closed_loop(server.port, bodies, clients=2, warmup_s=0.05, duration_s=0.3)
        return closed_loop_result("continuous", 2, records, window, CPU)

    result, server = run_against_server(load)
    assert server.connections == 2  # one keep-alive connection per client
    assert result.completed > 10
    assert set(result.error_kinds) == {"HTTP 503"}
    # Clients cycle through the four sentences (one in four is "busy"), give or take the window edges.
    assert result.errors == pytest.approx(result.completed / 3, rel=0.3, abs=3)
    assert {b["q"] for b in server.bodies} == {"eins", "zwei", "busy", "vier"}


def test_open_loop_sends_at_the_rate_asked() -> None:
    bodies = [request_body("eins", 1)]

    async def load(server: FakeServer) -> tuple[list[Record], tuple[float, float], int]:
        return await open_loop(server.port, bodies, rate=200.0, warmup_s=0.05, duration_s=0.5, drain_s=1.0)

    (records, window, opened), server = run_against_server(load)
    result = open_loop_result("continuous", 200.0, records, window, opened, CPU)
    assert 50 <= result.sent <= 160  # Poisson with mean 100
    assert result.errors == 0 and result.completed == result.sent
    assert opened == server.connections < result.sent  # idle connections are reused


def test_server_cpu_and_memory_count_its_child_processes() -> None:
    """Model replicas run in child processes of the server: their CPU time and memory are the
    server's too."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        me = os.getpid()
        assert child.pid in process_tree(me)
        deadline = time.monotonic() + 10
        while (read_memory(child.pid)[0] or 0.0) < 1.0:  # the interpreter has started
            assert time.monotonic() < deadline
            time.sleep(0.05)
        own = read_memory_of_one(me)
        total, child_hwm = read_memory(me)[0], read_memory(child.pid)[0]
        assert total is not None and child_hwm is not None
        assert total == pytest.approx(own + child_hwm, rel=0.05)
        cpu = process_cpu_seconds(me)
        assert cpu is not None and cpu >= os.times().user + os.times().system - 0.05
    finally:
        child.kill()
        child.wait()


def read_memory_of_one(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")
