"""A CTranslate2 Transformer (``TransformerSpec``, read by ``model.convert.ct2_model``) as our model.

Its variables are renamed to our state dict (``model.transformer``):

    CTranslate2                                   ours
    encoder/embeddings[_0]/weight                 src_embed.weight (embed.weight when shared)
    decoder/embeddings/weight                     embed.weight
    decoder/projection/{weight,bias}              out_proj.weight (when not tied), output_bias
    */position_encodings/encodings                positions.table ("learned")
    encoder/layer_i/self_attention/linear_0|1     encoder.i.self_attn.qkv|out  (qkv fused [q;k;v] in both)
    encoder/layer_i/self_attention/layer_norm     encoder.i.attn_norm.norm
    */layer_i/ffn/linear_0|1, ffn/layer_norm      *.i.ff.fc1|fc2, *.i.ff_norm.norm
    decoder/layer_i/self_attention/...            decoder.i.self_attn, decoder.i.self_norm
    decoder/layer_i/attention/linear_0|1|2        decoder.i.cross_attn.q|kv|out  (kv fused [k;v])
    decoder/layer_i/attention/layer_norm          decoder.i.cross_norm.norm
    encoder/layer_norm, decoder/layer_norm        encoder_norm, decoder_norm (pre-norm)

Without stored position encodings CTranslate2 computes its own sinusoids, which are neither of
our built-in layouts: [sin | cos] halves, but of position p + 1 and with frequencies
10000^(-i / (D/2 - 1)) (layers/common.cc). That table is written out as a learned one
(``builtin_sinusoids``). A decoder that starts from a zero embedding (Marian converted by
CTranslate2) gets a zero row appended to the vocabulary as its start (and padding) token, with an
output bias that never lets it be produced. Anything else our Transformer does not compute raises
``ConversionError`` naming the option; so does a variable this module does not know.

Every variable's shape is checked against what the architecture needs before it is used: the width
D is the embeddings', and each weight must be [out, in] of D, the feed-forward width and the
vocabulary sizes, so that nothing computed here (a missing bias's zeros, the computed sinusoids)
is larger than what the file holds; heads, layers and scalars are checked by name in the same way.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from model.config import ModelConfig
from model.convert.bounds import MAX_LAYERS, check_state
from model.convert.ct2_model import CT2Model
from model.convert.errors import ConversionError

SPECS = {"TransformerSpec": None, "TransformerBase": 8, "TransformerBig": 16, "": 8}  # default heads
ACTIVATIONS = {0: "relu", 2: "swish", 3: "gelu"}  # CTranslate2's ops::ActivationType ids we compute
OTHER_ACTIVATIONS = {
    1: "GELU (tanh approximation)",
    4: "GELU (sigmoid approximation)",
    5: "tanh",
    6: "sigmoid",
}
BUILTIN_POSITIONS = 1024  # rows written for CTranslate2's computed sinusoids (it has no limit)
# Options with no effect on translations: one source embedding (nothing to merge), which attention
# heads CTranslate2 returns as alignments, ALiBi flags when ALiBi is off.
NO_EFFECT = (
    "embeddings_merge",
    "alignment_layer",
    "alignment_heads",
    "alibi",
    "alibi_use_positive_positions",
    "scale_alibi",
    "multi_query_attention",
)
NEVER = -1e9  # output bias of appended rows: a logit no real token comes near
# Layers and variables (by name) of options our Transformer does not compute.
UNSUPPORTED = {
    "relative_position_keys": "relative position representations",
    "relative_attention_bias": "relative attention bias (T5)",
    "relative_asymmetric_position_keys": "relative position representations",
    "rotary_dim": "rotary position embeddings",
    "num_heads_kv": "multi-query / grouped-query attention",
    "linear_0_noact": "a gated feed-forward block (GLU)",
    "layernorm_embedding": "a LayerNorm after the embeddings",
    "project_in": "projections between embeddings and layers",
    "project_out": "projections between embeddings and layers",
    "input_layer_norm": "parallel residual / pre-post layer norms",
    "shared_layer_norm": "parallel residual / pre-post layer norms",
    "pre_feedforward_layer_norm": "parallel residual / pre-post layer norms",
    "q_norm": "query/key normalisation",
    "k_norm": "query/key normalisation",
    "v_norm": "value normalisation",
    "sliding_window": "sliding-window attention",
    "low_rank_weight_1": "low-rank linear layers",
    "weight_zero": "AWQ quantization",
    "scale_outputs": "scaled decoder outputs",
    "layer_scalar": "scaled layer outputs",
    "memory_kv": "merged encoder attention",
}


@dataclass
class Imported:
    """What a CTranslate2 Transformer becomes: our config, state dict and vocabularies."""

    config: ModelConfig
    state: dict[str, torch.Tensor]
    source_vocabulary: list[str]
    target_vocabulary: list[str]
    shared_vocabulary: bool


def builtin_sinusoids(positions: int, depth: int) -> torch.Tensor:
    """CTranslate2's computed position encodings (layers/common.cc,
    generate_sinusoidal_position_encoding), row p for position p."""
    increment = math.log(10000.0) / (depth // 2 - 1)
    timescales = torch.exp(torch.arange(depth // 2, dtype=torch.float32) * -increment)
    scaled = torch.arange(1, positions + 1, dtype=torch.float32)[:, None] * timescales[None]
    return torch.cat([torch.sin(scaled), torch.cos(scaled)], dim=1)


def _scalar(file: object, name: str, value: torch.Tensor) -> float:
    """The one finite number ``value`` holds (``ConversionError`` naming ``name`` otherwise)."""
    if value.numel() != 1:
        raise ConversionError(f"{file}: {name} has shape {list(value.shape)}, not one value")
    number = float(value.reshape(()).item())
    if not math.isfinite(number):
        raise ConversionError(f"{file}: {name} is {number}")
    return number


def _shaped(file: object, name: str, value: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    if tuple(value.shape) != shape:
        raise ConversionError(f"{file}: {name} has shape {list(value.shape)}, the model needs {list(shape)}")
    return value


class _Variables:
    """The model's variables, each taken at most once, so that leftovers can be refused."""

    def __init__(self, ct2: CT2Model) -> None:
        self.file = ct2.path / "model.bin"
        self.left = dict(ct2.variables)

    def get(self, name: str) -> torch.Tensor | None:
        return self.left.pop(name, None)

    def take(self, name: str) -> torch.Tensor:
        value = self.get(name)
        if value is None:
            raise ConversionError(f"{self.file}: variable {name} is missing")
        return value

    def scalar(self, *names: str, default: float | None = None) -> float | None:
        """The first of ``names`` present (all are taken), else ``default``."""
        found = [(n, v) for n in names if (v := self.get(n)) is not None]
        return _scalar(self.file, *found[0]) if found else default

    def linear(self, scope: str, state: dict[str, torch.Tensor], ours: str, shape: tuple[int, int]) -> None:
        """The weight (``shape``: [out, in]) and bias ([out]; zeros when absent) at ``scope``."""
        weight = _shaped(self.file, f"{scope}/weight", self.take(f"{scope}/weight"), shape)
        bias = self.get(f"{scope}/bias")  # optional in CTranslate2 (OpenNMT-py without biases)
        state[f"{ours}.weight"] = weight
        state[f"{ours}.bias"] = (
            torch.zeros(shape[0]) if bias is None else _shaped(self.file, f"{scope}/bias", bias, shape[:1])
        )

    def norm(self, scope: str, state: dict[str, torch.Tensor], ours: str, width: int) -> None:
        gamma, beta = self.take(f"{scope}/gamma"), self.get(f"{scope}/beta")
        if beta is None:
            raise ConversionError(f"{self.file}: {scope} is an RMSNorm (no beta): not supported")
        state[f"{ours}.weight"] = _shaped(self.file, f"{scope}/gamma", gamma, (width,))
        state[f"{ours}.bias"] = _shaped(self.file, f"{scope}/beta", beta, (width,))


def _refuse_unsupported(ct2: CT2Model) -> None:
    file = ct2.path / "model.bin"
    if ct2.spec not in SPECS:
        raise ConversionError(
            f"{file}: spec {ct2.spec!r} is not an encoder-decoder Transformer (TransformerSpec)"
        )
    if ct2.revision < 2:
        raise ConversionError(f"{file}: spec revision 1 (OpenNMT-tf's variable names) is not supported")
    for name, value in ct2.variables.items():
        scopes = name.split("/")  # a layer (layernorm_embedding/gamma) or a variable (rotary_dim)
        for part in scopes:
            if part in UNSUPPORTED:
                raise ConversionError(f"{file}: {UNSUPPORTED[part]} ({name}) is not supported")
        last = scopes[-1]
        if last in ("alibi", "multi_query", "multi_query_attention") and value.numel() == 1 and value.item():
            raise ConversionError(f"{file}: {last} ({name}) is not supported")
    if ct2.config.get("multi_query_attention"):
        raise ConversionError(f"{ct2.path / 'config.json'}: multi_query_attention is not supported")
    if ct2.config.get("add_source_bos"):
        raise ConversionError(
            f"{ct2.path / 'config.json'}: add_source_bos (a bos before every source) is not supported"
        )


def _layers(ct2: CT2Model, stack: str) -> int:
    """How many layers ``stack`` has: its variables' ``layer_<i>/`` indices must be 0..n-1, n at
    most MAX_LAYERS (an index is read only when short enough to be one)."""
    file = ct2.path / "model.bin"
    layer = re.compile(rf"{stack}/layer_(\d+)/")
    indices: set[int] = set()
    for m in map(layer.match, ct2.variables):
        if m is None:
            continue
        digits = m.group(1)
        if len(digits) > len(str(MAX_LAYERS)) or int(digits) >= MAX_LAYERS or digits != str(int(digits)):
            shown = digits if len(digits) <= 12 else f"{digits[:12]}... ({len(digits)} digits)"
            raise ConversionError(f"{file}: {stack} layer index {shown} (at most {MAX_LAYERS} layers)")
        indices.add(int(digits))
    if not indices or indices != set(range(len(indices))):
        raise ConversionError(f"{file}: {stack} layers {sorted(indices)} are not 0..n-1")
    return len(indices)


def _stack_option(v: _Variables, name: str, default: float | None) -> float | None:
    """An option of both stacks (encoder/x, decoder/x; revisions < 5: a top-level x): one value."""
    enc = v.scalar(f"encoder/{name}", default=None)
    dec = v.scalar(f"decoder/{name}", default=None)
    top = v.scalar(name, default=default)
    enc, dec = (top if enc is None else enc), (top if dec is None else dec)
    if enc != dec:
        raise ConversionError(f"{v.file}: encoder {name}={enc} but decoder {name}={dec}: not supported")
    return enc


def _scale_embeddings(v: _Variables, d_model: int) -> bool:
    """CTranslate2's scale_embeddings (older: embeddings/multiply_by_sqrt_depth), a flag or the
    scale itself; absent means sqrt(depth) (layers/transformer.cc, build_embeddings_scale)."""
    scaled = set()
    for stack in ("encoder", "decoder"):
        found = [
            v.get(f"{stack}/{name}")
            for name in (
                "scale_embeddings",
                "embeddings/multiply_by_sqrt_depth",
                "embeddings_0/multiply_by_sqrt_depth",
            )
        ]
        value = next((f for f in found if f is not None), None)
        number = None if value is None else _scalar(v.file, f"{stack}/scale_embeddings", value)
        if number is None or (value is not None and value.dtype == torch.int8 and number):
            scaled.add(True)
        elif (value is not None and value.dtype == torch.int8) or number == 1.0:
            scaled.add(False)
        elif math.isclose(number, math.sqrt(d_model), rel_tol=1e-6):
            scaled.add(True)
        else:
            raise ConversionError(f"{v.file}: {stack} embeddings scaled by {number}: not supported")
    if len(scaled) != 1:
        raise ConversionError(f"{v.file}: encoder and decoder embeddings scaled differently: not supported")
    return scaled.pop()


def _heads(v: _Variables, d_model: int, default: int) -> int:
    """The number of attention heads: a whole number from 1 to ``d_model`` that divides it."""
    heads = _stack_option(v, "num_heads", default)
    assert heads is not None
    if heads != int(heads) or not 1 <= heads <= d_model or d_model % int(heads):
        raise ConversionError(
            f"{v.file}: num_heads {heads} does not split the width {d_model} into whole heads"
        )
    return int(heads)


def _embeddings(ct2: CT2Model, v: _Variables) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(source, target) embeddings and the width D: each [tokens of its vocabulary, D]."""
    src_emb = v.get("encoder/embeddings/weight")
    src_emb = v.take("encoder/embeddings_0/weight") if src_emb is None else src_emb
    tgt_emb = v.take("decoder/embeddings/weight")
    if tgt_emb.dim() != 2:
        raise ConversionError(f"{v.file}: decoder/embeddings/weight has shape {list(tgt_emb.shape)}, not 2-D")
    d_model = tgt_emb.shape[1]
    for vocab, emb, fname, side in (
        (ct2.source_vocabulary, src_emb, ct2.vocabulary_files[0], "encoder"),
        (ct2.target_vocabulary, tgt_emb, ct2.vocabulary_files[-1], "decoder"),
    ):
        if emb.dim() != 2 or emb.shape[1] != d_model:
            raise ConversionError(
                f"{v.file}: the {side} embeddings have shape {list(emb.shape)}, the model needs "
                f"[tokens, {d_model}]"
            )
        if len(vocab) != emb.shape[0]:
            raise ConversionError(
                f"{ct2.path / fname}: {len(vocab)} tokens, but {v.file} has {emb.shape[0]} embedding rows"
            )
    return src_emb, tgt_emb, d_model


def from_ct2(ct2: CT2Model) -> Imported:
    """Our config, state dict and vocabularies for the CTranslate2 Transformer ``ct2``."""
    _refuse_unsupported(ct2)
    v = _Variables(ct2)
    file = v.file
    enc_n, dec_n = _layers(ct2, "encoder"), _layers(ct2, "decoder")
    src_emb, tgt_emb, d_model = _embeddings(ct2, v)
    n_heads = _heads(v, d_model, SPECS[ct2.spec] or 8)
    head_dim = d_model // n_heads
    for key in [k for k in v.left if k.endswith(("/queries_scale", "/head_dim"))]:
        value = _scalar(file, key, v.take(key))
        want = 1 / math.sqrt(head_dim) if key.endswith("queries_scale") else head_dim
        if not math.isclose(value, want, rel_tol=1e-6):
            raise ConversionError(f"{file}: {key}={value} is not supported (ours: {want})")
    pre_norm = bool(_stack_option(v, "pre_norm", 1.0))  # CTranslate2's default is pre-norm
    act = _stack_option(v, "activation", 0.0) or 0.0
    if act not in ACTIVATIONS:
        what = OTHER_ACTIVATIONS.get(int(act), f"activation id {act}") if act == int(act) else f"id {act}"
        raise ConversionError(f"{file}: the activation {what} is not supported (relu, swish, gelu are)")
    act_id = int(act)
    for name in NO_EFFECT:
        for key in (name, f"encoder/{name}", f"decoder/{name}"):
            v.get(key)
    scale = _scale_embeddings(v, d_model)
    zero_start = bool(v.scalar("decoder/start_from_zero_embedding", default=0.0))

    # The feed-forward width, from the first layer (each layer's weights are checked against it).
    fc1 = v.left.get("encoder/layer_0/ffn/linear_0/weight")
    d_ff = fc1.shape[0] if fc1 is not None and fc1.dim() == 2 else 0
    if d_ff == 0:
        raise ConversionError(f"{file}: encoder/layer_0/ffn/linear_0/weight is missing or not 2-D")
    d, f = d_model, d_ff
    state: dict[str, torch.Tensor] = {}
    for stack, n in (("encoder", enc_n), ("decoder", dec_n)):
        for i in range(n):
            ct, ours = f"{stack}/layer_{i}", f"{stack}.{i}"
            v.linear(f"{ct}/self_attention/linear_0", state, f"{ours}.self_attn.qkv", (3 * d, d))
            v.linear(f"{ct}/self_attention/linear_1", state, f"{ours}.self_attn.out", (d, d))
            v.norm(
                f"{ct}/self_attention/layer_norm",
                state,
                f"{ours}.{'attn' if stack == 'encoder' else 'self'}_norm.norm",
                d,
            )
            if stack == "decoder":
                v.linear(f"{ct}/attention/linear_0", state, f"{ours}.cross_attn.q", (d, d))
                v.linear(f"{ct}/attention/linear_1", state, f"{ours}.cross_attn.kv", (2 * d, d))
                v.linear(f"{ct}/attention/linear_2", state, f"{ours}.cross_attn.out", (d, d))
                v.norm(f"{ct}/attention/layer_norm", state, f"{ours}.cross_norm.norm", d)
            v.linear(f"{ct}/ffn/linear_0", state, f"{ours}.ff.fc1", (f, d))
            v.linear(f"{ct}/ffn/linear_1", state, f"{ours}.ff.fc2", (d, f))
            v.norm(f"{ct}/ffn/layer_norm", state, f"{ours}.ff_norm.norm", d)
    finals = [s for s in ("encoder", "decoder") if f"{s}/layer_norm/gamma" in v.left]
    if pre_norm and len(finals) != 2:
        raise ConversionError(f"{file}: pre-norm without a final LayerNorm in each stack is not supported")
    if not pre_norm and finals:
        raise ConversionError(f"{file}: post-norm with a final LayerNorm ({finals[0]}) is not supported")
    for s in finals:
        v.norm(f"{s}/layer_norm", state, f"{s}_norm", d)

    enc_pos, dec_pos = (
        v.get("encoder/position_encodings/encodings"),
        v.get("decoder/position_encodings/encodings"),
    )
    for side, table in (("encoder", enc_pos), ("decoder", dec_pos)):
        if table is not None and (table.dim() != 2 or table.shape[1] != d):
            raise ConversionError(
                f"{file}: {side}/position_encodings/encodings has shape {list(table.shape)}, the model "
                f"needs [positions, {d}]"
            )
    if enc_pos is None and dec_pos is None:
        if d_model < 4 or d_model % 2:  # sin and cos halves, frequencies over D/2 - 1 steps
            raise ConversionError(f"{file}: computed position encodings need an even width of 4 or more")
        table = builtin_sinusoids(BUILTIN_POSITIONS, d_model)  # D is checked: the weights are D x D
    elif enc_pos is not None and dec_pos is not None and torch.equal(enc_pos, dec_pos):
        table = enc_pos
    else:
        raise ConversionError(
            f"{file}: different position encodings for encoder and decoder are not supported"
        )
    state["positions.table"] = table

    vocab = tgt_emb.shape[0]
    proj_w = _shaped(file, "decoder/projection/weight", v.take("decoder/projection/weight"), (vocab, d))
    proj_b = v.get("decoder/projection/bias")
    if proj_b is not None:
        _shaped(file, "decoder/projection/bias", proj_b, (vocab,))
    if v.left:
        names = ", ".join(sorted(v.left)[:5])
        raise ConversionError(
            f"{file}: variables this converter does not know (an unsupported option?): {names}"
        )
    imported = _vocabularies(ct2, src_emb, tgt_emb, proj_w, proj_b, state, dict(
        d_model=d_model, n_heads=n_heads, encoder_layers=enc_n, decoder_layers=dec_n,
        d_ff=d_ff, activation=ACTIVATIONS[act_id], pre_norm=pre_norm,
        positions="learned", max_positions=table.shape[0], scale_embeddings=scale, dropout=0.0,
    ), zero_start)  # fmt: skip
    check_state(imported.config, imported.state, str(file))
    return imported


def _vocabularies(
    ct2: CT2Model,
    src_emb: torch.Tensor,
    tgt_emb: torch.Tensor,
    proj_w: torch.Tensor,
    proj_b: torch.Tensor | None,
    state: dict[str, torch.Tensor],
    cfg: dict[str, Any],
    zero_start: bool,
) -> Imported:
    """Special ids, shared/tied matrices and appended rows (a zero start token, a pad token)."""
    src_vocab, tgt_vocab = list(ct2.source_vocabulary), list(ct2.target_vocabulary)
    shared = ct2.shared_vocabulary or src_vocab == tgt_vocab
    share_emb = shared and torch.equal(src_emb, tgt_emb)
    tie = torch.equal(proj_w, tgt_emb)
    bias = proj_b if proj_b is not None else torch.zeros(len(tgt_vocab))

    def append(piece: str) -> int:
        """A zero row (embedding and projection) that is never produced: a start or pad token."""
        nonlocal src_emb, tgt_emb, proj_w, bias
        tgt_vocab.append(piece)
        tgt_emb, proj_w = _grow(tgt_emb), _grow(proj_w)
        bias = torch.cat([bias, torch.tensor([NEVER])])
        if shared:
            src_vocab.append(piece)
            src_emb = _grow(src_emb)
        return len(tgt_vocab) - 1

    conf = ct2.config
    bos = append(_free_name(tgt_vocab, "<pad>", "<zero_start>")) if zero_start else None
    pad_piece: str | None = next((p for p in ("<blank>", "<pad>") if p in tgt_vocab), None)
    if pad_piece is None:
        if not shared:
            raise ConversionError(f"{ct2.path}: no padding token (<blank> or <pad>) in the vocabularies")
        pad_piece = tgt_vocab[append("<pad>")]
    ids: dict[str, Any] = {}
    for name, piece in (
        ("pad_id", pad_piece),
        ("unk_id", conf.get("unk_token", "<unk>")),
        ("eos_id", conf.get("eos_token", "</s>")),
        ("bos_id", conf.get("decoder_start_token", "<s>") if bos is None else tgt_vocab[bos]),
    ):
        if piece is None:
            raise ConversionError(
                f"{ct2.path / 'config.json'}: decoder_start_token is null (the caller gives the first "
                "target token): not supported"
            )
        if piece not in tgt_vocab:
            raise ConversionError(
                f"{ct2.path}: special token {piece!r} ({name}) is not in the target vocabulary"
            )
        ids[name] = tgt_vocab.index(piece)
        # pad, unk and eos are source ids too (one id each in our config).
        if (
            name != "bos_id"
            and not shared
            and (piece not in src_vocab or src_vocab.index(piece) != ids[name])
        ):
            raise ConversionError(
                f"{ct2.path}: {piece!r} ({name}) is not at the same id in the source vocabulary"
            )
    state["embed.weight"] = tgt_emb
    if not share_emb:
        state["src_embed.weight"] = src_emb
    if not tie:
        state["out_proj.weight"] = proj_w
    output_bias = bool(bias.abs().max() > 0)
    if output_bias:
        state["output_bias"] = bias
    try:
        config = ModelConfig(
            vocab_size=len(tgt_vocab), source_vocab_size=0 if shared else len(src_vocab),
            share_embeddings=share_emb, tie_output=tie, output_bias=output_bias,
            layer_norm_eps=float(conf.get("layer_norm_epsilon") or 1e-5), **cfg, **ids,
            # Whether CTranslate2 ends sources with eos: not for OpenNMT-py's models (most Argos ones).
            source_eos=bool(conf.get("add_source_eos", False)),
        )  # fmt: skip
    except (TypeError, ValueError) as e:  # e.g. a layer_norm_epsilon that is not a number
        raise ConversionError(f"{ct2.path}: {e}") from e
    return Imported(config, state, src_vocab, tgt_vocab, shared)


def _grow(matrix: torch.Tensor) -> torch.Tensor:
    return torch.cat([matrix, matrix.new_zeros(1, matrix.shape[1])])


def _free_name(vocab: list[str], *names: str) -> str:
    return next(n for n in names if n not in vocab)
