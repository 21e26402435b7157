"""CPU inference: linear layers with their weights prepared once, in float32 or int8.

Decoding multiplies small activations (one token per row, at most a few dozen rows) by the same
weights at every step. Laid out once in oneDNN's blocked format, those weights feed its JIT GEMM
kernels without re-packing per call; on our 2-core AMD EPYC this made whole decoding steps ~13%
faster than ``F.linear`` through MKL (BENCHMARKS.md, "Engine"). CTranslate2 uses oneDNN for the same
reason on AMD CPUs.

With ``int8=True`` those layers, and the encoder's, run in int8 instead (``Int8Linear``): weights
quantized once per output channel, activations quantized at every call from the range of the
whole batch (dynamic quantization), through fbgemm. On this CPU that made greedy decoding of
test_2016 at batch 64 faster (BENCHMARKS.md, "Engine") with BLEU within 0.2 of float32.

The ops (``torch.ops.mkldnn._linear_pointwise``, the one ``torch.compile`` emits for frozen linear
layers on CPU, and ``torch.ops.quantized.linear_dynamic``, the one behind torch's deprecated
``quantize_dynamic``) are not public API, so ``prepack`` checks that they work and returns
``False`` (the model left as it was) when they do not. Inference only: packed weights get no
gradients, and the ``state_dict`` keeps the float weights under their usual names.
"""

from __future__ import annotations

import logging
import warnings

import torch
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

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class Int8Linear(PreparedLinear):
    """The weight in int8, one symmetric scale per output feature; the input quantized to 7 bits
    (unsigned, from the min/max of the whole input) at every call, the product accumulated in int32
    and rescaled."""

    def __init__(self, weight: Tensor, bias: Tensor | None, *, keep: bool = True) -> None:
        super().__init__(weight, bias, keep=keep)
        w = weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127.5).clamp(min=1e-12).double()  # (out,): [-amax, amax] -> int8
        zero_points = torch.zeros(self.out_features, dtype=torch.long)
        with warnings.catch_warnings():  # quantized tensors are deprecated in torch 2.13; available() checks
            warnings.simplefilter("ignore", UserWarning)
            q = torch.quantize_per_channel(w, scales, zero_points, 0, torch.qint8)
        self.packed = torch.ops.quantized.linear_prepack(q, None if bias is None else bias.detach().float())

    def forward(self, x: Tensor) -> Tensor:
        # reduce_range: 7-bit activations, so that AVX2's 8-bit multiply-adds cannot saturate
        # their 16-bit sums (what torch's own dynamic quantization does on x86).
        return torch.ops.quantized.linear_dynamic(x, self.packed, True)


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
    # float32 packs only what runs once per generated token: the encoder and the cross-attention K/V
    # projection run once per input over all its tokens, where MKL's GEMM was as fast or faster
    # (encoding 64 sentences: 141 ms plain, 173 ms packed). int8 is faster there too: encoding plus
    # cross K/V 131 -> 92-101 us per source token on one thread, 95-106 -> 66-76 on two (batches of
    # 12 in arrival order); BLEU within 0.2 of float32 (BENCHMARKS.md).
    for layer in model.decoder:
        _replace_linears(layer, kind, skip=None if int8 else layer.cross_attn.kv)
    if int8:
        for enc_layer in model.encoder:
            _replace_linears(enc_layer, kind)
    if model.out_proj is not None:
        model.out_proj = kind(model.out_proj.weight, None)  # type: ignore[assignment]
    if model.out_proj is None:  # tied: the embedding matrix is also the output projection
        model.logits_proj = kind(weight, None, keep=False)
    log.info("linear layers prepared: %s", "all in int8 (fbgemm)" if int8 else "decoder in float32 (oneDNN)")
    return True
