"""How a decoding step runs: the step module, its eager and compiled runners, and CPU helpers."""

import logging
import os
import threading
from pathlib import Path

# Where compiled decoding steps are kept between starts (the service's NMT_COMPILE_CACHE_DIR and the
# CLI's --compile-cache-dir default to it). Here, torch-free, so that the front end's settings can
# name it.
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "nmt-service" / "compiled"


def lower_priority(increment: int) -> None:
    """Lower the calling thread's CPU priority by ``increment`` (Linux: per thread, and inherited
    by the processes it starts, a compiler's; elsewhere, nothing)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + increment)
    except (AttributeError, OSError) as e:  # not Linux, or refused: the thread still runs
        logging.getLogger(__name__).info("a background thread runs at its process's priority: %s", e)
