"""``python -m app.models.precompile``: the steps and encoders a server would compile at start are
compiled before it, into NMT_COMPILE_CACHE_DIR, and the server's workers then load them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import torch

from app.config import Settings
from app.main import worker_threads
from app.serving.worker.models import open_translator
from model.runtime.runners import PackagedRunner

ROOT = Path(__file__).parent.parent


def precompile(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``python -m app.models.precompile`` run with ``env``, as an image build would run it."""
    return subprocess.run(
        [sys.executable, "-m", "app.models.precompile"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )


def test_precompile_leaves_the_step_that_a_worker_then_loads(model_dir: Path, tmp_path: Path) -> None:
    cache = tmp_path / "compiled"
    env = {k: v for k, v in os.environ.items() if not k.startswith("NMT_")}
    env |= {"NMT_MODEL_DIR": str(model_dir), "NMT_COMPILE_CACHE_DIR": str(cache), "NMT_DEVICE": "cpu"}
    out = precompile(env)
    assert ": compiled; encoder compiled," in out.stdout, out.stdout + out.stderr
    [package] = cache.glob("step-*.pt2")
    [encoder] = cache.glob("encoder-*.pt2")
    assert list(cache.glob("int8-pays-*.json"))  # the auto precision, measured once here
    again = precompile(env)
    assert ": found in the cache; encoder compiled," in again.stdout, again.stdout + again.stderr
    with mock.patch.dict(os.environ, env, clear=True):
        settings = Settings()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(worker_threads(settings))  # as a worker of that server would run
        translator = open_translator(settings, model_dir)
        runner = translator.runner
        assert isinstance(runner, PackagedRunner) and runner.kind == "compiled" and runner.cached
        # The encoder loaded with the step, not compiled again in the background.
        assert runner.encoder is not None and runner.encoder.package is not None
    finally:
        torch.set_num_threads(threads)
    assert list(cache.glob("step-*.pt2")) == [package]
    assert list(cache.glob("encoder-*.pt2")) == [encoder]
