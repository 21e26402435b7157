"""Convert a model directory into a CTranslate2 model directory.

    python -m model.export_ctranslate2 --model artifacts/multi30k-de-en --out ct2-de-en [--quantization int8]

Our Transformer is the architecture CTranslate2's ``TransformerSpec`` describes (sinusoidal
positions, scaled embeddings, post- or pre-LN, ReLU FFN), so conversion is a renaming of weights:
our fused self-attention QKV and cross-attention KV projections are already laid out as CTranslate2
fuses them ([q; k; v] rows). The sinusoidal table is exported explicitly, so the two engines do not
depend on agreeing about sin/cos interleaving. The SentencePiece model is copied beside the
converted model; CTranslate2 takes *pieces* (``tokenizer.pieces``), we take ids.

Translating with the result::

    import ctranslate2, sentencepiece as spm
    tr = ctranslate2.Translator("ct2-de-en")
    sp = spm.SentencePieceProcessor(model_file="ct2-de-en/sentencepiece.model")
    out = tr.translate_batch([sp.encode("Ein Hund läuft.", out_type=str)])
    print(sp.decode(out[0].hypotheses[0]))

The source end-of-sentence token our model was trained with is added by CTranslate2 itself
(``add_source_eos``), so callers pass plain pieces to both engines. ``translate_options.json``
beside the model holds our ``DecodeOptions`` as ``translate_batch``'s keyword arguments
(``ctranslate2_options``): ``tr.translate_batch(batch, **json.load(...))`` decodes as we do.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from model.checkpoint import ModelDirError, load_model, load_tokenizer, read_info, tokenizer_files
from model.decoding.options import DecodeOptions, ctranslate2_options
from model.transformer import Transformer

if TYPE_CHECKING:
    from ctranslate2.specs.transformer_spec import TransformerSpec

QUANTIZATIONS = ("float32", "float16", "bfloat16", "int8", "int8_float32", "int8_float16", "int8_bfloat16")


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float32).contiguous().numpy()


def _linear(spec: Any, module: nn.Linear) -> None:
    spec.weight = _np(module.weight)  # (out, in): the layout CTranslate2 expects, like nn.Linear
    if module.bias is not None:
        spec.bias = _np(module.bias)


def _norm(spec: Any, module: nn.LayerNorm) -> None:
    spec.gamma = _np(module.weight)
    spec.beta = _np(module.bias)


def build_spec(
    model: Transformer, pieces: list[str], source_pieces: list[str] | None = None
) -> TransformerSpec:
    """The CTranslate2 specification holding ``model``'s weights; ``pieces`` is the target
    vocabulary in id order, ``source_pieces`` the source's when it has its own."""
    from ctranslate2.specs import common_spec, transformer_spec

    cfg = model.cfg
    activation = {
        "relu": common_spec.Activation.RELU,
        "swish": common_spec.Activation.SWISH,
        "gelu": common_spec.Activation.GELU,
    }[cfg.activation]
    spec = transformer_spec.TransformerSpec.from_config(
        (cfg.encoder_layers, cfg.decoder_layers), cfg.n_heads, pre_norm=cfg.pre_norm, activation=activation
    )
    # Every layout of ours (model.layers.Positions) exported as the table it is: (max_positions, D),
    # row i for position i.
    positions = _np(model.positions.table)
    src_embed = model.src_embed if model.src_embed is not None else model.embed
    spec.encoder.embeddings[0].weight = _np(src_embed.weight)  # a list: CT2 allows several sources
    spec.decoder.embeddings.weight = _np(model.embed.weight)
    for stack in (spec.encoder, spec.decoder):
        stack.scale_embeddings = cfg.scale_embeddings  # x * sqrt(D), as Transformer._embed
        stack.position_encodings.encodings = positions
    spec.decoder.projection.weight = _np(model.output_weight)
    bias = model.output_bias
    spec.decoder.projection.bias = np.zeros(cfg.vocab_size, dtype=np.float32) if bias is None else _np(bias)

    for layer_spec, layer in zip(spec.encoder.layer, model.encoder, strict=True):
        _linear(layer_spec.self_attention.linear[0], layer.self_attn.qkv)  # fused [q; k; v]
        _linear(layer_spec.self_attention.linear[1], layer.self_attn.out)
        _norm(layer_spec.self_attention.layer_norm, layer.attn_norm.norm)
        _linear(layer_spec.ffn.linear_0, layer.ff.fc1)
        _linear(layer_spec.ffn.linear_1, layer.ff.fc2)
        _norm(layer_spec.ffn.layer_norm, layer.ff_norm.norm)
    for layer_spec, dlayer in zip(spec.decoder.layer, model.decoder, strict=True):
        _linear(layer_spec.self_attention.linear[0], dlayer.self_attn.qkv)
        _linear(layer_spec.self_attention.linear[1], dlayer.self_attn.out)
        _norm(layer_spec.self_attention.layer_norm, dlayer.self_norm.norm)
        _linear(layer_spec.attention.linear[0], dlayer.cross_attn.q)
        _linear(layer_spec.attention.linear[1], dlayer.cross_attn.kv)  # fused [k; v]
        _linear(layer_spec.attention.linear[2], dlayer.cross_attn.out)
        _norm(layer_spec.attention.layer_norm, dlayer.cross_norm.norm)
        _linear(layer_spec.ffn.linear_0, dlayer.ff.fc1)
        _linear(layer_spec.ffn.linear_1, dlayer.ff.fc2)
        _norm(layer_spec.ffn.layer_norm, dlayer.ff_norm.norm)
    if model.encoder_norm is not None and model.decoder_norm is not None:  # pre-LN: one per stack
        _norm(spec.encoder.layer_norm, model.encoder_norm)
        _norm(spec.decoder.layer_norm, model.decoder_norm)

    spec.register_source_vocabulary(pieces if source_pieces is None else source_pieces)
    spec.register_target_vocabulary(pieces)
    spec.config.bos_token = pieces[cfg.bos_id]
    spec.config.eos_token = pieces[cfg.eos_id]
    spec.config.unk_token = pieces[cfg.unk_id]
    spec.config.decoder_start_token = pieces[cfg.bos_id]  # the decoder's first input, as ours
    spec.config.add_source_eos = cfg.source_eos  # whether the encoder was trained on pieces + eos
    spec.config.layer_norm_epsilon = cfg.layer_norm_eps
    return spec


OPTIONS_FILE = "translate_options.json"


def export(
    model_dir: str | Path,
    out: str | Path,
    *,
    quantization: str = "float32",
    force: bool = False,
    options: DecodeOptions | None = None,
) -> Path:
    """Convert ``model_dir`` to a CTranslate2 model in ``out`` (weights stored as ``quantization``),
    with ``options`` (default: ours) as CTranslate2's decoding options in ``OPTIONS_FILE``."""
    info = read_info(model_dir)
    tokenizer = load_tokenizer(model_dir, info)
    model = load_model(model_dir, info)
    source = None if model.cfg.share_embeddings else tokenizer.vocabulary(source=True)
    spec = build_spec(model, tokenizer.vocabulary(), source)
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not force:
        raise FileExistsError(f"{out} exists and is not empty (use --force to overwrite)")
    out.mkdir(parents=True, exist_ok=True)
    spec.validate()
    spec.optimize(quantization=quantization)
    spec.save(str(out))
    for file in tokenizer_files(model_dir):  # CTranslate2 takes pieces: the caller tokenizes
        if not (out / file.name).exists():  # its vocabulary files are its own, written by save()
            shutil.copyfile(file, out / file.name)
    decoding = ctranslate2_options(options or DecodeOptions())
    (out / OPTIONS_FILE).write_text(json.dumps(decoding, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model", required=True, help="our model directory (config.json, model.safetensors, ...)"
    )
    ap.add_argument("--out", required=True, help="directory for the CTranslate2 model")
    ap.add_argument(
        "--quantization",
        default="float32",
        choices=QUANTIZATIONS,
        help="weight type stored (default float32)",
    )
    ap.add_argument("--force", action="store_true", help="overwrite a non-empty --out")
    args = ap.parse_args(argv)
    try:
        import ctranslate2  # noqa: F401
    except ImportError:
        print("error: the ctranslate2 package is not installed (pip install ctranslate2)", file=sys.stderr)
        return 2
    try:
        out = export(args.model, args.out, quantization=args.quantization, force=args.force)
    except (ModelDirError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
