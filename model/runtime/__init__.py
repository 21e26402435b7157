"""How a decoding step runs: the step module, its eager and compiled runners, and CPU helpers."""

from pathlib import Path

# Where compiled decoding steps are kept between starts (the service's NMT_COMPILE_CACHE_DIR and the
# CLI's --compile-cache-dir default to it). Here, torch-free, so that the front end's settings can
# name it.
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "nmt-service" / "compiled"
