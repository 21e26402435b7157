"""The HTTP front end runs no model: importing the app loads neither torch nor the model's torch
code (``lint-imports`` checks the import graph statically; this checks what actually loads)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_importing_the_app_does_not_import_torch() -> None:
    check = (
        "import sys, app.main\n"
        "loaded = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'safetensors'})\n"
        "assert not loaded, loaded\n"
        "assert 'app.serving.worker' not in sys.modules and 'model.checkpoint' not in sys.modules\n"
    )
    command = [sys.executable, "-c", check]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
