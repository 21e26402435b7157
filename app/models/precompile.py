"""Compile the decoding step (and encoder) of every model the service would serve, before it starts.

    python -m app.models.precompile        # the service's settings: NMT_MODEL_DIR, NMT_COMPILE_CACHE_DIR...

Each model directory under ``NMT_MODEL_DIR`` is loaded as a worker loads it (``open_translator``,
with a worker's threads), its step and encoder compiled into ``NMT_COMPILE_CACHE_DIR`` (or found
there), and whether int8 pays on this CPU measured and kept beside it
(``model.runtime.precision``); the KV cache's row copies are built there too
(``model.runtime.kvrows``). The server started afterwards loads the files instead of compiling:
ready in seconds. A package is named by
the CPU's features among the rest (``model.runtime.runners``): run this where the service will run,
or on the same CPU kind (an image built elsewhere compiles at its first start, as without it).
Models of one architecture share one package: the first compiles, the others load it.
"""

from __future__ import annotations

import sys
import time

import torch

from app.config import Settings
from app.main import open_models, worker_threads
from app.serving.worker.models import open_translator
from model.runtime import kvrows


def main() -> None:
    settings = Settings().model_copy(update={"warmup": False})
    torch.set_num_threads(worker_threads(settings))  # a worker's threads: part of a package's name
    for spec, _info, _tokenizer in open_models(settings):
        started = time.perf_counter()
        translator = open_translator(settings, spec.path)
        runner = translator.runner
        if runner.kind != "compiled":
            state = "eager: not compiled (NMT_COMPILE=false, or compiling failed: see the log)"
        else:
            state = "found in the cache" if getattr(runner, "cached", False) else "compiled"
            encoder = getattr(runner, "encoder", None)  # NMT_COMPILE_ENCODER: made by a process of its own
            if encoder is not None:
                encoder.ready.wait()
                state += "; encoder " + (
                    "compiled" if encoder.made else "eager (compiling failed: see the log)"
                )
        took = time.perf_counter() - started
        print(f"{spec.name} ({translator.quantization}): {state}, {took:.1f} s", flush=True)
    # (Built beside the first load as well: waited for here, so that the image holds it.)
    if kvrows.ensure(settings.compile_cache_dir):
        print("the cache's row copies: built", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
