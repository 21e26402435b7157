"""Service load: throughput and latency of the running HTTP service under many concurrent clients.

For each batching mode the script starts its own server (``python -m uvicorn app.main:app
--no-access-log`` as the Dockerfile does, on a free loopback port, CPU,
``NMT_THREADS=--server-threads``, log in ``--log-dir``), waits for ``/health/ready`` and sends
``POST /translate`` requests with one German sentence each (test_2016_flickr, 1,000 sentences by
default; ``{"q", "source": "de", "target": "en", "beam_size"}``; every line of test_2016 is one
sentence for the service's splitter, so requests/s are sentences/s). The modes:

- ``none``: ``NMT_MAX_BATCH_SIZE=1``, one sentence decoded at a time (batching disabled);
- ``dynamic``: ``NMT_BATCHING=dynamic``, batch by batch, collecting for ``NMT_MAX_WAIT_MS``;
- ``continuous``: ``NMT_BATCHING=continuous``, sentences join and leave every step, in one model
  worker process (``NMT_REPLICAS=1``; ``none`` and ``dynamic`` too);
- ``replicas``: continuous batching in ``NMT_REPLICAS`` = one model worker per usable core, each
  with its own batch and one thread (with ``--server-threads 0``): the service's default.

Measured per mode:

- **closed loop**, for each ``--clients`` count: every client sends a request, waits for the
  answer and sends the next, for ``--warmup`` seconds (not counted) and then ``--duration``
  seconds. Requests that complete inside the measured window count; at its end the clients
  disconnect, the server drops their unfinished sentences and the script waits until it is idle.
  Reported: sentences/s, latency p50/p95/p99/mean, errors (non-200 answers and exceptions), the
  ratio to the CTranslate2 reference measured around the point (below) and to the ``none`` mode at
  the same client count.
- **open loop** (``--open-loop-modes``, continuous only by default), for each ``--rates`` value:
  requests at Poisson arrival times regardless of the answers, each on an idle keep-alive
  connection or a new one. Latency runs from the *scheduled* send time, so a late generator or a
  saturated server shows up as latency instead of silently lowering the load (no coordinated
  omission). Requests scheduled in the window are awaited up to ``--drain`` seconds afterwards;
  reported: achieved answers/s inside the window, latency percentiles, errors.
- **server memory**: ``VmHWM`` (peak resident set) and ``VmRSS`` of the server process from
  ``/proc/<pid>/status`` after the mode's measurements, summed with its child processes'.
- **CPU**, per measurement point, in cores (CPU-seconds per second): the load generator (this
  process: an asyncio HTTP/1.1 client of a few dozen lines, one keep-alive connection per client,
  because it shares the machine with the server), the server process, and every other process.

The reference: CTranslate2 ``translate_batch`` on the same weights (``model.export_ctranslate2``,
float32), same sentences, same beam, batch 64, same thread count, text to text
(``benchmarks.engine.ctranslate2_engine``), in one worker process kept for the whole benchmark
(exported and warmed up once). On a shared VM it moves by ±15% from run to run, so it is
interleaved with the server points instead of measured once: once per mode when its server is ready,
then again after every closed-loop point once the server is idle (the worker waits on its pipe,
using no CPU, while a server is measured). A measurement is the median of ``--repeats`` timed runs
of all the sentences; a point's ×CT2 divides by the mean of the measurements just before and just
after it, and the report gives the median, min-max and count of all of them. Cost: one measurement
per closed-loop point plus one per mode, each ``--repeats`` × ~3-4 s for 1,000 sentences.

    # ~17 min on 2 cores (24 reference measurements included), plus up to --drain per open-loop
    # rate that overloads the server
    .venv/bin/python -m benchmarks.service --json service.json --plot service.png
    .venv/bin/python -m benchmarks.service --modes continuous --clients 4 --duration 3 --warmup 1 \\
        --rates 5 --no-ct2                                                          # smoke run
    .venv/bin/python -m benchmarks.service --modes continuous --clients 4 --duration 3 --warmup 1 \\
        --rates 5 --limit 64                                                        # with the reference
    .venv/bin/python -m benchmarks.service --modes none continuous --clients 1 32 --open-loop-modes
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import random
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.common import DATA, DEFAULT_MODEL, REPO, OtherLoad, cpu_busy_seconds, cpu_name
from benchmarks.load import free_port

if TYPE_CHECKING:  # imported when the reference starts: --no-ct2 runs never load torch or CTranslate2
    from benchmarks.engine import Worker

HOST = "127.0.0.1"

MODES: dict[str, dict[str, str]] = {
    "none": {"NMT_MAX_BATCH_SIZE": "1", "NMT_REPLICAS": "1"},
    "dynamic": {"NMT_BATCHING": "dynamic", "NMT_REPLICAS": "1"},
    "continuous": {"NMT_BATCHING": "continuous", "NMT_REPLICAS": "1"},
    # Continuous batching in one model worker per core, one thread each (the default, app/serving).
    "replicas": {"NMT_BATCHING": "continuous", "NMT_REPLICAS": str(len(os.sched_getaffinity(0)))},
}
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
IDLE_TIMEOUT_S = 60.0
# uvicorn closes keep-alive connections idle for 5 s (timeout_keep_alive); reusing one just as it
# closes would turn into a spurious error, so the open loop's pool drops connections idle this long.
MAX_IDLE_S = 4.0
MIB = 1024 * 1024


# -- results ----------------------------------------------------------------------------------------
@dataclass
class LatencyStats:
    count: int
    mean_ms: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    max_ms: float


@dataclass
class CpuUsage:
    """CPU used during one measurement point, in cores (CPU-seconds per wall second)."""

    wall_s: float
    client_cores: float  # this process: the load generator
    server_cores: float | None  # the server process (None when /proc is not readable)
    other_cores: float | None  # everything else on the machine (None without /proc/stat)


@dataclass
class ClosedLoopResult:
    mode: str
    clients: int
    duration_s: float
    completed: int  # successful answers that arrived in the measured window
    errors: int
    error_kinds: dict[str, int]
    sentences_per_s: float
    latency: LatencyStats
    cpu: CpuUsage
    # CTranslate2 sentences/s around this point: the mean of the reference measured just before and
    # just after it (None without the reference); the machine's speed drifts too much to use one
    # value for the whole run.
    ct2_sentences_per_s: float | None = None
    vs_ct2: float | None = None  # sentences/s / CTranslate2 sentences/s (the above, else the median)
    vs_no_batching: float | None = None  # sentences/s / mode "none" sentences/s at the same clients


@dataclass
class OpenLoopResult:
    mode: str
    rate: float  # requests/s offered
    duration_s: float
    sent: int  # requests scheduled in the measured window
    completed: int  # of those, successful answers (whenever they arrived)
    errors: int
    error_kinds: dict[str, int]
    achieved_per_s: float  # successful answers that arrived in the measured window, per second
    latency: LatencyStats  # from the scheduled send time
    connections: int  # connections the generator had to open
    cpu: CpuUsage


@dataclass
class ServerResult:
    mode: str
    peak_rss_mib: float | None  # VmHWM
    rss_mib: float | None  # VmRSS after the measurements
    cpu_s: float | None  # CPU time over the server's life: loading, warm-up, every point, idle waits


@dataclass
class Reference:
    engine: str
    sentences: int
    beam: int
    batch_size: int
    threads: int
    repeats: int  # timed runs per measurement; a measurement is their median
    runs: list[float] = field(default_factory=list)  # sentences/s of every measurement, in order
    sentences_per_s: float = field(init=False)  # median of runs (NaN before the first)

    def __post_init__(self) -> None:
        self.sentences_per_s = statistics.median(self.runs) if self.runs else math.nan

    def add(self, sentences_per_s: float) -> None:
        self.runs.append(sentences_per_s)
        self.sentences_per_s = statistics.median(self.runs)


@dataclass
class Report:
    environment: dict[str, Any]
    reference: Reference | None
    closed_loop: list[ClosedLoopResult] = field(default_factory=list)
    open_loop: list[OpenLoopResult] = field(default_factory=list)
    servers: list[ServerResult] = field(default_factory=list)


# -- statistics -------------------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation between closest ranks (numpy's
    default); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(latencies_s: Sequence[float]) -> LatencyStats:
    ms = [1000.0 * s for s in latencies_s]
    return LatencyStats(
        count=len(ms),
        mean_ms=statistics.fmean(ms) if ms else math.nan,
        p50_ms=percentile(ms, 50),
        p95_ms=percentile(ms, 95),
        p99_ms=percentile(ms, 99),
        max_ms=max(ms) if ms else math.nan,
    )


@dataclass(slots=True)
class Record:
    """One request: when it started (or was scheduled), when it ended, and its error if any."""

    start: float
    end: float
    error: str | None


def in_window(t: float, start: float, end: float) -> bool:
    return start <= t <= end


def closed_loop_result(
    mode: str, clients: int, records: Sequence[Record], window: tuple[float, float], cpu: CpuUsage
) -> ClosedLoopResult:
    """Requests that *ended* in the window: their count over the window is the steady-state rate."""
    start, end = window
    counted = [r for r in records if in_window(r.end, start, end)]
    ok = [r for r in counted if r.error is None]
    errors = Counter(r.error for r in counted if r.error is not None)
    return ClosedLoopResult(
        mode=mode,
        clients=clients,
        duration_s=end - start,
        completed=len(ok),
        errors=sum(errors.values()),
        error_kinds=dict(errors),
        sentences_per_s=len(ok) / (end - start),
        latency=summarize([r.end - r.start for r in ok]),
        cpu=cpu,
    )


def open_loop_result(
    mode: str,
    rate: float,
    records: Sequence[Record],
    window: tuple[float, float],
    connections: int,
    cpu: CpuUsage,
) -> OpenLoopResult:
    """Requests *scheduled* in the window: every one of them counts, however late its answer, so a
    saturated server cannot hide its slowest requests."""
    start, end = window
    sent = [r for r in records if start <= r.start < end]
    ok = [r for r in sent if r.error is None]
    errors = Counter(r.error for r in sent if r.error is not None)
    arrived = [r for r in records if r.error is None and in_window(r.end, start, end)]
    return OpenLoopResult(
        mode=mode,
        rate=rate,
        duration_s=end - start,
        sent=len(sent),
        completed=len(ok),
        errors=sum(errors.values()),
        error_kinds=dict(errors),
        achieved_per_s=len(arrived) / (end - start),
        latency=summarize([r.end - r.start for r in ok]),
        connections=connections,
        cpu=cpu,
    )


def add_ratios(results: Sequence[ClosedLoopResult], reference: Reference | None) -> None:
    """×CT2 against each point's own adjacent reference where it has one (the machine's speed when
    the point ran), else against the median of all the reference's measurements."""
    baseline = {r.clients: r.sentences_per_s for r in results if r.mode == "none"}
    for r in results:
        ct2 = r.ct2_sentences_per_s
        if ct2 is None and reference is not None:
            ct2 = reference.sentences_per_s
        if ct2 is not None and ct2 > 0:  # NaN (no measurement) fails the comparison too
            r.vs_ct2 = r.sentences_per_s / ct2
        if r.mode != "none" and baseline.get(r.clients):
            r.vs_no_batching = r.sentences_per_s / baseline[r.clients]


# -- a minimal HTTP/1.1 client ----------------------------------------------------------------------
# httpx or aiohttp would spend more CPU per request than the server's tokenizer does, and the
# generator shares the 2 cores with the server; this client does only what the benchmark needs.
class ProtocolError(Exception):
    pass


class HttpConnection:
    """One keep-alive HTTP/1.1 connection; one request at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str) -> None:
        self.reader, self.writer, self.host = reader, writer, host
        self.closed = False
        self.last_used = time.perf_counter()

    @classmethod
    async def open(cls, host: str, port: int) -> HttpConnection:
        reader, writer = await asyncio.open_connection(host, port)
        # Small requests and answers: do not let Nagle's algorithm hold them back.
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(reader, writer, f"{host}:{port}")

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        """Send a JSON body; return the status code and the response body."""
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        self.writer.write(head.encode("ascii") + body)
        await self.writer.drain()
        status, headers = parse_head(await self.reader.readuntil(b"\r\n\r\n"))
        if "content-length" not in headers:  # the service always sends one (no chunked answers)
            raise ProtocolError("response without Content-Length")
        payload = await self.reader.readexactly(int(headers["content-length"]))
        self.last_used = time.perf_counter()
        if headers.get("connection", "").lower() == "close":
            self.close()
        return status, payload

    @property
    def usable(self) -> bool:
        """Open, not closed by the server, and not about to hit the server's keep-alive timeout."""
        idle = time.perf_counter() - self.last_used
        return not self.closed and not self.reader.at_eof() and idle < MAX_IDLE_S

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.writer.close()


def parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    """Status code and lower-cased headers of a response head (status line + headers + blank line)."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise ProtocolError(f"bad status line {lines[0]!r}")
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


def check_answer(status: int, payload: bytes) -> str | None:
    """None for a successful translation, else a short error kind (counted per kind)."""
    if status != 200:
        return f"HTTP {status}"
    try:
        answer = json.loads(payload)
    except ValueError:
        return "invalid JSON"
    if not isinstance(answer, dict) or "translatedText" not in answer:
        return "no translatedText"
    return None


def request_body(sentence: str, beam: int) -> bytes:
    return json.dumps({"q": sentence, "source": "de", "target": "en", "beam_size": beam}).encode()


# Failures of one request that the benchmark counts instead of crashing on (ValueError: a response
# head that does not parse, e.g. a non-numeric Content-Length).
REQUEST_ERRORS = (OSError, EOFError, asyncio.LimitOverrunError, ProtocolError, ValueError)


async def exchange(conn: HttpConnection, body: bytes) -> str | None:
    """One request on ``conn``; the error kind or None. A failed connection is closed."""
    try:
        return check_answer(*await conn.post("/translate", body))
    except REQUEST_ERRORS as e:
        conn.close()
        return type(e).__name__


# -- closed and open loop ---------------------------------------------------------------------------
async def closed_loop(
    port: int, bodies: Sequence[bytes], clients: int, warmup_s: float, duration_s: float
) -> tuple[list[Record], tuple[float, float]]:
    """``clients`` clients, each sending its next request when the previous one is answered.
    Returns every finished request and the measured window (perf_counter times)."""
    t0 = time.perf_counter()
    window = (t0 + warmup_s, t0 + warmup_s + duration_s)
    records: list[Record] = []
    stride = max(1, len(bodies) // clients)  # so that clients send different sentences

    async def client(i: int) -> None:
        conn: HttpConnection | None = None
        k = i * stride
        try:
            while time.perf_counter() < window[1]:
                start = time.perf_counter()
                try:
                    if conn is None or conn.closed:
                        conn = await HttpConnection.open(HOST, port)
                except OSError as e:
                    records.append(Record(start, time.perf_counter(), type(e).__name__))
                    await asyncio.sleep(0.1)  # the server refuses connections: do not spin
                    continue
                error = await exchange(conn, bodies[k % len(bodies)])
                records.append(Record(start, time.perf_counter(), error))
                k += 1
        finally:
            if conn is not None:
                conn.close()

    tasks = [asyncio.create_task(client(i)) for i in range(clients)]
    await asyncio.sleep(max(0.0, window[1] - time.perf_counter()))
    # Requests still running at the end are abandoned: the server sees the disconnect and drops
    # them, so the next measurement starts on an idle server instead of waiting for a backlog.
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return records, window


class ConnectionPool:
    """Idle keep-alive connections for the open loop; a new one whenever none is idle."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.idle: list[HttpConnection] = []
        self.opened = 0

    async def take(self) -> HttpConnection:
        while self.idle:
            conn = self.idle.pop()  # the most recently used: the least likely to be timed out
            if conn.usable:
                return conn
            conn.close()
        self.opened += 1
        return await HttpConnection.open(HOST, self.port)

    def give_back(self, conn: HttpConnection) -> None:
        if conn.closed:
            return
        self.idle.append(conn)

    def close(self) -> None:
        for conn in self.idle:
            conn.close()
        self.idle.clear()


async def open_loop(
    port: int,
    bodies: Sequence[bytes],
    rate: float,
    warmup_s: float,
    duration_s: float,
    drain_s: float,
    seed: int = 0,
) -> tuple[list[Record], tuple[float, float], int]:
    """Requests at Poisson arrival times (``rate`` per second), whatever the server answers.
    Returns every request (start = scheduled time), the measured window and the connections opened."""
    rng = random.Random(seed)
    pool = ConnectionPool(port)
    records: list[Record] = []
    running: set[asyncio.Task[None]] = set()

    async def send(scheduled: float, body: bytes) -> None:
        conn: HttpConnection | None = None
        try:
            conn = await pool.take()
            error = await exchange(conn, body)
            records.append(Record(scheduled, time.perf_counter(), error))
            pool.give_back(conn)
        except OSError as e:  # could not connect
            records.append(Record(scheduled, time.perf_counter(), type(e).__name__))
        except asyncio.CancelledError:  # not answered within the drain time
            records.append(Record(scheduled, time.perf_counter(), "unfinished"))
            if conn is not None:
                conn.close()
            raise

    t0 = time.perf_counter()
    window = (t0 + warmup_s, t0 + warmup_s + duration_s)
    scheduled, k = t0, 0
    while True:
        scheduled += rng.expovariate(rate)
        if scheduled >= window[1]:
            break
        # Sleeping 0 still yields, so answers are read even when the generator runs behind.
        await asyncio.sleep(max(0.0, scheduled - time.perf_counter()))
        task = asyncio.create_task(send(scheduled, bodies[k % len(bodies)]))
        running.add(task)
        task.add_done_callback(running.discard)
        k += 1
    if running:
        _, pending = await asyncio.wait(set(running), timeout=drain_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    pool.close()
    return records, window, pool.opened


# -- CPU accounting ---------------------------------------------------------------------------------
def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (the server's model workers run in child processes)."""
    pids, i = [pid], 0
    while i < len(pids):
        for task in Path(f"/proc/{pids[i]}/task").glob("*/children"):
            with contextlib.suppress(OSError, ValueError):
                pids += [int(c) for c in task.read_text().split()]
        i += 1
    return pids


def process_cpu_seconds(pid: int) -> float | None:
    """utime + stime of a process and its descendants (Linux /proc/<pid>/stat, all threads), or
    None when the process is gone."""
    total = None
    for p in process_tree(pid):
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()  # the command name may contain spaces
        total = (total or 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


@contextmanager
def cpu_meter(server_pid: int) -> Iterator[list[CpuUsage]]:
    """Yields a list that holds the point's ``CpuUsage`` once the block is done."""
    out: list[CpuUsage] = []
    wall, own = time.perf_counter(), own_cpu_seconds()
    server, machine = process_cpu_seconds(server_pid), cpu_busy_seconds()
    yield out
    wall = time.perf_counter() - wall
    own = own_cpu_seconds() - own
    server_end, machine_end = process_cpu_seconds(server_pid), cpu_busy_seconds()
    server_s = None if server is None or server_end is None else server_end - server
    other = None
    if machine is not None and machine_end is not None and server_s is not None:
        other = max(0.0, machine_end - machine - own - server_s) / wall
    out.append(CpuUsage(wall, own / wall, None if server_s is None else server_s / wall, other))


# -- the server -------------------------------------------------------------------------------------
@dataclass
class Server:
    mode: str
    process: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def server_env(mode: str, model: Path, threads: int, beam: int) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("NMT_")}
    return {
        **clean,
        "NMT_DEVICE": "cpu",
        "NMT_MODEL_DIR": str(model),
        "NMT_THREADS": str(threads),
        "NMT_DEFAULT_BEAM_SIZE": str(beam),
        "NMT_MAX_BEAM_SIZE": str(max(8, beam)),
        # Large enough that the heaviest load here is queued, not refused or timed out: the
        # benchmark measures the batching, not the overload protection.
        "NMT_MAX_QUEUE": "4096",
        "NMT_REQUEST_TIMEOUT_S": "120",
        **MODES[mode],
    }


def start_server(mode: str, model: Path, threads: int, beam: int, log_dir: Path) -> Server:
    port = free_port()
    log = log_dir / f"server-{mode}.log"
    with log.open("wb") as out:  # a file, not a pipe: a full pipe would block the server
        process = subprocess.Popen(
            # As the Dockerfile runs it (no access log).
            [
                sys.executable,
                "-m",
                "uvicorn",
                "app.main:app",
                "--host",
                HOST,
                "--port",
                str(port),
                "--no-access-log",
            ],
            cwd=REPO,
            env=server_env(mode, model, threads, beam),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return Server(mode, process, port, log)


def http_get(url: str, timeout_s: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def wait_ready(server: Server, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(
                f"{server.mode} server exited with {server.process.returncode}:\n{server.log_tail()}"
            )
        try:
            if http_get(f"{server.url}/health/ready", timeout_s=1.0)[0] == 200:
                return
        except (urllib.error.URLError, OSError):
            pass  # not listening yet
        time.sleep(0.2)
    raise RuntimeError(f"{server.mode} server not ready after {timeout_s:.0f} s:\n{server.log_tail()}")


def metric_value(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def wait_idle(server: Server, timeout_s: float = IDLE_TIMEOUT_S) -> None:
    """Until no sentence is queued or decoded: abandoned work of one point must not slow the next."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = http_get(f"{server.url}/metrics")[1]
        if (
            metric_value(text, "nmt_queue_depth_sentences") == 0
            and metric_value(text, "nmt_active_sequences") == 0
        ):
            return
        time.sleep(0.1)
    print(f"warning: {server.mode} server still busy after {timeout_s:.0f} s", file=sys.stderr)


def read_memory(pid: int) -> tuple[float | None, float | None]:
    """VmHWM and VmRSS in MiB (Linux), summed over the process and its descendants (each one's
    own peak), None where not available."""
    values: dict[str, float] = {}
    for p in process_tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                key, _, rest = line.partition(":")
                if key in ("VmHWM", "VmRSS"):  # the kernel reports kB
                    values[key] = values.get(key, 0.0) + int(rest.split()[0]) * 1024 / MIB
        except OSError:
            continue
    return values.get("VmHWM"), values.get("VmRSS")


def stop_server(server: Server) -> None:
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
    try:
        server.process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()


# -- the reference ----------------------------------------------------------------------------------
class Ct2Reference:
    """CTranslate2 sentences/s on the same weights, measured as often as asked by one process kept
    for the whole benchmark (exported and warmed up once, not per measurement): ``benchmarks.engine``'s
    worker, because with torch's OpenMP runtime loaded beside CTranslate2's one run of the reference
    read 178 sentences/s, against 311-399 in its own process. Between measurements the worker blocks
    on its pipe, so it takes no CPU from the servers (``Worker`` pauses ``SETTLE_S`` after each run,
    until Intel OpenMP's threads stop spinning). torch and CTranslate2 are imported in ``__enter__``
    so that --no-ct2 runs (and the load generator) never load them. Every measurement is appended to
    ``self.reference``."""

    def __init__(
        self,
        model: Path,
        texts: list[str],
        beam: int,
        batch: int,
        threads: int,
        repeats: int,
        max_length: int,
    ) -> None:
        self.model, self.texts, self.beam, self.batch = model, texts, beam, batch
        self.threads, self.max_length = threads, max_length
        self.reference = Reference("ctranslate2", len(texts), beam, batch, threads, repeats)
        self.stack = contextlib.ExitStack()
        self.worker: Worker | None = None

    def __enter__(self) -> Ct2Reference:
        from benchmarks.engine import Worker
        from model.export_ctranslate2 import export

        with self.stack as stack:  # on any failure here: stop what started, remove the export
            tmp = stack.enter_context(tempfile.TemporaryDirectory())
            ct2_dir = export(self.model, Path(tmp) / "ct2", quantization="float32")
            spec = {
                "model": str(self.model),
                "ct2_dir": str(ct2_dir),
                "threads": self.threads,
                "device": "cpu",
                "dtype": "float32",
                "ct2_compute_type": "float32",
                "max_length": self.max_length,
            }
            worker = Worker("ctranslate2", spec)
            stack.callback(worker.close)
            worker(self.texts[: max(self.batch, 8)], self.beam, self.batch)  # warm-up: allocator, threads
            self.worker = worker
            self.stack = stack.pop_all()  # success: keep the worker (and the export) until __exit__
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.close()  # self.worker stays, for cpu_seconds

    @property
    def cpu_seconds(self) -> float:
        """CPU time the worker spent on its runs, the warm-up included (not its start-up)."""
        return 0.0 if self.worker is None else self.worker.cpu_seconds

    def measure(self) -> float:
        """One measurement: the median of ``repeats`` timed runs of all the sentences, in sentences/s."""
        assert self.worker is not None, "measure() outside the with block"
        runs = [self.worker(self.texts, self.beam, self.batch).seconds for _ in range(self.reference.repeats)]
        sentences_per_s = len(self.texts) / statistics.median(runs)
        self.reference.add(sentences_per_s)
        return sentences_per_s


# -- running a mode ---------------------------------------------------------------------------------
@dataclass
class Plan:
    model: Path
    bodies: list[bytes]
    threads: int
    beam: int
    clients: list[int]
    rates: list[float]
    open_loop_modes: list[str]
    warmup_s: float
    duration_s: float
    drain_s: float
    seed: int
    log_dir: Path


def closed_point(server: Server, plan: Plan, clients: int) -> ClosedLoopResult:
    with cpu_meter(server.process.pid) as cpu:
        records, window = asyncio.run(
            closed_loop(server.port, plan.bodies, clients, plan.warmup_s, plan.duration_s)
        )
    return closed_loop_result(server.mode, clients, records, window, cpu[0])


def open_point(server: Server, plan: Plan, rate: float) -> OpenLoopResult:
    with cpu_meter(server.process.pid) as cpu:
        records, window, connections = asyncio.run(
            open_loop(server.port, plan.bodies, rate, plan.warmup_s, plan.duration_s, plan.drain_s, plan.seed)
        )
    return open_loop_result(server.mode, rate, records, window, connections, cpu[0])


def measure_reference(reference: Ct2Reference, progress: Callable[[str], None]) -> float:
    sentences_per_s = reference.measure()
    progress(f"CTranslate2 reference: {sentences_per_s:.1f} sentences/s")
    return sentences_per_s


def run_mode(
    mode: str,
    plan: Plan,
    report: Report,
    progress: Callable[[str], None],
    reference: Ct2Reference | None = None,
) -> None:
    """Start the mode's server, measure every point on it, read its memory, stop it. With a
    reference: measure it once the server is ready and after every closed-loop point (with the
    server idle), and give each point the mean of the measurements just before and after it."""
    server = start_server(mode, plan.model, plan.threads, plan.beam, plan.log_dir)
    try:
        wait_ready(server)
        before = None if reference is None else measure_reference(reference, progress)
        for clients in plan.clients:
            closed = closed_point(server, plan, clients)
            report.closed_loop.append(closed)
            progress(
                f"{mode} closed loop, {clients} clients: {closed.sentences_per_s:.1f} sentences/s, "
                f"p50 {closed.latency.p50_ms:.0f} ms, {closed.errors} errors"
            )
            wait_idle(server)  # the reference must not share the cores with abandoned requests
            if reference is not None and before is not None:
                after = measure_reference(reference, progress)
                closed.ct2_sentences_per_s = (before + after) / 2
                before = after
        for rate in plan.rates if mode in plan.open_loop_modes else []:
            opened = open_point(server, plan, rate)
            report.open_loop.append(opened)
            progress(
                f"{mode} open loop, {rate:g}/s: {opened.achieved_per_s:.1f}/s answered, "
                f"p50 {opened.latency.p50_ms:.0f} ms, {opened.errors} errors"
            )
            wait_idle(server)
        pid = server.process.pid
        report.servers.append(ServerResult(mode, *read_memory(pid), process_cpu_seconds(pid)))
    finally:
        stop_server(server)


# -- reporting --------------------------------------------------------------------------------------
def fmt(value: float | None, spec: str = ".0f", suffix: str = "") -> str:
    return "—" if value is None or math.isnan(value) else f"{value:{spec}}{suffix}"


def cpu_cells(cpu: CpuUsage) -> str:
    return f"{cpu.client_cores:.2f} | {fmt(cpu.server_cores, '.2f')} | {fmt(cpu.other_cores, '.2f')}"


def closed_loop_table(results: Sequence[ClosedLoopResult]) -> str:
    lines = [
        "| mode | clients | sentences/s | p50 ms | p95 ms | p99 ms | mean ms | errors | CT2 sent/s | ×CT2 "
        "| ×no batching | generator cores | server cores | other cores |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lat = r.latency
        lines.append(
            f"| {r.mode} | {r.clients} | {r.sentences_per_s:,.1f} | {fmt(lat.p50_ms)} | {fmt(lat.p95_ms)} "
            f"| {fmt(lat.p99_ms)} | {fmt(lat.mean_ms)} | {r.errors} | {fmt(r.ct2_sentences_per_s, ',.1f')} "
            f"| {fmt(r.vs_ct2, '.2f', '×')} | {fmt(r.vs_no_batching, '.2f', '×')} | {cpu_cells(r.cpu)} |"
        )
    return "\n".join(lines)


def open_loop_table(results: Sequence[OpenLoopResult]) -> str:
    lines = [
        "| mode | rate/s | sent | achieved/s | p50 ms | p95 ms | p99 ms | errors | connections "
        "| generator cores | server cores | other cores |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lat = r.latency
        lines.append(
            f"| {r.mode} | {r.rate:g} | {r.sent} | {r.achieved_per_s:,.1f} | {fmt(lat.p50_ms)} "
            f"| {fmt(lat.p95_ms)} | {fmt(lat.p99_ms)} | {r.errors} | {r.connections} | {cpu_cells(r.cpu)} |"
        )
    return "\n".join(lines)


def server_table(results: Sequence[ServerResult]) -> str:
    lines = ["| mode | peak RSS MiB (VmHWM) | RSS MiB at the end | CPU s in all |", "|---|---:|---:|---:|"]
    lines += [
        f"| {r.mode} | {fmt(r.peak_rss_mib)} | {fmt(r.rss_mib)} | {fmt(r.cpu_s, '.1f')} |" for r in results
    ]
    return "\n".join(lines)


def error_lines(report: Report) -> list[str]:
    closed = [(f"{r.mode}, {r.clients} clients", r.error_kinds) for r in report.closed_loop]
    opened = [(f"{r.mode}, {r.rate:g} req/s", r.error_kinds) for r in report.open_loop]
    return [f"errors ({point}): {kinds}" for point, kinds in closed + opened if kinds]


def summary_line(env: dict[str, Any]) -> str:
    other = env["other_cpu_fraction"]
    load = "unknown" if other is None else f"{other:.0%}"
    return (
        f"{env['cpu']}, {env['cpus']} CPUs; torch {env['torch']}, CTranslate2 {env['ctranslate2']}; "
        f"{env['threads']} threads; model {env['model']}; beam {env['beam']}; {env['sentences']} sentences; "
        f"{env['duration_s']:g} s per point after {env['warmup_s']:g} s warm-up; other processes used "
        f"{load} of the CPUs (servers and this load generator excluded: see the cores columns)"
    )


def render(report: Report) -> str:
    parts = [summary_line(report.environment), ""]
    ref = report.reference
    if ref is not None:
        search = "greedy" if ref.beam == 1 else f"beam {ref.beam}"
        spread = f"{min(ref.runs):,.1f}-{max(ref.runs):,.1f}" if ref.runs else "—"
        repeats = f", each the median of {ref.repeats} runs" if ref.repeats > 1 else ""
        parts += [
            f"Reference: CTranslate2 translate_batch, {search}, batch {ref.batch_size}, "
            f"{ref.threads} threads, float32, {ref.sentences} sentences: "
            f"**{fmt(ref.sentences_per_s, ',.1f')} sentences/s** (median of {len(ref.runs)} measurements "
            f"interleaved with the server points, {spread}{repeats}); a closed-loop point's ×CT2 divides "
            "by the mean of the measurements just before and after it (CT2 sent/s)",
            "",
        ]
    parts += ["Closed loop", "", closed_loop_table(report.closed_loop), ""]
    if report.open_loop:
        parts += [
            "Open loop (latency from the scheduled send time)",
            "",
            open_loop_table(report.open_loop),
            "",
        ]
    parts += ["Server memory and CPU", "", server_table(report.servers)]
    errors = error_lines(report)
    return "\n".join(parts + ([""] + errors if errors else []))


def plot(report: Report, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    modes = list(dict.fromkeys(r.mode for r in report.closed_loop))
    for i, mode in enumerate(modes):
        rows = sorted((r for r in report.closed_loop if r.mode == mode), key=lambda r: r.clients)
        clients = [r.clients for r in rows]
        color = f"C{i}"
        left.plot(clients, [r.sentences_per_s for r in rows], "o-", color=color, label=mode)
        right.plot(clients, [r.latency.p50_ms for r in rows], "o-", color=color, label=f"{mode} p50")
        right.plot(clients, [r.latency.p95_ms for r in rows], "s--", color=color, label=f"{mode} p95")
    ref = report.reference
    if ref is not None and ref.runs:
        left.axhline(ref.sentences_per_s, color="gray", linestyle=":", label="CTranslate2 batch (median)")
        left.axhspan(min(ref.runs), max(ref.runs), color="gray", alpha=0.1)  # its drift over the run
    ticks = sorted({r.clients for r in report.closed_loop})
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(c) for c in ticks])  # client counts, not powers of two
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel("concurrent clients (closed loop)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    left.set_ylabel("sentences / s")
    left.set_ylim(bottom=0)
    # A point without a single successful answer has NaN latencies; log scale needs something > 0.
    if any(r.latency.p50_ms > 0 for r in report.closed_loop):
        right.set_yscale("log")
    right.set_ylabel("latency (ms)")
    fig.suptitle(summary_line(report.environment), fontsize=7, wrap=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- command line -----------------------------------------------------------------------------------
def read_sentences(path: Path, limit: int | None) -> list[str]:
    from training.data import read_lines  # imported here like the reference's torch code, not at start-up

    # A blank request would cost the model nothing: leave those out.
    sentences = [s for s in map(str.strip, read_lines(path)) if s]
    return sentences[:limit] if limit else sentences


def package_version(name: str) -> str:
    try:
        return dist_version(name)
    except PackageNotFoundError:
        return "not installed"


def raise_open_files_limit() -> None:
    """The open loop may hold one connection per request in flight; 1,024 descriptors (a common
    default) would turn an overloaded server into connection errors on our side."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def other_machine_fraction(
    other: OtherLoad, report: Report, wall_s: float, reference_cpu_s: float = 0.0
) -> float | None:
    """OtherLoad's share of the machine, less the servers and the reference's worker: they are child
    processes, which it counts as "other" (it leaves out only this process, the load generator)."""
    if other.cpu_seconds is None:
        return None
    servers = sum(r.cpu_s or 0.0 for r in report.servers)
    return max(0.0, other.cpu_seconds - servers - reference_cpu_s) / (wall_s * (os.cpu_count() or 1))


def environment(
    args: argparse.Namespace, sentences: int, log_dir: Path, other: float | None
) -> dict[str, Any]:
    return {
        "cpu": cpu_name(),
        "cpus": os.cpu_count(),
        "torch": package_version("torch"),
        "ctranslate2": package_version("ctranslate2"),
        "python": platform.python_version(),
        "threads": args.threads,
        "beam": args.beam,
        "model": str(args.model),
        "sentences": sentences,
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "other_cpu_fraction": other,
        "server_logs": str(log_dir),
    }


def make_plan(args: argparse.Namespace, model: Path, sentences: list[str], log_dir: Path) -> Plan:
    return Plan(
        model=model,
        bodies=[request_body(s, args.beam) for s in sentences],  # encoded once, not per request
        threads=args.server_threads,
        beam=args.beam,
        clients=args.clients,
        rates=args.rates,
        open_loop_modes=args.open_loop_modes,
        warmup_s=args.warmup,
        duration_s=args.duration,
        drain_s=args.drain,
        seed=args.seed,
        log_dir=log_dir,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="model directory the servers load")
    p.add_argument("--src", type=Path, default=DATA / "test_2016_flickr.de.gz", help="one sentence per line")
    p.add_argument("--limit", type=int, default=None, help="first N sentences only (servers and reference)")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32, 64, 128], help="closed loop")
    p.add_argument("--rates", type=float, nargs="+", default=[5, 10, 20, 40, 80], help="open loop, req/s")
    p.add_argument(
        "--open-loop-modes", nargs="*", choices=list(MODES), default=["continuous"], help="none: no open loop"
    )
    p.add_argument("--duration", type=float, default=20.0, help="measured seconds per point")
    p.add_argument("--warmup", type=float, default=3.0, help="uncounted seconds before each point")
    p.add_argument("--drain", type=float, default=60.0, help="open loop: wait this long for late answers")
    p.add_argument("--threads", type=int, default=2, help="CTranslate2's intra_threads (the machine's cores)")
    p.add_argument(
        "--server-threads", type=int, default=0, help="NMT_THREADS of the servers (0: the service's default)"
    )
    p.add_argument("--beam", type=int, default=1, help="beam size of every request (1 = greedy)")
    p.add_argument("--no-ct2", action="store_true", help="skip the CTranslate2 reference")
    p.add_argument("--ct2-batch", type=int, default=64, help="CTranslate2 max_batch_size")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="timed CTranslate2 runs per reference measurement (their median); the reference is "
        "measured once per mode and after every closed-loop point, each run ~3-4 s for 1,000 sentences",
    )
    p.add_argument("--max-length", type=int, default=256, help="CTranslate2: output tokens, eos included")
    p.add_argument("--seed", type=int, default=0, help="open loop arrival times")
    p.add_argument("--log-dir", type=Path, help="server logs (default: a new temporary directory)")
    p.add_argument("--json", type=Path, help="write the raw results here")
    p.add_argument("--plot", type=Path, help="write throughput and latency vs clients (PNG) here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    raise_open_files_limit()
    model = args.model.resolve()
    sentences = read_sentences(args.src, args.limit)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="nmt-service-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    progress(f"server logs in {log_dir}")
    wall = time.perf_counter()
    # The reference's worker stops (and is waited for) before OtherLoad reads the machine's CPU time.
    with contextlib.ExitStack() as stack:
        other = stack.enter_context(OtherLoad())
        reference = None
        if not args.no_ct2:
            reference = stack.enter_context(
                Ct2Reference(
                    model, sentences, args.beam, args.ct2_batch, args.threads, args.repeats, args.max_length
                )
            )
        plan = make_plan(args, model, sentences, log_dir)
        report = Report(environment={}, reference=None if reference is None else reference.reference)
        for mode in args.modes:
            run_mode(mode, plan, report, progress, reference)
    wall = time.perf_counter() - wall
    add_ratios(report.closed_loop, report.reference)
    reference_cpu_s = 0.0 if reference is None else reference.cpu_seconds
    report.environment = environment(
        args, len(sentences), log_dir, other_machine_fraction(other, report, wall, reference_cpu_s)
    )
    print(render(report))
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=2))
    if args.plot:
        plot(report, args.plot)


if __name__ == "__main__":
    main()
