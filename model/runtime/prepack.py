"""CPU inference: linear layers with their weights prepared once, in float32 or int8.

Decoding multiplies small activations (one token per row, at most a few dozen rows) by the same
weights at every step. Laid out once in oneDNN's blocked format, those weights feed its JIT GEMM
kernels without re-packing per call; on our 2-core AMD EPYC this made whole decoding steps ~13%
faster than ``F.linear`` through MKL. CTranslate2 uses oneDNN for the same
reason on AMD CPUs.

With ``int8=True`` those layers, and the encoder's, run in int8 instead (``Int8Linear``): weights
quantized once per output feature, each row of the activations quantized at every call from its
own range (7 bits: ``ACT_LEVELS``), the product accumulated exactly in int32: by our own kernel
(``nmt::int8_mm``) where its library is loaded (``model.runtime.int8mm``), else by oneDNN's
u8s8 matmul primitive (``torch.ops.onednn.qlinear_pointwise``, the kernel TorchInductor's x86
quantization emits) or its BLAS-like ``gemm_s8s8s32`` (``torch._int_mm``) where that is exact on
the CPU and cheaper for the layer's shape (``model.runtime.int8mm``: the same bits). Per row, not
per batch:
with one scale for the whole batch (torch's dynamic quantization), a
sentence's translation depended on which other sentences shared its batch (137 of 1,000 test_2016
sentences came out differently alone than in a batch of 64); with a scale per row and exact integer
sums, a row's result does not depend on the other rows at all, nor on the machine kind. On our
AVX-512 VNNI EPYC a 64-row 512 -> 2,048 layer takes 0.20 ms in int8 against 0.54 in float32 (one
thread); with oneDNN's AVX2 kernels (``ONEDNN_MAX_CPU_ISA=AVX2``) 0.65 against 1.04 at 64 rows but
0.17 against 0.06 at one row, so whether int8 is served is measured (``model.runtime.precision``).
On the shipped model 926 (greedy) and 936 (beam 5) of 1,000 test_2016 sentences come out as in
float32 (the embeddings in int8 too: ``Int8Embedding``), BLEU within 0.1 of float32's.

The ops (``torch.ops.mkldnn._linear_pointwise``, the one ``torch.compile`` emits for frozen linear
layers on CPU, and ``torch.ops.onednn.qlinear_pointwise``, u8 x s8 -> int32 -> float32) are not
public API, so ``prepack`` checks that they work and returns ``False`` (the model left as it was)
when they do not. Inference only: packed weights get no gradients, and the ``state_dict`` keeps the float
weights under their usual names.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor, nn

from model.runtime import int8mm
from model.transformer import Transformer, replace_modules

log = logging.getLogger(__name__)


class PreparedLinear(nn.Module):
    """``nn.Linear``'s forward from a weight prepared once (CPU, float32 in, float32 out, inference).

    ``keep``: also keep ``weight`` and ``bias`` as parameters under nn.Linear's names, so that the
    model's ``state_dict`` (what ``save_model_dir`` writes) is unchanged by packing. A model loaded
    to translate passes ``keep=False`` (``prepack(keep_float=False)``): no float weight is then kept
    beside its int8 or packed copy. The tied output projection passes ``keep=False`` too: its weight
    is the embedding's, already in the state_dict.

    What a layer computes with is registered as parameters (``prepared``): named, so that a compiled
    step (``model.runtime.runners``) is handed them by name and computes with them where they lie
    (TorchInductor copies buffers, and cannot copy oneDNN's opaque tensors), and left out of the
    ``state_dict``.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None, *, keep: bool = True) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.prepared: list[str] = []  # names of the parameters left out of the state_dict
        self.bias: Tensor | None
        if keep:
            self.weight = nn.Parameter(weight.detach(), requires_grad=False)
            self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        else:
            self.prepare("bias", bias)

    def prepare(self, name: str, tensor: Tensor | None) -> None:
        """Hold ``tensor`` as ``self.<name>``, a parameter outside the ``state_dict``."""
        self.register_parameter(
            name, None if tensor is None else nn.Parameter(tensor.detach(), requires_grad=False)
        )
        self.prepared.append(name)

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name in self.prepared:
            destination.pop(prefix + name, None)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


class PackedLinear(PreparedLinear):
    """The weight in oneDNN's blocked layout, float32 (the only copy kept when ``keep=False``)."""

    def __init__(self, weight: Tensor, bias: Tensor | None, *, keep: bool = True) -> None:
        super().__init__(weight, bias, keep=keep)
        self.packed: Tensor
        self.prepare("packed", torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None))

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


# Activations are quantized to 7 bits (-63..63, stored as unsigned 1..127 around a zero point of
# 64), weights to 8 (-127..127). CPUs without int8 dot-product instructions (AVX2 only) multiply u8
# by s8 with ``vpmaddubsw``, which adds two products in a saturating int16: 8-bit activations
# (up to 255 x 127 x 2 = 64,770) overflowed it, and oneDNN's sums came out wrong by up to 32,188
# (64 x 512 x 58,101, ONEDNN_MAX_CPU_ISA=AVX2); 7 bits stay below 32,767 (127 x 127 x 2 = 32,258),
# so the int32 sums are exact on every x86-64 CPU and a row's result is the same bits on both kinds.
ACT_LEVELS = 63
ACT_ZERO = 64
WEIGHT_LEVELS = 127


def quantize_rows(weight: Tensor) -> tuple[Tensor, Tensor]:
    """``weight`` (out, in) in int8 with one symmetric scale per row: (int8 (out, in), float32 (out,))."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / WEIGHT_LEVELS).clamp(min=1e-12)
    return torch.round(w / scale[:, None]).to(torch.int8), scale


class Int8Embedding(nn.Module):
    """An embedding table held in int8, one symmetric scale per row (``quantize_rows``, as
    ``Int8Linear`` holds the tied output projection: the same rows, the same values), each row
    looked up dequantized. A quarter of float32's memory: an OPUS-MT model's 58,101 x 512 table
    takes 28 MiB instead of 113, which was 60% of such a model served in int8 (issue 44: twenty
    models on one machine). oneDNN's packed copy of the output projection cannot be indexed by
    row, so the table is kept beside it. CTranslate2's int8 models hold their embeddings in int8 too.
    """

    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        table, scale = quantize_rows(weight)
        self.table = nn.Parameter(table, requires_grad=False)  # (V, D) int8
        self.scale = nn.Parameter(scale[:, None].to(weight.dtype), requires_grad=False)  # (V, 1)

    def forward(self, ids: Tensor) -> Tensor:
        return self.table[ids].to(self.scale.dtype) * self.scale[ids]

    def extra_repr(self) -> str:
        return f"{self.table.size(0)}, {self.table.size(1)}, int8"


class SharedInt8Embedding(nn.Module):
    """``Int8Embedding``'s lookups read from the tied output projection's own int8 copy, where it
    is in our kernel's layout (``model.runtime.int8mm.blocked``: rows can be read where they lie):
    the same int8 rows and scales (``quantize_rows`` of the same matrix), the same bits, and no
    table beside it (28 MiB less per OPUS-MT-size model)."""

    def __init__(self, projection: Int8Linear) -> None:
        super().__init__()
        self.blocked = projection.blocked  # the projection's parameters, registered under our names
        self.weight_scale = projection.weight_scale

    def forward(self, ids: Tensor) -> Tensor:
        return int8mm.rows_of(self.blocked, ids).to(self.weight_scale.dtype) * self.weight_scale[ids, None]

    def extra_repr(self) -> str:
        return f"{self.weight_scale.size(0)}, {self.blocked.size(1) * int8mm.GROUP}, int8, the projection's"


class Int8Linear(PreparedLinear):
    """The weight in int8, one symmetric scale per output feature; each input row quantized with a
    symmetric scale of its own at every call (``ACT_LEVELS``), the product accumulated exactly in
    int32, times the weight's scale, then times the row's scale.

    The product (``kernel``) is our own on the weight in its blocked layout (``"ours"``) where its
    library is loaded (``model.runtime.int8mm.loaded``); else oneDNN's BLAS-like ``gemm_s8s8s32``
    on the plain int8 weight (``"direct"``) where ``model.runtime.int8mm.serves`` the layer's
    shape, else its u8s8 matmul primitive on the weight laid out once in its blocked format
    (``"primitive"``): the same integer sums, the same bits, at another cost.

    Every row is computed from its own values only, so a row's output is bit for bit the same
    whatever the other rows of the batch are (integer sums are exact in any order)."""

    def __init__(self, weight: Tensor, bias: Tensor | None, *, keep: bool = True) -> None:
        super().__init__(weight, bias, keep=keep)
        qweight, weight_scale = quantize_rows(weight)
        self.weight_scale: Tensor
        self.qweight: Tensor
        self.blocked: Tensor
        self.comp: Tensor
        self.packed: Tensor
        self.zero_points: Tensor
        self.fbias: Tensor | None
        # Our kernel where its library is loaded (``model.runtime.int8mm``), else oneDNN's.
        self.kernel = (
            "ours"
            if int8mm.loaded() and int8mm.blockable(self.in_features)
            else "direct"
            if int8mm.serves(self.in_features, self.out_features)
            else "primitive"
        )
        if self.kernel == "ours":
            blocked, comp = int8mm.blocked(qweight, ACT_ZERO)
            self.prepare("blocked", blocked)
            self.prepare("comp", comp)
        elif self.kernel == "direct":
            self.prepare("qweight", qweight)  # (out, in), as gemm_s8s8s32 reads it transposed
        else:
            # oneDNN's blocked layout (an opaque tensor: the only copy of the int8 weight kept)
            self.prepare("packed", torch.ops.onednn.qlinear_prepack(qweight, None))
            # Weights are symmetric: zero points of 0, int32 as oneDNN takes them (a compiled step
            # would otherwise hold an int32 copy of its own).
            self.prepare("zero_points", torch.zeros(self.out_features, dtype=torch.int32))
        self.prepare("weight_scale", weight_scale)
        self.prepare("fbias", None if bias is None else bias.detach().float())

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)  # (N, in)
        # (N, 1) max |x| per row (torch.linalg.vector_norm(ord=inf) computes the same 17x slower)
        scale = rows.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12).div_(ACT_LEVELS)
        q = rows.div(scale).round_()  # -63..63
        y = (
            self._ours(q)
            if self.kernel == "ours"
            else self._direct(q)
            if self.kernel == "direct"
            else self._primitive(q)
        )
        y = y.mul_(scale)
        if self.fbias is not None:
            y.add_(self.fbias)
        return y.view(*x.shape[:-1], self.out_features)

    def _ours(self, q: Tensor) -> Tensor:
        """(N, out): the int32 sums of ``q`` (N, in), -63..63, x weight scales (our kernel, its
        activations unsigned around ``ACT_ZERO``, as the primitive's)."""
        sums = torch.ops.nmt.int8_mm(
            q.add(ACT_ZERO).to(torch.uint8), self.blocked, self.comp, self.out_features
        )
        return sums.to(torch.float32).mul(self.weight_scale)

    def _direct(self, q: Tensor) -> Tensor:
        """(N, out): the int32 sums of ``q`` (N, in), -63..63, x weight scales, as the primitive's."""
        return torch._int_mm(q.to(torch.int8), self.qweight.t()).to(torch.float32).mul(self.weight_scale)

    def _primitive(self, q: Tensor) -> Tensor:
        """(N, out): the int32 sums of ``q`` (N, in), -63..63, x weight scales (oneDNN's primitive,
        its activations unsigned around ``ACT_ZERO``: 1..127)."""
        return torch.ops.onednn.qlinear_pointwise(
            q.add(ACT_ZERO).to(torch.uint8),
            1.0,
            ACT_ZERO,
            self.packed,
            self.weight_scale,
            self.zero_points,
            None,
            1.0,
            0,
            torch.float32,
            "none",
            [],
            "",
        )


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


def _intel_cpu() -> bool:
    """Whether this is an Intel CPU (where MKL's GEMM is at its best), from /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("vendor_id") and "GenuineIntel" in line for line in f)
    except OSError:
        return False


def _replace_linears(
    root: nn.Module, kind: type[PreparedLinear], skip: nn.Module | None = None, *, keep: bool = True
) -> None:
    replace_modules(
        root,
        lambda m: kind(m.weight, m.bias, keep=keep) if isinstance(m, nn.Linear) and m is not skip else None,
    )


def prepack(model: Transformer, *, int8: bool = False, keep_float: bool = True) -> bool:
    """Replace ``nn.Linear`` layers of an eval-mode float32 CPU ``model`` by ``PackedLinear`` (the
    decoder's per-token layers and the output projection) or ``Int8Linear`` (those, the encoder's
    and the cross-attention K/V projection: every linear layer), in place. Returns whether it did.

    ``keep_float=False``: the layers keep only what they compute with (their float weights leave
    the ``state_dict``): for a model loaded to serve, not to save."""
    if model.training or model.device.type != "cpu" or model.dtype != torch.float32:
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
        _replace_linears(layer, kind, skip=None if pack_inputs else layer.cross_attn.kv, keep=keep_float)
    if pack_inputs:
        for enc_layer in model.encoder:
            _replace_linears(enc_layer, kind, keep=keep_float)
    # The output projection, the embedding's matrix when tied, with the output bias if any; its
    # parameters stay where they are (the state_dict unchanged).
    model.logits_proj = kind(model.output_weight, model.output_bias, keep=False)
    if not keep_float:
        model.out_proj = None  # an untied projection's float weight: logits_proj is what computes
        if int8:
            # The lookups read the same int8 rows as the tied projection: its own copy where our
            # kernel's layout holds it, else a table of their own (oneDNN's copy is opaque).
            projection = model.logits_proj
            embed: nn.Module = (
                SharedInt8Embedding(projection)
                if model.cfg.tie_output and isinstance(projection, Int8Linear) and projection.kernel == "ours"
                else Int8Embedding(model.embed.weight)
            )
            model.embed = embed  # type: ignore[assignment]
            if model.src_embed is not None:
                model.src_embed = Int8Embedding(model.src_embed.weight)  # type: ignore[assignment]
    log.info(
        "linear layers prepared: %s",
        "all in int8 (per-row activation scales)"
        if int8
        else f"{'all' if pack_inputs else 'decoder'} in float32 (oneDNN)",
    )
    return True
