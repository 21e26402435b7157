"""Hostile uploads against the server as deployed: how fast each is refused, what it costs the
front end's memory, and what another client sees meanwhile.

The server (``uvicorn app.main:app``, default limits, the shipped de->en model, ``--env`` added)
gets each file of tests/hostile_files.py, ``--rounds`` times, one after the other, while a
neighbour thread translates one sentence after another over its own connection. Reported per file:
its status and the seconds to the answer (min / median / max over rounds), and the growth of the
front end's peak RSS while it was handled (VmHWM after it minus VmRSS before it, the peak reset
before each file through /proc/PID/clear_refs). And the neighbour's latency p50 / p95 / max, alone
first and then during the uploads, with its statuses. Then, with no neighbour, a legitimate .docx
(``--legit-paragraphs`` paragraphs of test_2016 sentences, translated in full) and a heavy one
within every limit (180,000 XML elements, no text), the same way.

    python -m benchmarks.hostile --rounds 5
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import docx
import httpx

from benchmarks.common import DATA, DEFAULT_MODEL
from benchmarks.load import machine, serve
from tests.hostile_files import HOSTILE, many_elements
from training.data import read_lines

MB = 1024 * 1024


@dataclass
class Result:
    name: str
    statuses: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    growth_mb: list[float] = field(default_factory=list)


class Neighbour(threading.Thread):
    """One client translating one sentence after another, timing each."""

    def __init__(self, url: str, sentence: str) -> None:
        super().__init__(daemon=True)
        self.url, self.sentence = url, sentence
        self.seconds: list[float] = []
        self.statuses: list[int] = []
        self.stop = threading.Event()

    def run(self) -> None:
        body = {"q": self.sentence, "source": "de", "target": "en"}
        with httpx.Client(timeout=60) as client:
            while not self.stop.is_set():
                start = time.perf_counter()
                status = client.post(f"{self.url}/translate", json=body).status_code
                self.seconds.append(time.perf_counter() - start)
                self.statuses.append(status)


def vm(pid: int, name: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(name)


def legit_docx(sentences: list[str]) -> bytes:
    document = docx.Document()
    for sentence in sentences:
        paragraph = document.add_paragraph(sentence.split(" ", 1)[0] + " ")
        paragraph.add_run(sentence.split(" ", 1)[-1]).bold = True
    out = io.BytesIO()
    document.save(out)
    return out.getvalue()


def upload(client: httpx.Client, url: str, pid: int, filename: str, data: bytes, result: Result) -> None:
    base = vm(pid, "VmRSS")
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
    start = time.perf_counter()
    response = client.post(
        f"{url}/translate_file", data={"source": "de", "target": "en"}, files={"file": (filename, data)}
    )
    result.seconds.append(time.perf_counter() - start)
    result.growth_mb.append((vm(pid, "VmHWM") - base) / MB)
    result.statuses.append(response.status_code)
    if response.status_code == 200:  # fetch it, so that the store does not fill
        client.get(response.json()["translatedFileUrl"])


def latency(seconds: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in seconds)
    return {"n": len(ms), "p50": ms[len(ms) // 2], "p95": ms[int(len(ms) * 0.95)], "max": ms[-1]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--src", type=Path, default=DATA / "test_2016_flickr.de.gz")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--legit-paragraphs", type=int, default=200)
    p.add_argument("--alone", type=float, default=10.0, help="seconds of the neighbour alone first")
    p.add_argument("--env", nargs="*", default=[], help="NMT_VAR=value for the server")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    texts = read_lines(args.src)
    files = [(h.name, h.filename, h.make()) for h in HOSTILE]
    allowed = [
        ("legit-docx", "legit.docx", legit_docx(texts[: args.legit_paragraphs])),
        ("heavy-docx", "heavy.docx", many_elements(180_000)),
    ]
    results = {name: Result(name) for name, _, _ in files + allowed}
    env = {"NMT_MODEL_DIR": str(args.model), **dict(item.split("=", 1) for item in args.env)}
    with tempfile.TemporaryDirectory() as tmp, serve(env, Path(tmp) / "server.log") as server:
        pid = server.process.pid
        with httpx.Client(timeout=120) as client:
            upload(client, server.url, pid, "warm.txt", b"Hallo.", Result("warm-up"))
            alone = Neighbour(server.url, texts[0])
            alone.start()
            time.sleep(args.alone)
            alone.stop.set()
            alone.join()
            during = Neighbour(server.url, texts[0])
            during.start()
            for _ in range(args.rounds):
                for name, filename, data in files:
                    upload(client, server.url, pid, filename, data, results[name])
            during.stop.set()
            during.join()
            for _ in range(args.rounds):
                for name, filename, data in allowed:
                    upload(client, server.url, pid, filename, data, results[name])
        with urllib.request.urlopen(f"{server.url}/health") as health:
            assert health.status == 200
    print("| file | bytes | status | seconds min / median / max | front-end peak RSS growth, MB (max) |")
    print("|---|---:|---|---|---:|")
    for name, _, data in files + allowed:
        r = results[name]
        s = sorted(r.seconds)
        print(
            f"| {name} | {len(data):,} | {'/'.join(map(str, sorted(set(r.statuses))))} "
            f"| {s[0]:.3f} / {statistics.median(s):.3f} / {s[-1]:.3f} | {max(r.growth_mb):.1f} |"
        )
    for label, n in (("alone", alone), ("during the uploads", during)):
        lat = latency(n.seconds)
        statuses = sorted(set(n.statuses))
        print(
            f"neighbour {label}: {lat['n']} requests, statuses {statuses}, p50 {lat['p50']:.1f} ms, "
            f"p95 {lat['p95']:.1f} ms, max {lat['max']:.1f} ms"
        )
    if args.json:
        report = {
            "environment": machine(),
            "files": [asdict(r) for r in results.values()],
            "neighbour": {"alone": latency(alone.seconds), "during": latency(during.seconds)},
        }
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
