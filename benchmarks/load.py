"""Load against the running HTTP server with ``wrk``, and the server run as it is deployed.

``wrk`` (Debian package ``wrk``) is a C load generator with an event loop: it drives thousands of
keep-alive connections for a few percent of a core, where a Python client on the same 2 cores took
a third of a core and more from the server it measured. Request bodies come from a Lua script
written here (``benchmarks/wrk/translate.lua`` reads them from a file), which also counts answers
by status, checks that every 503 carries Retry-After, and prints a JSON summary.

Beside wrk, ``Probe`` threads ask what a newcomer would see while the load runs: ``GET /health`` and
one ``POST /translate`` on a new connection every ``interval`` seconds, each timed.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.http.connections import SERVE_OPTIONS
from benchmarks.common import REPO

HOST = "127.0.0.1"
LUA = Path(__file__).resolve().parent / "wrk" / "translate.lua"
START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 60.0
# The server as the Dockerfile and `make serve` start it.
UVICORN = ["-m", "uvicorn", "app.main:app", *SERVE_OPTIONS]
CACHE_SETTING = "NMT_SEGMENT_CACHE_MB"
CACHE_HITS = "nmt_segment_cache_hits_total"


# -- the server -------------------------------------------------------------------------------------
@dataclass
class Server:
    process: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def http_get(url: str, timeout_s: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


@contextmanager
def serve(
    env: dict[str, str], log: Path, *, repo: Path = REPO, uvicorn: Sequence[str] = UVICORN
) -> Iterator[Server]:
    """``uvicorn app.main:app`` from ``repo`` with only the given ``NMT_*`` variables, until ready;
    stopped with SIGTERM (a drain) on exit.

    The segment cache is off (``NMT_SEGMENT_CACHE_MB=0``) unless ``env`` sets it, and a server that
    answered any sentence from it fails the benchmark when its block ends (``CacheHit``): wrk
    cycles over a few hundred sentences, and a cached answer costs no decoding (one benchmark
    reported 94x CTranslate2 that way). A benchmark that turns the cache on must send distinct
    sentences."""
    env = {CACHE_SETTING: "0", **env}
    port = free_port()
    clean = {k: v for k, v in os.environ.items() if not k.startswith("NMT_")}
    with log.open("wb") as out:  # a file, not a pipe: a full pipe would block the server
        process = subprocess.Popen(
            [sys.executable, *uvicorn, "--host", HOST, "--port", str(port)],
            cwd=repo,
            env={**clean, **env},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    server = Server(process, port, log)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"server exited with {process.returncode}:\n{server.log_tail()}")
            try:
                if http_get(f"{server.url}/health/ready", timeout_s=1.0)[0] == 200:
                    break
            except OSError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not ready after {START_TIMEOUT_S:.0f} s:\n{server.log_tail()}")
            time.sleep(0.2)
        yield server
        check_no_cache_hit(server)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class CacheHit(AssertionError):
    """A benchmark's server answered sentences from its segment cache: its figures are not decoding's."""


def check_no_cache_hit(server: Server) -> None:
    """``CacheHit`` unless the server answered no sentence from its segment cache."""
    hits = metric(server, CACHE_HITS)
    if hits:
        raise CacheHit(
            f"the server answered {hits:.0f} sentences from its segment cache: leave {CACHE_SETTING} "
            "at 0 (serve's default) or send distinct sentences"
        )


def metric(server: Server, name: str) -> float:
    """A metric of the server's /metrics, summed over its label sets (every model's); 0 when absent."""
    total = 0.0
    for line in http_get(f"{server.url}/metrics", timeout_s=30)[1].splitlines():
        if line.startswith((name + " ", name + "{")):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_idle(server: Server, timeout_s: float = 120.0) -> None:
    """Until nothing is queued or decoding: one point's leftovers must not slow the next."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if metric(server, "nmt_queue_depth_sentences") == 0 and metric(server, "nmt_active_sequences") == 0:
            return
        time.sleep(0.2)


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process so far (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU seconds of a server's front end (its own process) and of its workers (its
    descendants), from when it is made."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.start = self.now()

    def now(self) -> tuple[float, float]:
        workers = [p for p in process_tree(self.pid) if p != self.pid]
        return cpu_seconds(self.pid), sum(cpu_seconds(p) for p in workers)

    def per_request_us(self, requests: int) -> tuple[float, float]:
        """(front end, workers) CPU-us per request since the meter started."""
        (front0, workers0), (front1, workers1) = self.start, self.now()
        n = max(requests, 1)
        return 1e6 * (front1 - front0) / n, 1e6 * (workers1 - workers0) / n


def peak_rss_mib(pid: int) -> float:
    """VmHWM summed over the process tree, MiB."""
    return tree_sum_mib(pid, "status", "VmHWM:")


def pss_mib(pid: int) -> float:
    """Proportional set size summed over the process tree (shared pages split among sharers), MiB."""
    return tree_sum_mib(pid, "smaps_rollup", "Pss:")


def tree_sum_mib(pid: int, file: str, field: str) -> float:
    """A field in kB of /proc/PID/``file``, summed over the process tree, MiB."""
    total = 0
    for p in process_tree(pid):
        try:
            for line in Path(f"/proc/{p}/{file}").read_text().splitlines():
                if line.startswith(field):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


# -- wrk --------------------------------------------------------------------------------------------
@dataclass
class WrkResult:
    connections: int
    duration_s: float
    requests: int
    statuses: dict[int, int]
    busy_without_retry_after: int  # 503 answers that lacked the header
    socket_errors: dict[str, int]  # connect, read, write, timeout (answers slower than --timeout)
    latency_ms: dict[str, float]  # p50, p90, p99, max over every answer

    def count(self, status: int) -> int:
        return self.statuses.get(status, 0)

    @property
    def answered_per_s(self) -> float:
        """Successful translations per second."""
        return self.count(200) / self.duration_s


def write_bodies(texts: Sequence[str], path: Path, *, beam: int, api_key: str | None = None) -> Path:
    """One JSON request body per line, for the Lua script (with ``api_key`` in each, if given)."""
    key = {} if api_key is None else {"api_key": api_key}
    with path.open("w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"q": text, "source": "de", "target": "en", "beam_size": beam, **key}) + "\n")
    return path


def run_wrk(
    url: str,
    bodies: Path,
    *,
    connections: int,
    duration_s: float,
    threads: int = 2,
    timeout_s: float = 60.0,
    variable: str = "WRK_BODIES",
) -> WrkResult:
    """wrk's closed loop: every connection sends a request as soon as its previous one is answered
    (``bodies``: POST /translate bodies, or with ``variable`` "WRK_PATHS" paths to GET)."""
    if shutil.which("wrk") is None:
        raise RuntimeError("wrk not found: install the Debian package wrk (apt-get install wrk)")
    cmd = [
        "wrk",
        f"-t{threads}",
        f"-c{connections}",
        f"-d{duration_s:g}s",
        f"--timeout={timeout_s:g}s",
        "-s",
        str(LUA),
        url,
    ]
    out = subprocess.run(
        cmd, env={**os.environ, variable: str(bodies)}, capture_output=True, text=True, check=True
    ).stdout
    line = next((x for x in out.splitlines() if x.startswith("WRK_JSON ")), None)
    if line is None:
        raise RuntimeError(f"no summary from wrk's script:\n{out}")
    data = json.loads(line.removeprefix("WRK_JSON "))
    return WrkResult(
        connections=connections,
        duration_s=data["duration_us"] / 1e6,
        requests=data["requests"],
        statuses={int(k): v for k, v in data["statuses"].items()},
        busy_without_retry_after=data["busy_without_retry_after"],
        socket_errors=data["errors"],
        latency_ms={k: v / 1000 for k, v in data["latency_us"].items()},
    )


# -- probes -----------------------------------------------------------------------------------------
@dataclass
class ProbeResult:
    path: str
    count: int
    statuses: dict[int, int]
    failures: int  # no answer at all (connection refused, time-out)
    latency_ms: dict[str, float]  # p50, p99, max
    without_retry_after: int = 0  # 503 answers without Retry-After
    latency_ms_by_status: dict[int, dict[str, float]] = field(default_factory=dict)


@dataclass
class Probe:
    """A newcomer's view: one request on a new connection every ``interval`` seconds, timed."""

    url: str
    path: str
    body: bytes | None = None  # POST when given
    interval: float = 0.25
    timeout_s: float = 30.0
    samples: list[tuple[int, float, bool]] = field(default_factory=list)  # status (0: failed), s, retry-after
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Probe:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.timeout_s + 5)

    def _run(self) -> None:
        host, port = self.url.removeprefix("http://").split(":")
        while not self._stop.is_set():
            started = time.perf_counter()
            status, retry_after = 0, False
            conn = http.client.HTTPConnection(host, int(port), timeout=self.timeout_s)
            try:
                if self.body is None:
                    conn.request("GET", self.path)
                else:
                    conn.request("POST", self.path, self.body, {"Content-Type": "application/json"})
                response = conn.getresponse()
                response.read()
                status, retry_after = response.status, response.getheader("Retry-After") is not None
            except OSError:
                pass
            finally:
                conn.close()
            self.samples.append((status, time.perf_counter() - started, retry_after))
            self._stop.wait(max(0.0, self.interval - (time.perf_counter() - started)))

    def result(self) -> ProbeResult:
        statuses: dict[int, int] = {}
        by_status: dict[int, list[float]] = {}
        for status, t, _ in self.samples:
            if status:
                statuses[status] = statuses.get(status, 0) + 1
                by_status.setdefault(status, []).append(t * 1000)
        times = sorted(t * 1000 for status, t, _ in self.samples if status)
        return ProbeResult(
            path=self.path,
            count=len(self.samples),
            statuses=statuses,
            failures=sum(1 for status, _, _ in self.samples if not status),
            latency_ms=percentiles(times),
            without_retry_after=sum(1 for status, _, ra in self.samples if status == 503 and not ra),
            latency_ms_by_status={s: percentiles(sorted(v)) for s, v in by_status.items()},
        )


def percentiles(sorted_ms: list[float]) -> dict[str, float]:
    if not sorted_ms:
        return {}

    def at(q: float) -> float:
        return sorted_ms[min(len(sorted_ms) - 1, int(q * len(sorted_ms)))]

    return {"p50": at(0.5), "p99": at(0.99), "max": sorted_ms[-1], "mean": statistics.fmean(sorted_ms)}


def machine() -> dict[str, Any]:
    from benchmarks.common import cpu_name

    return {"cpu": cpu_name(), "cores": len(os.sched_getaffinity(0)), "python": sys.version.split()[0]}
