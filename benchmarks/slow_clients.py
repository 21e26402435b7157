"""Slow clients against a real one: does a flood of connections that never finish cost anyone else?

A server is started as deployed (``benchmarks.load.serve``, the shipped model, defaults). From one
address (``--attacker``, 127.0.0.2) an attacker keeps ``--headers-only`` connections open that send a
``POST /translate``'s headers and never its body, and ``--trickling`` uploads (``POST /translate_file``
and ``POST /jobs``, a 1 MB body announced, a byte a second sent): each one the server closes is
opened again at once. Meanwhile, from 127.0.0.1, a client translates one test_2016 sentence after
another (``POST /translate``) and a probe asks ``GET /health`` every 0.1 s, for ``--seconds``.

Reported: the real client's latency (p50 / p99 / max) and the probe's, beside the flood and alone
(the same client, before the attacker starts); how long the server held each slow connection
before closing it, by kind (its deadline: 10 s for a body after its headers, an upload's rate check
after 5 s, 5 s for a connection past ``NMT_MAX_CONNECTIONS_PER_CLIENT``); connections opened.

    .venv/bin/python -m benchmarks.slow_clients --json slow.json      # ~2 min on 2 cores
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from benchmarks.common import DATA, DEFAULT_MODEL, cpu_name
from benchmarks.load import serve
from training.data import read_lines

HEADERS_ONLY = (
    b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
)


def upload_head(path: str) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=b\r\n"
        "Content-Length: 1000000\r\n\r\n--b\r\n"
    ).encode()


class Attacker:
    """Keeps ``count`` connections of one kind open from ``source``, reopening each one closed."""

    def __init__(self, host: str, port: int, source: str) -> None:
        self.host, self.port, self.source = host, port, source
        self.held: dict[str, list[float]] = {}  # kind -> seconds the server held each before closing
        self.opened = 0
        self.refused = 0
        self.stop = asyncio.Event()

    async def keep(self, kind: str, head: bytes, trickle: bool) -> None:
        while not self.stop.is_set():
            try:
                reader, writer = await asyncio.open_connection(
                    self.host, self.port, local_addr=(self.source, 0)
                )
            except OSError:
                self.refused += 1
                await asyncio.sleep(0.1)
                continue
            self.opened += 1
            started = time.monotonic()
            writer.write(head)
            try:
                answer = b""
                while not self.stop.is_set():
                    if trickle:
                        writer.write(b"x")
                    try:
                        chunk = await asyncio.wait_for(reader.read(4096), 1.0)
                    except TimeoutError:
                        continue
                    if not chunk:
                        break
                    answer += chunk
                if not self.stop.is_set():
                    status = answer[9:12].decode(errors="replace") or "closed"
                    self.held.setdefault(f"{kind} {status}", []).append(time.monotonic() - started)
            except (ConnectionError, OSError):
                self.held.setdefault(f"{kind} reset", []).append(time.monotonic() - started)
            finally:
                writer.close()


def run_attacker(url: str, source: str, headers_only: int, trickling: int, stop: threading.Event) -> Attacker:
    host, port = url.removeprefix("http://").split(":")
    attacker = Attacker(host, int(port), source)

    async def main() -> None:
        tasks = [
            asyncio.create_task(attacker.keep("headers-only", HEADERS_ONLY, False))
            for _ in range(headers_only)
        ]
        for i in range(trickling):
            path = "/translate_file" if i % 2 else "/jobs"
            tasks.append(asyncio.create_task(attacker.keep(f"upload {path}", upload_head(path), True)))
        while not stop.is_set():
            await asyncio.sleep(0.1)
        attacker.stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    attacker.thread = thread  # type: ignore[attr-defined]
    return attacker


def measure(url: str, sentences: list[str], seconds: float) -> dict[str, list[float]]:
    """The real client's /translate latencies and the probe's /health latencies over ``seconds``."""
    out: dict[str, list[float]] = {"translate": [], "health": []}
    deadline = time.monotonic() + seconds

    def probe() -> None:
        with httpx.Client(base_url=url, timeout=30) as client:
            while time.monotonic() < deadline:
                started = time.monotonic()
                assert client.get("/health").status_code == 200
                out["health"].append(time.monotonic() - started)
                time.sleep(0.1)

    prober = threading.Thread(target=probe)
    prober.start()
    with httpx.Client(base_url=url, timeout=60) as client:
        i = 0
        while time.monotonic() < deadline:
            started = time.monotonic()
            body = {"q": sentences[i % len(sentences)], "source": "de", "target": "en"}
            response = client.post("/translate", json=body)
            assert response.status_code == 200, response.text
            out["translate"].append(time.monotonic() - started)
            i += 1
    prober.join()
    return out


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {
        "n": len(values),
        "p50_ms": round(statistics.median(values) * 1000, 1),
        "p99_ms": round(pick(0.99) * 1000, 1),
        "max_ms": round(ordered[-1] * 1000, 1),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--headers-only", type=int, default=2000)
    parser.add_argument("--trickling", type=int, default=200)
    parser.add_argument("--attacker", default="127.0.0.2")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    # Distinct sentences (the segment cache is on, as deployed, and must answer none of them).
    sentences = list(dict.fromkeys(read_lines(DATA / "test_2016_flickr.de.gz")))
    with tempfile.TemporaryDirectory() as tmp:
        env = {"NMT_MODEL_DIR": str(args.model), "NMT_DATA_DIR": f"{tmp}/data"}
        with serve(env, Path(tmp) / "server.log") as server:
            alone = measure(server.url, sentences[:200], min(10.0, args.seconds))
            stop = threading.Event()
            attacker = run_attacker(server.url, args.attacker, args.headers_only, args.trickling, stop)
            time.sleep(3.0)  # the flood in place
            beside = measure(server.url, sentences[200:], args.seconds)
            stop.set()
            attacker.thread.join(30)  # type: ignore[attr-defined]
    result = {
        "cpu": cpu_name(),
        "flood": {"headers_only": args.headers_only, "trickling": args.trickling, "from": args.attacker},
        "alone": {k: summary(v) for k, v in alone.items()},
        "beside_the_flood": {k: summary(v) for k, v in beside.items()},
        "held_s": {
            kind: {"n": len(v), "median": round(statistics.median(v), 2), "max": round(max(v), 2)}
            for kind, v in sorted(attacker.held.items())
        },
        "connections_opened": attacker.opened,
        "connections_refused": attacker.refused,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
