"""Fairness: does a one-line request wait behind other clients' documents?

A server is started as deployed (its scheduler takes requests round-robin, ``app.serving.fairqueue``)
and ``--documents`` clients each post a document of ``--sentences`` test_2016 sentences, wait for
its translation and post the next, for ``--duration`` seconds. Every ``--interval`` seconds one more
client posts a single sentence. Reported:

- the documents' throughput: sentences translated per second;
- for each one-line request, how many of the documents in flight when it was sent finished before
  it did, and its latency. Sent at a random moment, it often meets documents that are nearly done,
  which finish first whatever the order (the line itself takes ~20 decoding steps).

Then the issue's scenario, ``--trials`` times: the ``--documents`` clients post a document each at
the same moment and the single sentence follows ``--line-delay`` s later; how many of the
documents finish before it (the target: at most 1 of 8)?

The clients are a few asyncio connections (a dozen requests a second in all), so unlike a load
generator they take little of the server's CPU.

    .venv/bin/python -m benchmarks.fairness --json fairness.json      # ~3 min on 2 cores

Across pairs: the documents flood one pair (de-en) while the line asks another (each model one
worker's own, ``app.serving.frontend.placement``):

    .venv/bin/python -m benchmarks.fairness --model artifacts --line-pair en-de \
        --line-src ../shared/data/multi30k/test_2016_flickr.en.gz
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import DATA, DEFAULT_MODEL
from benchmarks.load import machine, serve, wait_idle
from training.data import read_lines


@dataclass
class Document:
    sent: float
    done: float | None = None


@dataclass
class Line:
    sent: float
    done: float
    overtaken: int  # documents in flight when it was sent that finished before it
    in_flight: int  # documents in flight when it was sent


@dataclass
class Result:
    duration_s: float
    documents: int
    sentences_per_s: float
    lines: list[Line] = field(default_factory=list)  # sent every --interval during the run
    trials: list[Line] = field(default_factory=list)  # sent just after a burst of documents

    @property
    def worst_overtaken(self) -> int:
        return max((line.overtaken for line in self.lines), default=0)


async def post(host: str, port: int, body: bytes) -> int:
    """One POST /translate on its own connection; the status."""
    reader, writer = await asyncio.open_connection(host, port)
    head = (
        f"POST /translate HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    writer.write(head + body)
    await writer.drain()
    data = await reader.read()
    writer.close()
    return int(data.split(b" ", 2)[1])


def body(texts: list[str], pair: str = "de-en") -> bytes:
    source, target = pair.split("-")
    return json.dumps({"q": texts, "source": source, "target": target, "beam_size": 1}).encode()


async def run_load(
    url: str, texts: list[str], args: argparse.Namespace
) -> tuple[list[Document], list[Line], float]:
    host, port = url.removeprefix("http://").split(":")
    line_texts = read_lines(args.line_src) if args.line_src else texts
    documents: list[Document] = []
    lines: list[Line] = []
    stop = time.monotonic() + args.duration

    async def document_client(i: int) -> None:
        k = i * args.sentences
        while time.monotonic() < stop:
            doc = [texts[(k + j) % len(texts)] for j in range(args.sentences)]
            k += args.sentences * args.documents
            record = Document(time.monotonic())
            documents.append(record)
            status = await post(host, int(port), body(doc))
            if status != 200:
                raise RuntimeError(f"a document got {status}")
            record.done = time.monotonic()

    async def line_client() -> None:
        k = 0
        await asyncio.sleep(args.interval)
        while time.monotonic() < stop - 2:
            in_flight = [d for d in documents if d.done is None]
            sent = time.monotonic()
            status = await post(host, int(port), body([line_texts[k % len(line_texts)]], args.line_pair))
            if status != 200:
                raise RuntimeError(f"a line got {status}")
            done = time.monotonic()
            overtaken = sum(1 for d in in_flight if d.done is not None and d.done < done)
            lines.append(Line(sent, done, overtaken, len(in_flight)))
            k += 1
            await asyncio.sleep(args.interval)

    started = time.monotonic()
    await asyncio.gather(*(document_client(i) for i in range(args.documents)), line_client())
    return documents, lines, time.monotonic() - started


async def run_trials(url: str, texts: list[str], args: argparse.Namespace) -> list[Line]:
    """The issue's scenario, ``--trials`` times: ``--documents`` clients post a document each at
    the same moment, one more posts a single sentence ``--line-delay`` seconds later; how many of
    the documents finish before it? Each trial starts once the previous one is over."""
    host, port = url.removeprefix("http://").split(":")
    line_texts = read_lines(args.line_src) if args.line_src else texts
    lines: list[Line] = []
    for trial in range(args.trials):
        docs = [Document(time.monotonic()) for _ in range(args.documents)]

        async def document(i: int, record: Document, trial: int = trial) -> None:
            k = (trial * args.documents + i) * args.sentences
            doc = [texts[(k + j) % len(texts)] for j in range(args.sentences)]
            if await post(host, int(port), body(doc)) != 200:
                raise RuntimeError("a document was not translated")
            record.done = time.monotonic()

        async def line(trial: int = trial, docs: list[Document] = docs) -> Line:
            await asyncio.sleep(args.line_delay)
            sent = time.monotonic()
            one = line_texts[(trial * 7919) % len(line_texts)]
            if await post(host, int(port), body([one], args.line_pair)) != 200:
                raise RuntimeError("a line was not translated")
            done = time.monotonic()
            in_flight = [d for d in docs if d.done is None or d.done > sent]
            overtaken = sum(1 for d in in_flight if d.done is not None and d.done < done)
            return Line(sent, done, overtaken, len(in_flight))

        sent_line = asyncio.ensure_future(line())
        await asyncio.gather(*(document(i, d) for i, d in enumerate(docs)), sent_line)
        lines.append(sent_line.result())
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--src", type=Path, default=DATA / "test_2016_flickr.de.gz")
    p.add_argument("--documents", type=int, default=8, help="concurrent document clients")
    p.add_argument("--sentences", type=int, default=40, help="sentences per document")
    p.add_argument("--duration", type=float, default=40.0)
    p.add_argument("--interval", type=float, default=1.0, help="seconds between one-line requests")
    p.add_argument("--trials", type=int, default=20, help="bursts of documents with one line each")
    p.add_argument("--line-delay", type=float, default=0.05, help="seconds from the documents to the line")
    p.add_argument("--env", nargs="*", default=[], help="VAR=VALUE for every server")
    p.add_argument(
        "--line-pair",
        default="de-en",
        help="the one-line requests' pair (the documents' are de-en): another pair's typed line "
        "beside a flood of documents on one pair (with --model a directory of both models)",
    )
    p.add_argument("--line-src", type=Path, help="the one-line requests' sentences (default: --src)")
    p.add_argument("--json", type=Path)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    texts = read_lines(args.src)
    with tempfile.TemporaryDirectory(prefix="nmt-fairness-") as tmp:
        env = {"NMT_MODEL_DIR": str(args.model.resolve())}
        env.update(kv.split("=", 1) for kv in args.env)
        with serve(env, Path(tmp) / "server.log") as server:
            asyncio.run(run_load(server.url, texts, argparse.Namespace(**{**vars(args), "duration": 5})))
            wait_idle(server)  # (a warm-up round, not counted)
            documents, lines, wall = asyncio.run(run_load(server.url, texts, args))
            wait_idle(server)
            trials = asyncio.run(run_trials(server.url, texts, args))
    finished = [d for d in documents if d.done is not None]
    r = Result(wall, len(finished), len(finished) * args.sentences / wall, lines, trials)
    print(f"\n{machine()}\n")
    print(
        "| document sentences/s | bursts: documents finished before the line (median / max) | "
        "bursts: line latency ms (median / max) | during the run: one-line requests, documents in flight "
        "(median), finished before it (median / max), latency ms (median / max) |"
    )
    print("|---:|---:|---:|---|")
    lat = [(x.done - x.sent) * 1000 for x in r.lines]
    burst_lat = [(x.done - x.sent) * 1000 for x in r.trials]
    burst_over = [x.overtaken for x in r.trials]
    print(
        f"| {r.sentences_per_s:.1f} | "
        f"{statistics.median(burst_over):.0f} / {max(burst_over)} of {args.documents} | "
        f"{statistics.median(burst_lat):.0f} / {max(burst_lat):.0f} | "
        f"{len(r.lines)}, {statistics.median([x.in_flight for x in r.lines]):.0f}, "
        f"{statistics.median([x.overtaken for x in r.lines]):.0f} / {r.worst_overtaken}, "
        f"{statistics.median(lat):.0f} / {max(lat):.0f} |"
    )
    if args.json:
        report: dict[str, Any] = {
            "machine": machine(),
            "args": {k: str(v) for k, v in vars(args).items()},
            "result": asdict(r),
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
