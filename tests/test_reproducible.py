"""Float32 products give each row the same bits alone, among any rows, on 1 or 2 threads: MKL runs in
strict reproducible mode from the first import of the model (``model.reproducible``)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from model.reproducible import ensure_strict

# The OPUS-MT-sized model's products (D 512, FFN 2048) and the tiny test models' (D 32).
SHAPES = [(512, 512), (512, 2048), (2048, 512), (32, 64), (64, 32)]
ROWS = [2, 3, 4, 5, 8, 13, 16, 17, 32, 64]


def test_mkl_is_in_strict_reproducible_mode_in_every_process_that_imports_the_model() -> None:
    state = ensure_strict()
    assert state.mkl, "torch on x86 carries MKL"
    assert state.strict, state.why


@pytest.mark.parametrize(("k", "n"), SHAPES, ids=str)
def test_a_float32_row_has_the_same_bits_alone_among_any_rows_and_on_any_threads(k: int, n: int) -> None:
    g = torch.Generator().manual_seed(k * n)
    weight, bias = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    x = torch.randn(max(ROWS), k, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([F.linear(x[i : i + 1], weight, bias) for i in range(len(x))])
        for t in (1, 2):
            torch.set_num_threads(t)
            for rows in ROWS:
                together = F.linear(x[:rows], weight, bias)
                assert torch.equal(together, alone[:rows]), f"{rows} rows on {t} threads"
    finally:
        torch.set_num_threads(threads)


def strict_in_child(code: str) -> str:
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def test_a_product_before_the_model_is_imported_leaves_mkl_as_it_was_and_says_so() -> None:
    """The mode can only be chosen before MKL's first call: a process that computed first is told."""
    first = "import torch; torch.ones(2, 2) @ torch.ones(2, 2); "
    after = "from model.reproducible import ensure_strict; print(ensure_strict().strict)"
    assert strict_in_child(after) == "True"
    assert strict_in_child(first + after) == "False"
