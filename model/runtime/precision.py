"""Whether int8 pays on this CPU: measured, once per machine, not guessed from its flags.

``"auto"`` quantization serves int8 where the int8 linear layers (``prepack.Int8Linear``) are
measured faster than the float32 ones (``prepack.PackedLinear``) on this CPU, with this torch and
this many threads, and float32 elsewhere. The flags alone decide badly: oneDNN's u8s8 kernels on a
CPU without VNNI were 1.5x float32 at 64 rows and 0.4x at one row (``ONEDNN_MAX_CPU_ISA=AVX2`` on
our AVX-512 EPYC), and torch's previous int8 product ran ~50x slower than float32 on an AVX2-only
EPYC.

The measurement runs layers of an OPUS-MT-sized decoder (512 -> 2,048 and a 512 x 32,000 output
projection; ``SHAPES``) at 1, 16 and 64 rows (a lone request to a full running batch), best of
``ROUNDS`` rounds, and takes ~0.2 s (VNNI) to ~0.5 s (AVX2). Its verdict is kept in a file beside the
compiled steps, keyed by the CPU, torch and the threads: every worker of a server, and the CLI,
then serve the same precision on one machine, so one input never gets two answers from two
workers that measured differently on a busy host.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from model.runtime import DEFAULT_CACHE_DIR
from model.runtime.package import cpu_digest
from model.runtime.prepack import Int8Linear, PackedLinear, available

log = logging.getLogger(__name__)

ROWS = (1, 16, 64)
SHAPES = ((512, 2048), (512, 32000))  # (in, out): a feed-forward layer, an output projection
ROUNDS = 5


def measure(rows: tuple[int, ...] = ROWS, shapes: tuple[tuple[int, int], ...] = SHAPES) -> dict[str, float]:
    """Seconds for one pass over ``shapes`` at each of ``rows`` rows, float32 and int8 (best of
    ``ROUNDS``, the two interleaved so that a busy host slows both alike)."""
    g = torch.Generator().manual_seed(0)
    best = {"float32": float("inf"), "int8": float("inf")}
    with torch.inference_mode():
        calls: dict[str, list[tuple[nn.Module, torch.Tensor]]] = {"float32": [], "int8": []}
        for k, n in shapes:
            w = torch.randn(n, k, generator=g) * 0.05
            layers: dict[str, nn.Module] = {
                "float32": PackedLinear(w, None, keep=False),
                "int8": Int8Linear(w, None, keep=False),
            }
            for kind, layer in layers.items():
                calls[kind] += [(layer, torch.randn(r, k, generator=g)) for r in rows]
        for round_ in range(ROUNDS + 1):
            for kind, pairs in calls.items():
                started = time.perf_counter()
                for layer, x in pairs:
                    layer(x)
                if round_:  # the first round warms the kernels up
                    best[kind] = min(best[kind], time.perf_counter() - started)
    return best


def int8_pays(cache_dir: Path | None = None, *, timer: Callable[[], dict[str, float]] = measure) -> bool:
    """Whether int8 linear layers are faster than float32's on this machine (measured by ``timer``
    once, then read back from ``cache_dir``). False where this torch build cannot run either."""
    if not (available() and available(int8=True)):
        return False
    path = (cache_dir or DEFAULT_CACHE_DIR) / f"int8-pays-{machine_key()}.json"
    if (kept := _kept_verdict(path)) is not None:
        return kept
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # workers starting together measure once
        if (kept := _kept_verdict(path)) is not None:  # measured by whoever held the lock before
            return kept
        seconds = timer()
        verdict = seconds["int8"] < seconds["float32"]
        record = {"int8": verdict, "seconds": seconds, "threads": torch.get_num_threads()}
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)
    log.info(
        "int8 linear layers: %.2f ms, float32: %.2f ms: auto quantization is %s on this CPU",
        seconds["int8"] * 1e3,
        seconds["float32"] * 1e3,
        "int8" if verdict else "float32",
    )
    return verdict


def _kept_verdict(path: Path) -> bool | None:
    """The verdict measured before and kept in ``path``; None if there is none (or not whole)."""
    try:
        return bool(json.loads(path.read_text())["int8"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def machine_key() -> str:
    """What the measurement depends on: the CPU (model and flags), torch, the threads."""
    about = [cpu_digest(), torch.__version__, str(torch.get_num_threads())]
    return hashlib.sha256("\n".join(about).encode()).hexdigest()[:16]
