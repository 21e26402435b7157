"""Float32 products give each row the same bits alone, among any rows, on 1 or 2 threads: MKL runs in
strict reproducible mode from the first import of the model (``model.reproducible``).

Where this MKL takes no strict branch (an AMD EPYC, family 25 model 17: every branch above
COMPATIBLE is refused as "unsupported", and COMPATIBLE's strict mode still gave one row other bits
among two), ``ensure_strict`` must say so (checked), and the bits are not promised: the row test
is skipped there, naming the CPU's limit (docs/architecture.md, "One answer per input"). On such
a CPU every float32 linear layer of the model is oneDNN's anyway (``model.runtime.prepack``), and
the service's int8 products are the same bits alone and among others (tests/test_determinism.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from model.reproducible import CBWR_AVX2, CBWR_STRICT, ensure_strict


def mkl_takes_strict_mode() -> bool:
    """Asked of MKL in a fresh process (strict mode is chosen before MKL's first call): whether it
    takes AVX2's strict branch on this CPU. Not ``ensure_strict``: what it is checked against."""
    code = (
        "import ctypes, pathlib, torch; "
        "lib = ctypes.CDLL(str(pathlib.Path(torch.__file__).parent / 'lib' / 'libtorch_cpu.so')); "
        f"print(lib.mkl_serv_cbwr_set({CBWR_AVX2 | CBWR_STRICT}) == 0)"
    )
    return strict_in_child(code) == "True"


# The OPUS-MT-sized model's products (D 512, FFN 2048) and the tiny test models' (D 32).
SHAPES = [(512, 512), (512, 2048), (2048, 512), (32, 64), (64, 32)]
ROWS = [2, 3, 4, 5, 8, 13, 16, 17, 32, 64]


def test_mkl_is_in_strict_reproducible_mode_in_every_process_that_imports_the_model() -> None:
    state = ensure_strict()
    assert state.mkl, "torch on x86 carries MKL"
    if mkl_takes_strict_mode():
        assert state.strict, state.why
    else:  # this CPU's MKL refuses strict mode: said so
        assert not state.strict and "MKL's setting" in state.why


@pytest.mark.parametrize(("k", "n"), SHAPES, ids=str)
def test_a_float32_row_has_the_same_bits_alone_among_any_rows_and_on_any_threads(k: int, n: int) -> None:
    if not mkl_takes_strict_mode():
        pytest.skip("this CPU's MKL takes no strict (CNR) branch: float32 bits are not promised here")
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
    assert strict_in_child(after) == str(mkl_takes_strict_mode())
    assert strict_in_child(first + after) == "False"
