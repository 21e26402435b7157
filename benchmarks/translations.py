"""Before/after check, black-box: does a checkout translate test_2016 as another one does?

For every configuration (quantization none and int8, greedy and beam 5) the German sentences of
test_2016_flickr (1,000; ``--limit`` for fewer) are translated with the code of ``--repo`` two ways:

- ``cli``: ``python -m model.translate --model MODEL --input FILE --beam-size B --quantization Q
  --no-progress`` run in ``--repo`` (only the flags every version of the CLI has; its other settings
  are its defaults), output read from stdout;
- ``service``: the HTTP service started from ``--repo`` (``benchmarks.load.serve``, with
  ``NMT_MODEL_DIR``, ``NMT_QUANTIZATION`` and ``NMT_DEFAULT_BEAM_SIZE`` only), each sentence posted
  as its own request to ``/translate`` by ``--clients`` concurrent threads (so sentences share the
  running batch with whatever else arrives).

Both run with this interpreter, in ``--repo`` with ``PYTHONPATH=--repo``: the repository's own code
is imported, the same packages serve both. The result is one JSON file,
``{"none/beam1": {"cli": [...], "service": [...]}, ...}``; ``--compare A.json B.json`` prints per
configuration and path how many translations differ between two such files, and within each file
how many of the CLI's differ from the service's.

    .venv/bin/python -m benchmarks.translations --repo ../before --out before.json
    .venv/bin/python -m benchmarks.translations --repo . --out after.json
    .venv/bin/python -m benchmarks.translations --compare before.json after.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.common import DATA, DEFAULT_MODEL
from benchmarks.load import serve
from training.data import read_lines

QUANTIZATIONS = ("none", "int8")
BEAMS = (1, 5)
PATHS = ("cli", "service")
CLI_TIMEOUT_S = 3600.0  # compiling the decoding step (new CLIs) takes minutes on 2 cores
REQUEST_TIMEOUT_S = 300.0
RETRIES = 20  # a 503 (queue full) is retried after its Retry-After

Translations = dict[str, dict[str, list[str]]]  # config -> path -> one translation per sentence


def config_name(quantization: str, beam: int) -> str:
    return f"{quantization}/beam{beam}"


def repo_env(repo: Path) -> dict[str, str]:
    """This environment with ``repo`` first on the path and no ``NMT_*`` setting."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NMT_")}
    return {**env, "PYTHONPATH": str(repo)}


def run_cli(
    repo: Path, model: Path, input_file: Path, *, beam: int, quantization: str, count: int
) -> list[str]:
    """``repo``'s CLI over ``input_file``: one translation per line."""
    cmd = [
        sys.executable,
        "-m",
        "model.translate",
        "--model",
        str(model),
        "--input",
        str(input_file),
        "--beam-size",
        str(beam),
        "--quantization",
        quantization,
        "--no-progress",
    ]
    done = subprocess.run(
        cmd, cwd=repo, env=repo_env(repo), capture_output=True, timeout=CLI_TIMEOUT_S, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {done.returncode}:\n{done.stderr.decode()[-3000:]}")
    lines = done.stdout.decode("utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if len(lines) != count:
        raise RuntimeError(f"the CLI wrote {len(lines)} lines for {count} sentences")
    return lines


def post(url: str, text: str) -> str:
    """One sentence through ``/translate``, retried while the service says it is busy (503)."""
    body = json.dumps({"q": text, "source": "de", "target": "en"}).encode()
    for _ in range(RETRIES):
        request = urllib.request.Request(
            f"{url}/translate", data=body, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
                answer = json.loads(response.read())
        except urllib.error.HTTPError as e:
            if e.code != 503:
                raise RuntimeError(f"{e.code} for {text!r}: {e.read().decode(errors='replace')}") from e
            time.sleep(float(e.headers.get("Retry-After") or 1))
            continue
        translated = answer["translatedText"]
        return str(translated[0] if isinstance(translated, list) else translated)
    raise RuntimeError(f"still busy after {RETRIES} tries: {text!r}")


def run_service(
    repo: Path, model: Path, texts: list[str], *, beam: int, quantization: str, clients: int, log: Path
) -> list[str]:
    """``repo``'s service with this configuration; every sentence its own request."""
    env = {
        "NMT_MODEL_DIR": str(model),
        "NMT_QUANTIZATION": quantization,
        "NMT_DEFAULT_BEAM_SIZE": str(beam),
        "PYTHONPATH": str(repo),
    }
    with serve(env, log, repo=repo) as server, ThreadPoolExecutor(clients) as pool:
        return list(pool.map(lambda text: post(server.url, text), texts))


def translate_all(args: argparse.Namespace) -> Translations:
    repo, model = args.repo.resolve(), args.model.resolve()
    texts = read_lines(args.src)[: args.limit]
    args.log_dir.mkdir(parents=True, exist_ok=True)
    results: Translations = {}
    with tempfile.TemporaryDirectory() as tmp:
        input_file = Path(tmp) / "input.de"
        input_file.write_text("".join(t + "\n" for t in texts), encoding="utf-8")
        for quantization in args.quantizations:
            for beam in BEAMS:
                name = config_name(quantization, beam)
                started = time.perf_counter()
                cli = run_cli(repo, model, input_file, beam=beam, quantization=quantization, count=len(texts))
                print(f"[{name}] cli: {len(cli)} in {time.perf_counter() - started:.1f} s", flush=True)
                started = time.perf_counter()
                log = args.log_dir / f"{name.replace('/', '-')}.log"
                service = run_service(
                    repo, model, texts, beam=beam, quantization=quantization, clients=args.clients, log=log
                )
                print(
                    f"[{name}] service: {len(service)} in {time.perf_counter() - started:.1f} s", flush=True
                )
                results[name] = {"cli": cli, "service": service}
                differ = count_differ(cli, service)
                print(f"[{name}] cli vs service: {differ} of {len(texts)} differ", flush=True)
    return results


def count_differ(a: list[str], b: list[str]) -> int:
    if len(a) != len(b):
        raise ValueError(f"{len(a)} translations against {len(b)}")
    return sum(x != y for x, y in zip(a, b, strict=True))


def compare(a_path: Path, b_path: Path, examples: int) -> None:
    a: Translations = json.loads(a_path.read_text())
    b: Translations = json.loads(b_path.read_text())
    print(f"A = {a_path}, B = {b_path}\n")
    print("| config | path | A vs B differ | A: cli vs service | B: cli vs service |")
    print("|---|---|---:|---:|---:|")
    shown: list[str] = []
    for name in dict.fromkeys([*a, *b]):
        if name not in a or name not in b:
            print(f"| {name} | — | only in {'A' if name in a else 'B'} | | |")
            continue
        within = {
            label: f"{count_differ(f[name]['cli'], f[name]['service'])}/{len(f[name]['cli'])}"
            for label, f in (("A", a), ("B", b))
        }
        for path in PATHS:
            xs, ys = a[name][path], b[name][path]
            differ = count_differ(xs, ys)
            print(f"| {name} | {path} | {differ}/{len(xs)} | {within['A']} | {within['B']} |")
            diffs = [(i, x, y) for i, (x, y) in enumerate(zip(xs, ys, strict=True)) if x != y]
            shown += [f"{name} {path} #{i}:\n  A: {x}\n  B: {y}" for i, x, y in diffs[:examples]]
    if shown:
        print("\nFirst differences:\n" + "\n".join(shown))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repo", type=Path, help="the checkout whose CLI and service translate")
    p.add_argument("--out", type=Path, help="where the translations are written (JSON)")
    p.add_argument("--compare", type=Path, nargs=2, metavar=("A", "B"), help="two --out files")
    p.add_argument(
        "--model", type=Path, default=DEFAULT_MODEL, help="the model directory (the same for every repo)"
    )
    p.add_argument("--src", type=Path, default=DATA / "test_2016_flickr.de.gz")
    p.add_argument("--limit", type=int, default=None, help="first N sentences only")
    p.add_argument(
        "--quantizations",
        nargs="+",
        choices=QUANTIZATIONS,
        default=list(QUANTIZATIONS),
        help="none only where int8 is measured slower (model.runtime.precision.int8_pays)",
    )
    p.add_argument("--clients", type=int, default=16, help="concurrent requests to the service")
    p.add_argument("--examples", type=int, default=2, help="--compare: differences shown per config and path")
    p.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()) / "nmt-translations")
    args = p.parse_args(argv)
    if args.compare:
        compare(args.compare[0], args.compare[1], args.examples)
        return
    if args.repo is None or args.out is None:
        p.error("--repo and --out are required (or --compare A B)")
    results = translate_all(args)
    args.out.write_text(json.dumps(results, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
