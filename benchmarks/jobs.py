"""A long document job against typed lines: does a 200-page document delay anyone's sentence?

A server is started as deployed (the shipped de->en model, default settings, beam 5). The
document is ``--pages`` pages of distinct Multi30k training sentences (``--per-page`` a page; a
sentence repeated would be answered by the segment cache), as a PDF (reportlab; or .docx, .txt).

1. ``--typists`` clients type: each posts one training sentence (never one twice) to /translate, waits for the
   answer and posts the next, for ``--seconds``. Their latencies, alone.
2. The document is posted to /jobs; once it is being translated the same typists type again for
   ``--seconds``. Their latencies beside the job, and the job's sentences/s meanwhile.
3. The job is left to finish alone: its sentences/s alone, and the time from upload to done.

Reported: p50 / p95 / max of the typed lines alone and beside the job (the target: the job adds
no more than a sentence's decoding to a typed line), the job's throughput alone and beside them.

    .venv/bin/python -m benchmarks.jobs --json jobs.json      # ~3 min on 2 cores
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import DATA, DEFAULT_MODEL
from benchmarks.load import machine, serve
from training.data import read_lines

FORM = {"source": "de", "target": "en"}


def make_document(kind: str, pages: list[list[str]]) -> tuple[str, bytes]:
    if kind == "txt":
        return "long.txt", "\n\n".join(" ".join(page) for page in pages).encode()
    if kind == "docx":
        import docx

        document = docx.Document()
        for page in pages:
            for sentence in page:
                document.add_paragraph(sentence)
            document.add_page_break()
        out = io.BytesIO()
        document.save(out)
        return "long.docx", out.getvalue()
    from reportlab.lib.pagesizes import A4
    from reportlab.lib.styles import getSampleStyleSheet
    from reportlab.platypus import PageBreak, Paragraph, SimpleDocTemplate

    out = io.BytesIO()
    style = getSampleStyleSheet()["BodyText"]
    story: list[Any] = []
    for page in pages:
        # a paragraph of three sentences at a time: blocks as a PDF of prose has them
        for i in range(0, len(page), 3):
            story.append(Paragraph(" ".join(page[i : i + 3]), style))
        story.append(PageBreak())
    SimpleDocTemplate(out, pagesize=A4).build(story)
    return "long.pdf", out.getvalue()


class Typist(threading.Thread):
    def __init__(self, url: str, lines: list[str], seconds: float) -> None:
        super().__init__(daemon=True)
        self.url, self.lines, self.seconds = url, lines, seconds
        self.latencies: list[float] = []
        self.statuses: list[int] = []

    def run(self) -> None:
        end = time.monotonic() + self.seconds
        with httpx.Client(timeout=120) as client:
            i = 0
            while time.monotonic() < end:
                start = time.monotonic()
                response = client.post(
                    f"{self.url}/translate", json={**FORM, "q": self.lines[i % len(self.lines)]}
                )
                self.latencies.append(time.monotonic() - start)
                self.statuses.append(response.status_code)
                i += 1


def type_for(url: str, lines: list[str], typists: int, seconds: float) -> dict[str, Any]:
    threads = [Typist(url, lines[k::typists], seconds) for k in range(typists)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    latencies = sorted(x for t in threads for x in t.latencies)
    statuses = [s for t in threads for s in t.statuses]
    return {
        "lines": len(latencies),
        "non_200": sum(s != 200 for s in statuses),
        "p50_ms": round(1000 * statistics.median(latencies), 1),
        "p95_ms": round(1000 * latencies[int(0.95 * (len(latencies) - 1))], 1),
        "max_ms": round(1000 * latencies[-1], 1),
    }


def job_state(client: httpx.Client, url: str, job_id: str) -> dict[str, Any]:
    body: dict[str, Any] = client.get(f"{url}/jobs/{job_id}").json()
    return body


def run(args: argparse.Namespace) -> dict[str, Any]:
    train = list(dict.fromkeys(read_lines(DATA / "train.de.gz")))
    needed = args.pages * args.per_page
    pages = [train[i : i + args.per_page] for i in range(0, needed, args.per_page)]
    name, data = make_document(args.format, pages)
    # Typed lines: training sentences after the document's, never one typed twice (a repeat would
    # be answered by the segment cache), a different set in each phase.
    lines = train[needed : needed + 20_000]
    with tempfile.TemporaryDirectory() as tmp:
        env = {"NMT_MODEL_DIR": str(args.model), "NMT_DATA_DIR": tmp}
        with serve(env, Path(tmp) / "uvicorn.log") as server, httpx.Client(timeout=120) as client:
            type_for(server.url, train[-200:], args.typists, 3.0)  # warm
            half = len(lines) // 2
            alone = type_for(server.url, lines[:half], args.typists, args.seconds)
            posted = time.monotonic()
            response = client.post(f"{server.url}/jobs", data=FORM, files={"file": (name, data)})
            assert response.status_code == 202, response.text
            job_id = response.json()["id"]
            while (state := job_state(client, server.url, job_id))["state"] in ("queued", "reading"):
                time.sleep(0.1)
            read_s = time.monotonic() - posted
            before, t0 = state["progress"]["done"], time.monotonic()
            beside = type_for(server.url, lines[half:], args.typists, args.seconds)
            state = job_state(client, server.url, job_id)
            during = (state["progress"]["done"] - before) / (time.monotonic() - t0)
            before, t0 = state["progress"]["done"], time.monotonic()
            while (state := job_state(client, server.url, job_id))["state"] == "translating":
                time.sleep(0.2)
            after = (state["progress"]["done"] - before) / (time.monotonic() - t0)
            while state["state"] not in ("done", "failed", "cancelled"):
                time.sleep(0.2)
                state = job_state(client, server.url, job_id)
            total_s = time.monotonic() - posted
            assert state["state"] == "done", state
            result = client.get(state["resultUrl"])
    return {
        "machine": machine(),
        "model": str(args.model),
        "document": {
            "format": args.format,
            "pages": args.pages,
            "sentences": state["progress"]["total"],
            "bytes": len(data),
            "result_bytes": len(result.content),
        },
        "typists": args.typists,
        "typed_alone": alone,
        "typed_beside_the_job": beside,
        "job_read_s": round(read_s, 1),
        "job_sentences_per_s_beside_typists": round(during, 1),
        "job_sentences_per_s_alone": round(after, 1),
        "job_total_s": round(total_s, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--format", choices=["pdf", "docx", "txt"], default="pdf")
    parser.add_argument("--pages", type=int, default=200)
    parser.add_argument("--per-page", type=int, default=15)
    parser.add_argument("--typists", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = run(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
