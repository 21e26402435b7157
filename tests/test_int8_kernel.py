"""The int8 linear layer (``model.runtime.prepack.Int8Linear``) against integer arithmetic done
here, on this CPU's own kernels and on oneDNN's AVX2 and AVX-512-without-VNNI ones
(``ONEDNN_MAX_CPU_ISA``: the kernels of the other machine kinds, whose u8 x s8 products saturate in
int16); its two products (``model.runtime.int8mm``) against each other; and the measured ``auto``
choice (``model.runtime.precision``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model.runtime import int8mm
from model.runtime.precision import int8_pays
from model.runtime.prepack import Int8Linear

ROOT = Path(__file__).parent.parent


def reference(layer_weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """What the layer must compute, from its definition: weights to -127..127 per output feature,
    each row of ``x`` to -63..63 by its own max, exact integer sums (int64 here), then the scales."""
    w_scale = (layer_weight.abs().amax(1) / 127).clamp(min=1e-12)
    qw = torch.round(layer_weight / w_scale[:, None]).long()
    x_scale = x.abs().amax(1, keepdim=True).clamp(min=1e-12) / 63
    qx = torch.round(x / x_scale).long()
    sums = (qx @ qw.t()).float()
    y = sums * w_scale * x_scale
    return y if bias is None else y + bias


def test_int8_linear_is_exact_integer_arithmetic_with_scales() -> None:
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(300, 512, generator=g) * 0.05, torch.randn(300, generator=g)
    x = torch.randn(37, 512, generator=g) * 4
    with torch.inference_mode():
        got = Int8Linear(weight, bias)(x)
    torch.testing.assert_close(got, reference(weight, bias, x), rtol=1e-6, atol=1e-6)


def test_int8_rows_give_the_same_bits_whatever_their_neighbours() -> None:
    g = torch.Generator().manual_seed(1)
    layer = Int8Linear(torch.randn(2048, 512, generator=g) * 0.05, torch.randn(2048, generator=g))
    rows = torch.randn(64, 512, generator=g) * torch.logspace(-3, 3, 64)[:, None]  # wildly different ranges
    with torch.inference_mode():
        together = layer(rows)
        for i in (0, 17, 63):
            assert torch.equal(layer(rows[i : i + 1]), together[i : i + 1])
            assert torch.equal(layer(rows[i : i + 5]), together[i : i + 5])


# The worst case for a CPU without VNNI: every activation at its row's maximum and every weight at
# +127 (one column) or alternating sign, so that two adjacent products add up as large as they can.
ADVERSARIAL = """
import sys, torch
sys.path.insert(0, {root!r})
from model.runtime.prepack import Int8Linear
x = torch.ones(4, 512); x[1] = -1; x[2, ::2] = -1; x[3] = torch.linspace(-1, 1, 512)
w = torch.ones(3, 512) * 0.5; w[1, ::2] = -0.5; w[2] = torch.linspace(-0.5, 0.5, 512)
with torch.inference_mode():
    y = Int8Linear(w, None)(x)
want = (torch.round(x / (1 / 63)).long() @ torch.round(w / (0.5 / 127)).long().t()).float()
want = want * (0.5 / 127) * (1 / 63)
print(float((y - want).abs().max() / want.abs().max()))
"""


@pytest.mark.parametrize("isa", ["native", "AVX2", "AVX512_CORE"])
def test_int8_sums_do_not_saturate_on_any_machine_kind(isa: str) -> None:
    env = dict(os.environ)
    if isa != "native":
        env["ONEDNN_MAX_CPU_ISA"] = isa  # oneDNN's kernels for CPUs without VNNI
    out = subprocess.run(
        [sys.executable, "-c", ADVERSARIAL.format(root=str(ROOT))],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    # A saturated int16 pair sum is off by thousands; exact sums leave only float rounding.
    assert float(out.stdout.strip().splitlines()[-1]) < 1e-6, out.stdout


REFUSED = """
import sys, torch
sys.path.insert(0, {root!r})
from model.runtime import int8mm
from model.runtime.prepack import Int8Linear
print(int8mm.exact(256, 768), Int8Linear(torch.randn(768, 256), None).kernel == "direct")
"""


@pytest.mark.parametrize("isa", ["AVX2", "AVX512_CORE"])
def test_gemm_s8s8s32_is_refused_where_its_sums_saturate(isa: str) -> None:
    # oneDNN's kernels for CPUs without VNNI (AVX2 only; AVX-512 without VNNI) overflow int16 on
    # signed 7-bit activations: the check finds it, and layers keep oneDNN's primitive.
    out = subprocess.run(
        [sys.executable, "-c", REFUSED.format(root=str(ROOT))],
        env={**os.environ, "ONEDNN_MAX_CPU_ISA": isa},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.split() == ["False", "False"], out.stdout


@pytest.mark.parametrize("rows", [1, 3, 64])
def test_a_layer_computes_the_same_bits_through_either_int8_product(
    rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    g = torch.Generator().manual_seed(2)
    weight, bias = torch.randn(768, 256, generator=g) * 0.05, torch.randn(768, generator=g)
    x = torch.randn(rows, 256, generator=g) * torch.logspace(-2, 2, rows)[:, None]
    monkeypatch.setattr(int8mm, "loaded", lambda: False)  # oneDNN's two (ours: test_our_int8_kernel)
    direct = Int8Linear(weight, bias)
    monkeypatch.setattr(int8mm, "serves", lambda *shape: False)
    primitive = Int8Linear(weight, bias)
    assert primitive.kernel == "primitive"
    if not int8mm.exact(256, 768):  # a CPU whose gemm_s8s8s32 saturates: the primitive serves
        assert direct.kernel == "primitive"
        return
    assert direct.kernel == "direct"
    with torch.inference_mode():
        assert torch.equal(direct(x), primitive(x))


def test_without_our_kernel_large_layers_keep_onednns_primitive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(int8mm, "loaded", lambda: False)
    wide = int8mm.SMALL_IN + 1
    assert Int8Linear(torch.randn(int8mm.SMALL_WEIGHT // wide + 1, wide), None).kernel == "primitive"
    assert Int8Linear(torch.randn(int8mm.SMALL_OUT + 1, int8mm.SMALL_IN), None).kernel == "primitive"
    assert (Int8Linear(torch.randn(8, wide), None).kernel == "direct") == int8mm.exact(wide, 8)


def test_auto_int8_is_measured_once_per_machine_and_read_back(tmp_path: Path) -> None:
    calls: list[str] = []

    def timer(int8: float, float32: float):  # type: ignore[no-untyped-def]
        def measure() -> dict[str, float]:
            calls.append("measured")
            return {"int8": int8, "float32": float32}

        return measure

    assert int8_pays(tmp_path / "a", timer=timer(0.01, 0.02)) is True
    assert int8_pays(tmp_path / "b", timer=timer(0.03, 0.02)) is False
    assert len(calls) == 2
    # Read back: a later worker that would measure otherwise serves what the first one measured.
    assert int8_pays(tmp_path / "a", timer=timer(0.03, 0.02)) is True
    assert int8_pays(tmp_path / "b", timer=timer(0.01, 0.02)) is False
    assert len(calls) == 2
    [record] = [json.loads(p.read_text()) for p in (tmp_path / "a").glob("int8-pays-*.json")]
    assert record["seconds"] == {"int8": 0.01, "float32": 0.02}
