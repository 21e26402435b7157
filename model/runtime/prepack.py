"""CPU inference: linear layers with their weights prepared once, in float32 or int8.

Decoding multiplies small activations (one token per row, at most a few dozen rows) by the same
weights at every step. Laid out once in oneDNN's blocked format, those weights feed its JIT GEMM
kernels without re-packing per call; on our 2-core AMD EPYC this made whole decoding steps ~13%
faster than ``F.linear`` through MKL. CTranslate2 uses oneDNN for the same
reason on AMD CPUs.

With ``int8=True`` those layers, and the encoder's, run in int8 instead (``Int8Linear``): weights
quantized once per output feature, each row of the activations quantized at every call from its
own range, the product accumulated exactly in int32 (``torch._int_mm``). Per row, not per batch:
with one scale for the whole batch (torch's dynamic quantization), a
sentence's translation depended on which other sentences shared its batch (137 of 1,000 test_2016
sentences came out differently alone than in a batch of 64); with a scale per row and exact integer
sums, a row's result does not depend on the other rows at all. On this CPU it is 1.45x float32's
sentences/s at batch 64 greedy (the per-batch scheme was 1.83x), BLEU as float32's
(``python -m benchmarks.determinism``).

The ops (``torch.ops.mkldnn._linear_pointwise``, the one ``torch.compile`` emits for frozen linear
layers on CPU, and ``torch._int_mm``, int8 x int8 -> int32 matrix products) are not public API, so
``prepack`` checks that they work and returns ``False`` (the model left as it was) when they do
not. Inference only: packed weights get no gradients, and the ``state_dict`` keeps the float
weights under their usual names.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.transformer import Transformer, replace_modules

log = logging.getLogger(__name__)


class PreparedLinear(nn.Module):
    """``nn.Linear``'s forward from a weight prepared once (CPU, float32 in, float32 out, inference).

    ``keep``: also keep ``weight`` and ``bias`` as parameters under nn.Linear's names, so that the
    model's ``state_dict`` (what ``save_model_dir`` writes) is unchanged by packing. The tied output
    projection passes ``keep=False``: its weight is the embedding's, already in the state_dict.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None, *, keep: bool = True) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bias: Tensor | None
        if keep:
            self.weight = nn.Parameter(weight.detach(), requires_grad=False)
            self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        else:
            self.bias = None if bias is None else bias.detach()

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


class PackedLinear(PreparedLinear):
    """The weight in oneDNN's blocked layout, float32."""

    def __init__(self, weight: Tensor, bias: Tensor | None, *, keep: bool = True) -> None:
        super().__init__(weight, bias, keep=keep)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.plain = weight.detach()  # the same storage as ``weight`` (or the tied embedding)

    def forward(self, x: Tensor) -> Tensor:
        if torch.compiler.is_compiling():
            # In a compiled graph (model.runtime.runners) TorchInductor lowers a plain linear itself;
            # it cannot take a packed weight that is not a constant of the graph.
            return F.linear(x, self.plain, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class Int8Linear(PreparedLinear):
    """The weight in int8, one symmetric scale per output feature; each input row quantized to int8
    with a symmetric scale of its own at every call, the product accumulated in int32 and rescaled.

    Every row is computed from its own values only, so a row's output is bit for bit the same
    whatever the other rows of the batch are (integer sums are exact in any order)."""

    def __init__(self, weight: Tensor, bias: Tensor | None, *, keep: bool = True) -> None:
        super().__init__(weight, bias, keep=keep)
        w = weight.detach().float()
        self.weight_scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)  # (out,)
        self.qweight_t = (
            torch.round(w / self.weight_scale[:, None]).to(torch.int8).t().contiguous()
        )  # (in, out)
        self.fbias = None if bias is None else bias.detach().float()

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)  # (N, in)
        # (N, 1) max |x| per row (torch.linalg.vector_norm(ord=inf) computes the same 17x slower)
        scale = rows.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12).div_(127)
        q = rows.div(scale).round_().to(torch.int8)
        y = torch.mul(torch._int_mm(q, self.qweight_t), self.weight_scale).mul_(scale)  # (N, out)
        if self.fbias is not None:
            y.add_(self.fbias)
        return y.view(*x.shape[:-1], self.out_features)


def available(int8: bool = False) -> bool:
    """Whether this torch build can prepare and run a linear layer so, with about the right result."""
    if not int8 and not torch.backends.mkldnn.is_available():
        return False
    kind, atol = (Int8Linear, 0.05) if int8 else (PackedLinear, 1e-5)
    try:
        with torch.inference_mode():
            ref = nn.Linear(8, 4)
            x = torch.randn(3, 1, 8)
            return bool(torch.allclose(kind(ref.weight, ref.bias)(x), ref(x), atol=atol))
    except (RuntimeError, AttributeError, NotImplementedError):  # op missing or refusing this build
        return False


# CPU features with int8 dot-product instructions: torch's int8 products (``torch._int_mm``) are
# fast with them. Without (AVX2 only), they ran ~50x slower than the float32 oneDNN product on our
# AMD EPYC (512 -> 2048 at 64 rows: 94 ms vs 2 ms; a 74M-parameter model's decoding step 7-9 s vs
# 155 ms; BENCHMARKS.md, "Real size"), so "auto" quantization keeps float32 there.
INT8_DOT_PRODUCT_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})


def _cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def int8_is_fast(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU has int8 dot-product instructions (VNNI, AMX): where int8 pays."""
    return bool(_cpu_flags(cpuinfo) & INT8_DOT_PRODUCT_FLAGS)


def _intel_cpu() -> bool:
    """Whether this is an Intel CPU (where MKL's GEMM is at its best), from /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("vendor_id") and "GenuineIntel" in line for line in f)
    except OSError:
        return False


def _replace_linears(root: nn.Module, kind: type[PreparedLinear], skip: nn.Module | None = None) -> None:
    replace_modules(
        root, lambda m: kind(m.weight, m.bias) if isinstance(m, nn.Linear) and m is not skip else None
    )


def prepack(model: Transformer, *, int8: bool = False) -> bool:
    """Replace ``nn.Linear`` layers of an eval-mode float32 CPU ``model`` by ``PackedLinear`` (the
    decoder's per-token layers and the output projection) or ``Int8Linear`` (those, the encoder's
    and the cross-attention K/V projection: every linear layer), in place. Returns whether it did."""
    weight = model.embed.weight
    if model.training or weight.device.type != "cpu" or weight.dtype != torch.float32:
        return False
    if not available(int8):
        return False
    kind: type[PreparedLinear] = Int8Linear if int8 else PackedLinear
    # float32 packs what runs once per generated token; the encoder and the cross-attention K/V
    # projection run once per input over all its tokens, where MKL's GEMM was as fast or faster on
    # an Intel Xeon (encoding 64 sentences: 141 ms plain, 173 ms packed), but not elsewhere: MKL
    # takes its fast paths on Intel CPUs only, and on our AMD EPYC oneDNN encoded 10-12% faster
    # (1.15-1.26 vs 1.30-1.45 ms per test_2016 sentence, batches of 10). int8 is faster there too:
    # encoding plus cross K/V 131 -> 92-101 us per source token on one thread, 95-106 -> 66-76 on
    # two (batches of 12 in arrival order); BLEU within 0.2 of float32.
    pack_inputs = int8 or not _intel_cpu()
    for layer in model.decoder:
        _replace_linears(layer, kind, skip=None if pack_inputs else layer.cross_attn.kv)
    if pack_inputs:
        for enc_layer in model.encoder:
            _replace_linears(enc_layer, kind)
    # The output projection, the embedding's matrix when tied, with the output bias if any; its
    # parameters stay where they are (the state_dict unchanged).
    model.logits_proj = kind(model.output_weight, model.output_bias, keep=False)
    log.info(
        "linear layers prepared: %s",
        "all in int8 (per-row activation scales)"
        if int8
        else f"{'all' if pack_inputs else 'decoder'} in float32 (oneDNN)",
    )
    return True
