"""``NMT_MODELS``: models by name (``opus-mt:de-en``, ``hf:OWNER/REPO[@REVISION]``, ``argos:en-fr``),
fetched into ``NMT_MODEL_STORE`` at start, before any worker starts, and served with the model
directories of ``NMT_MODEL_DIR`` (pivots included: two named models that share English give the
pair between their other languages, as any two model directories do).

A name fetched before is found and verified here (sha256 of every file, ``model.fetch.verify``):
no network, no child process. The others are downloaded and converted by ``python -m model.fetch``
in a child process, whose log lines pass through to ours: the conversion imports torch, which the
front end never loads (tests/test_front_end_imports.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from model.fetch import FetchError, ModelName, find_fetched, parse_names

SETTING = "NMT_MODELS"


def named_model_dirs(names: tuple[str, ...], store: Path, argos_index: str) -> list[Path]:
    """The model directory of each of ``names`` in ``store``, fetched now where it was not before.
    ``FetchError`` with one line naming the model and ``NMT_MODELS`` when one cannot be had."""
    try:
        parsed = parse_names(names)
        # (Each verified once: a check reads every file, the weights included.)
        found = [find_fetched(n, store) for n in parsed]
        missing = [n for n, d in zip(parsed, found, strict=True) if d is None]
        if missing:
            _run_fetcher(missing, store, argos_index)
            found = [
                d if d is not None else find_fetched(n, store) for n, d in zip(parsed, found, strict=True)
            ]
    except FetchError as e:
        raise FetchError(f"{SETTING}: {e}") from None
    if any(d is None for d in found):  # the child said it succeeded: should not happen
        raise FetchError(f"{SETTING}: {', '.join(n.name for n in missing)}: not in {store} after fetching")
    return [d for d in found if d is not None]


def _run_fetcher(names: list[ModelName], store: Path, argos_index: str) -> None:
    command = [sys.executable, "-m", "model.fetch", *(n.name for n in names), "--into", str(store)]
    command += ["--argos-index", argos_index]
    last = ""
    with subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, errors="replace"
    ) as child:
        assert child.stderr is not None
        for line in child.stderr:  # progress and the outcome, as they come
            sys.stderr.write(line)
            sys.stderr.flush()
            if line.strip():
                last = line.strip()
    if child.returncode != 0:
        reason = last.removeprefix("error: ") or f"python -m model.fetch exited with {child.returncode}"
        raise FetchError(reason)
