"""Our int8 product (``nmt::int8_mm``, ``model.runtime.csrc/int8mm.cpp``) against integer sums done
here in int64, with each kind of instructions it has (AVX-512 VNNI where this CPU has it, AVX2,
plain C++: ``NMT_INT8_ISA``); a layer through it against oneDNN's two products, bit for bit; the
embedding that reads the output projection's copy; and the fallback where the library is missing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import compile_cache_dir
from torch import nn

from model.runtime import int8mm
from model.runtime.prepack import ACT_ZERO, Int8Embedding, Int8Linear, SharedInt8Embedding, prepack
from model.transformer import Transformer

ROOT = Path(__file__).parent.parent


@pytest.fixture(scope="module")
def library() -> Path:
    """Our kernel's library, built (once per test cache) and loaded into this process."""
    cache = compile_cache_dir()
    assert int8mm.ensure(cache), "our int8 kernel's library could not be built"
    return int8mm.kernel_path(cache)


def _has_vnni() -> bool:
    flags = Path("/proc/cpuinfo").read_text()
    return all(f in flags for f in ("avx512f", "avx512bw", "avx512_vnni"))


# Shapes whose feature count is no multiple of 16 (a masked tail), rows no multiple of the tiles'
# (1-4 on AVX-512, 1-4 on AVX2), several groups of blocks (weights fetched ahead), tiny ones.
SUMS = """
import sys, torch
sys.path.insert(0, {root!r})
from pathlib import Path
from model.runtime import int8mm
assert int8mm.ensure(Path({cache!r}))
g = torch.Generator().manual_seed(0)
bad = []
for inputs, out in ((512, 2048), (2048, 37), (256, 8000), (12, 5), (4, 16), (64, 100)):
    w = torch.randint(-127, 128, (out, inputs), dtype=torch.int8, generator=g)
    w[0] = 127; w[-1] = -127  # the largest pair sums (an int16 step would saturate)
    layout, comp = int8mm.blocked(w, 64)
    for rows in (1, 2, 3, 4, 5, 7, 9, 33, 64):
        q = torch.randint(-63, 64, (rows, inputs), dtype=torch.int8, generator=g)
        q[0] = 63; q[-1] = -63
        got = torch.ops.nmt.int8_mm((q.to(torch.int16) + 64).to(torch.uint8), layout, comp, out)
        want = q.long() @ w.long().t()
        if got.dtype != torch.int32 or not torch.equal(got.long(), want):
            bad.append((inputs, out, rows))
print(bad)
"""


@pytest.mark.parametrize("isa", ["native", "avx2", "scalar"])
def test_our_int8_sums_are_exact_with_every_kind_of_instructions(isa: str, library: Path) -> None:
    if isa == "native" and not _has_vnni():
        pytest.skip("this CPU has no AVX-512 VNNI: 'avx2' is its native kind")  # (CI: either runs)
    env = {**os.environ, "NMT_INT8_ISA": isa} if isa != "native" else dict(os.environ)
    out = subprocess.run(
        [sys.executable, "-c", SUMS.format(root=str(ROOT), cache=str(library.parent))],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr


@pytest.mark.parametrize("rows", [1, 3, 8, 64])
def test_a_layer_computes_the_same_bits_through_our_kernel_and_onednns(
    rows: int, library: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    g = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(1000, 512, generator=g) * 0.05, torch.randn(1000, generator=g)
    x = torch.randn(rows, 512, generator=g) * torch.logspace(-2, 2, rows)[:, None]
    ours = Int8Linear(weight, bias)
    monkeypatch.setattr(int8mm, "loaded", lambda: False)
    monkeypatch.setattr(int8mm, "serves", lambda *shape: False)
    primitive = Int8Linear(weight, bias)
    assert (ours.kernel, primitive.kernel) == ("ours", "primitive")
    with torch.inference_mode():
        assert torch.equal(ours(x), primitive(x))


def test_an_eager_call_shared_between_threads_sums_as_one_thread_does(library: Path) -> None:
    g = torch.Generator().manual_seed(6)
    w = torch.randint(-127, 128, (3000, 512), dtype=torch.int8, generator=g)
    layout, comp = int8mm.blocked(w, ACT_ZERO)
    x = torch.randint(1, 128, (64, 512), dtype=torch.uint8, generator=g)
    assert int8mm.PARALLEL_PRODUCTS <= 64 * 512 * 3000  # (shared between threads where there are two)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.ops.nmt.int8_mm(x, layout, comp, 3000)
        torch.set_num_threads(3)
        shared = torch.ops.nmt.int8_mm(x, layout, comp, 3000)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(shared, alone)
    assert torch.equal(alone.long(), (x.long() - ACT_ZERO) @ w.long().t())


def test_malformed_operands_are_refused_before_the_kernel_reads_them(library: Path) -> None:
    layout, comp = int8mm.blocked(torch.zeros(20, 8, dtype=torch.int8), ACT_ZERO)
    x = torch.ones(2, 8, dtype=torch.uint8)
    for bad in (
        (x.to(torch.int8), layout, comp, 20),  # signed activations
        (torch.ones(2, 12, dtype=torch.uint8), layout, comp, 20),  # another input width
        (x, layout, comp, 40),  # more features than the layout holds
        (x, layout, comp[:16], 20),  # a short comp
    ):
        with pytest.raises((ValueError, RuntimeError)):
            torch.ops.nmt.int8_mm(*bad)


def test_without_the_library_layers_keep_onednns_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(int8mm, "loaded", lambda: False)
    layer = Int8Linear(torch.randn(64, 32), None)
    assert layer.kernel in ("direct", "primitive") and not hasattr(layer, "blocked")


def test_a_broken_compiler_leaves_the_library_unloaded_and_says_so(tmp_path: Path) -> None:
    script = f"""
import sys, logging, torch
sys.path.insert(0, {str(ROOT)!r})
logging.basicConfig(level=logging.WARNING)
from pathlib import Path
from model.runtime import int8mm
from model.runtime.prepack import Int8Linear
print(int8mm.ensure(Path({str(tmp_path)!r})), int8mm.loaded(), Int8Linear(torch.randn(64, 32), None).kernel)
"""
    out = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "CXX": "/bin/false"},  # TorchInductor's compiler, as it picks it
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.split()[:2] == ["False", "False"], out.stdout + out.stderr
    assert out.stdout.split()[2] in ("direct", "primitive")
    assert "int8 layers run on oneDNN's kernels" in out.stderr
    assert not list(tmp_path.glob("*.so"))


def test_the_blocked_layout_reads_back_every_row() -> None:
    g = torch.Generator().manual_seed(4)
    w = torch.randint(-127, 128, (37, 24), dtype=torch.int8, generator=g)
    layout, comp = int8mm.blocked(w, ACT_ZERO)
    assert layout.shape == (3, 6, 16, 4)
    ids = torch.tensor([[0, 36], [15, 16]])
    assert torch.equal(int8mm.rows_of(layout, ids), w[ids])
    assert torch.equal(comp[:37], w.long().sum(1).mul(ACT_ZERO).int()) and not comp[37:].any()


def test_a_tied_embedding_reads_the_projections_copy_with_the_same_bits(library: Path) -> None:
    torch.manual_seed(5)
    from model.config import ModelConfig

    model = Transformer(
        ModelConfig(vocab_size=203, d_model=32, n_heads=4, encoder_layers=1, decoder_layers=1, d_ff=64)
    ).eval()
    own_table = Int8Embedding(model.embed.weight)
    assert prepack(model, int8=True, keep_float=False)
    assert isinstance(model.embed, SharedInt8Embedding)
    assert model.embed.blocked is model.logits_proj.blocked  # one copy
    ids = torch.tensor([[1, 202, 7], [16, 0, 15]])
    with torch.inference_mode():
        assert torch.equal(model.embed(ids), own_table(ids))


def test_an_untied_model_keeps_a_table_of_its_own(library: Path) -> None:
    from model.config import ModelConfig

    model = Transformer(
        ModelConfig(
            vocab_size=50,
            d_model=32,
            n_heads=4,
            encoder_layers=1,
            decoder_layers=1,
            d_ff=64,
            tie_output=False,
        )
    ).eval()
    assert prepack(model, int8=True, keep_float=False)
    assert isinstance(model.embed, Int8Embedding)
    assert isinstance(model.logits_proj, Int8Linear) and model.logits_proj.kernel == "ours"
    assert not isinstance(model.embed, nn.Embedding)
