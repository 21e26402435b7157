"""Import a Hugging Face MarianMTModel directory (OPUS-MT) as a model directory.

    python -m model.convert marian opus-mt-de-en OUT_DIR [--source de --target en]

Reads config.json, the weights (model.safetensors, its shards, or pytorch_model.bin loaded with
``weights_only``: never unpickled otherwise), source.spm, target.spm, vocab.json (and
target_vocab.json for separate vocabularies) itself: transformers is the tests' oracle, not a
dependency. The mapping onto our state dict, as transformers 5 computes a Marian model:

* post-norm layers, LayerNorm eps 1e-5, no final or embedding LayerNorms, biases everywhere;
* q/k/v projections fused into ``qkv`` rows [q; k; v], cross-attention k/v into ``kv`` [k; v];
* token embeddings times sqrt(d_model) when ``scale_embedding``; positions [sin | cos] halves
  (``sinusoidal_halves``) unless the weights carry another table (``learned``);
* ``lm_head`` + ``final_logits_bias`` (kept as ``output_bias`` whenever present);
* the decoder starts from ``decoder_start_token_id`` (pad), ends at eos; unk is vocab.json's.

The directory may come from anywhere: config.json's sizes are bounded (``model.convert.bounds``)
and every tensor's shape is checked against the config before it is fused, compared or used to
compute a table; ``model.convert.marian_files`` reads the files with bounds of its own.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from model.config import ModelConfig
from model.convert.bounds import (
    MAX_LAYERS,
    MAX_POSITIONS,
    MAX_WIDTH,
    check_state,
    expected_shapes,
)
from model.convert.errors import ConversionError
from model.convert.marian_files import read_json, read_object, read_vocabularies, read_weights
from model.directory import (
    CONFIG_FILE,
    MODEL_CARD,
    SHARED_VOCAB,
    SOURCE_SPM,
    SOURCE_VOCAB,
    TARGET_SPM,
    TARGET_VOCAB,
    WEIGHTS_FILE,
    ModelInfo,
)
from model.layers import sinusoids

ACTIVATIONS = {"swish": "swish", "silu": "swish", "relu": "relu", "gelu": "gelu"}
LICENCE = "CC-BY-4.0 (OPUS-MT) unless stated"
# OPUS-MT's language tokens and names use ISO 639-3 where the service uses ISO 639-1.
ISO639_1 = {
    "ara": "ar", "bul": "bg", "cat": "ca", "ces": "cs", "cym": "cy", "dan": "da", "deu": "de",
    "ell": "el", "eng": "en", "est": "et", "eus": "eu", "fin": "fi", "fra": "fr", "gle": "ga",
    "glg": "gl", "heb": "he", "hin": "hi", "hrv": "hr", "hun": "hu", "ind": "id", "isl": "is",
    "ita": "it", "jpn": "ja", "kor": "ko", "lav": "lv", "lit": "lt", "mlt": "mt", "nld": "nl",
    "nor": "no", "nob": "nb", "pol": "pl", "por": "pt", "ron": "ro", "rus": "ru", "slk": "sk",
    "slv": "sl", "spa": "es", "srp": "sr", "swe": "sv", "tur": "tr", "ukr": "uk", "vie": "vi",
    "zho": "zh", "fas": "fa", "epo": "eo", "oci": "oc", "lat": "la", "glv": "gv", "bel": "be",
}  # fmt: skip
LANGUAGE_TOKEN = re.compile(r"^>>([A-Za-z][A-Za-z_]*)<<$")
# Our names (under encoder.{i}. / decoder.{i}.) <- transformers' (under model.encoder.layers.{i}. /
# model.decoder.layers.{i}.), several fused along the rows in this order: [q; k; v] and [k; v].
_COMMON = {
    "self_attn.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.out": ("self_attn.out_proj",),
    "ff.fc1": ("fc1",),
    "ff.fc2": ("fc2",),
    "ff_norm.norm": ("final_layer_norm",),
}
LAYERS = {
    "encoder": {**_COMMON, "attn_norm.norm": ("self_attn_layer_norm",)},
    "decoder": {
        **_COMMON,
        "self_norm.norm": ("self_attn_layer_norm",),
        "cross_attn.q": ("encoder_attn.q_proj",),
        "cross_attn.kv": ("encoder_attn.k_proj", "encoder_attn.v_proj"),
        "cross_attn.out": ("encoder_attn.out_proj",),
        "cross_norm.norm": ("encoder_attn_layer_norm",),
    },
}
OPUS_NAME = re.compile(r"^opus-mt-(?:tc-(?:big|base)-)?([A-Za-z_]+)-([A-Za-z_]+)$")
# Options of a Bart-style config.json that transformers' Marian ignores but that would mean another
# architecture than the one it computes: refused rather than silently converted.
UNSUPPORTED = {
    "normalize_before": "pre-norm layers (transformers' Marian is post-norm only)",
    "normalize_embedding": "a LayerNorm on the embeddings",
    "layernorm_embedding": "a LayerNorm on the embeddings",
    "add_final_layer_norm": "final LayerNorms",
    "add_bias_logits": "a bias on the logits other than final_logits_bias",
}


def convert(
    src: Path, out: Path, *, source: str | None = None, target: str | None = None, force: bool = False,
    command: str = "",
) -> Path:  # fmt: skip
    """Write the model directory ``out`` from the MarianMTModel directory ``src``; ``ConversionError``
    naming the problem (nothing written), ``FileExistsError`` for a non-empty ``out`` without ``force``."""
    src, out = Path(src), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise FileExistsError(f"{out}: exists and is not empty (--force replaces it)")
    if src.resolve() == out.resolve() or out.resolve() in src.resolve().parents:
        raise ConversionError(f"{out}: would overwrite the model being converted")
    hf = _read_config(src)
    weights = read_weights(src)
    vocab, target_vocab = read_vocabularies(src)
    cfg, state = _state_dict(hf, weights, vocab, target_vocab, src)
    info = _info(cfg, src, vocab, source, target, command)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        dtype = torch.float16 if all(v.dtype == torch.float16 for v in weights.values()) else torch.float32
        save_file({k: v.to(dtype).contiguous() for k, v in state.items()}, str(tmp / WEIGHTS_FILE))
        for name in (SOURCE_SPM, TARGET_SPM):
            shutil.copyfile(src / name, tmp / name)
        if target_vocab == vocab:
            (tmp / SHARED_VOCAB).write_text(json.dumps(vocab, ensure_ascii=False) + "\n", encoding="utf-8")
        else:
            for name, pieces in ((SOURCE_VOCAB, vocab), (TARGET_VOCAB, target_vocab)):
                (tmp / name).write_text(json.dumps(pieces, ensure_ascii=False) + "\n", encoding="utf-8")
        (tmp / CONFIG_FILE).write_text(json.dumps(info.to_json(), indent=2) + "\n")
        (tmp / MODEL_CARD).write_text(_model_card(info), encoding="utf-8")
        if out.is_dir():
            shutil.rmtree(out)
        elif out.exists():
            out.unlink()
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _read_config(src: Path) -> dict[str, Any]:
    file = src / "config.json"
    if not file.is_file():
        raise ConversionError(f"{file}: missing (is {src} a Hugging Face MarianMTModel directory?)")
    hf = read_json(file)
    if not isinstance(hf, dict) or hf.get("model_type") != "marian":
        kind = hf.get("model_type") if isinstance(hf, dict) else None
        raise ConversionError(f"{file}: model_type is {kind!r}, not 'marian' (a MarianMTModel directory)")
    for key, what in UNSUPPORTED.items():
        if hf.get(key):
            raise ConversionError(f"{file}: {key}: {hf[key]} asks for {what}, which is not supported")
    for a, b in (
        ("encoder_ffn_dim", "decoder_ffn_dim"),
        ("encoder_attention_heads", "decoder_attention_heads"),
    ):
        if hf.get(a) != hf.get(b):
            raise ConversionError(f"{file}: {a} {hf.get(a)} != {b} {hf.get(b)}: not supported (one width)")
    if str(hf.get("activation_function", "gelu")) not in ACTIVATIONS:
        raise ConversionError(
            f"{file}: activation_function {hf['activation_function']!r} is not supported "
            f"(one of {', '.join(ACTIVATIONS)})"
        )
    return hf


def _take(weights: dict[str, torch.Tensor], *names: str) -> torch.Tensor:
    """The first of ``names`` the checkpoint has."""
    found = next((name for name in names if name in weights), None)
    if found is None:
        raise ConversionError(f"the weights have no {' or '.join(names)}")
    return weights[found]


def _embeddings(
    hf: dict[str, Any], weights: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(encoder, decoder, output) matrices as transformers 5 ties them: all one (model.shared) when
    tie_word_embeddings and share_encoder_decoder_embeddings; with tie_word_embeddings false each
    module keeps its own (sharing too is off); with sharing off the output is the decoder's."""
    tie, share = hf.get("tie_word_embeddings", True), hf.get("share_encoder_decoder_embeddings", True)
    shared = ("model.shared.weight",) if share else ()
    if tie and share:
        sides = ("model.decoder.embed_tokens.weight", "model.encoder.embed_tokens.weight", "lm_head.weight")
        one = _take(weights, "model.shared.weight", *sides)
        return one, one, one
    enc = _take(weights, "model.encoder.embed_tokens.weight", *shared)
    dec = _take(weights, "model.decoder.embed_tokens.weight", *shared)
    return enc, dec, dec if tie else _take(weights, "lm_head.weight")


def _positions(
    hf: dict[str, Any], weights: dict[str, torch.Tensor], rows: int, width: int
) -> tuple[str, Any]:
    """ "sinusoidal_halves", or "learned" with the table when the checkpoint carries one that is not
    the sinusoid (transformers loads a stored table over the one it computes)."""
    tables = [weights.get(f"model.{side}.embed_positions.weight") for side in ("encoder", "decoder")]
    if all(t is None for t in tables):
        if hf.get("static_position_embeddings") is False:
            raise ConversionError("config.json asks for learned positions, but the weights have no table")
        return "sinusoidal_halves", None
    for table in tables:  # before the reference is computed: its size is the config's
        if table is not None and tuple(table.shape) != (rows, width):
            raise ConversionError(f"embed_positions.weight is {tuple(table.shape)}, expected {(rows, width)}")
    reference = sinusoids(rows, width, halves=True)
    filled = [reference if t is None else t.float() for t in tables]
    # Our float32 sinusoid is within 3e-5 of transformers' (float64, then rounded) at 512 x 512.
    if all(torch.allclose(t, reference, rtol=0, atol=1e-4) for t in filled):
        return "sinusoidal_halves", None
    if not torch.equal(filled[0], filled[1]):
        raise ConversionError("the encoder's and the decoder's position tables differ: not supported")
    return "learned", filled[0]


def _layers(
    weights: dict[str, torch.Tensor], cfg: ModelConfig, expected: dict[str, tuple[int, ...]]
) -> dict[str, torch.Tensor]:
    """Every layer's tensors under our names, fused per ``LAYERS``, each part checked against the
    shape ``expected`` implies (our fused rows split evenly) before it is fused; those used leave
    ``weights``."""
    state: dict[str, torch.Tensor] = {}
    for side, count in (("encoder", cfg.encoder_layers), ("decoder", cfg.decoder_layers)):
        for i in range(count):
            for ours, theirs in LAYERS[side].items():
                for kind in ("weight", "bias"):
                    names = [f"model.{side}.layers.{i}.{t}.{kind}" for t in theirs]
                    rows, *rest = expected[f"{side}.{i}.{ours}.{kind}"]
                    want = (rows // len(names), *rest)
                    parts = [_take(weights, n) for n in names]
                    for name, part in zip(names, parts, strict=True):
                        if tuple(part.shape) != want:
                            raise ConversionError(
                                f"{name}: shape {tuple(part.shape)}, config.json implies {want}"
                            )
                    state[f"{side}.{i}.{ours}.{kind}"] = torch.cat(parts)
                    for name in names:
                        del weights[name]
    return state


def _count(hf: dict[str, Any], key: str, default: int, most: int, src: Path) -> int:
    """config.json's ``key``: a whole number from 1 to ``most``."""
    value = hf.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
        raise ConversionError(
            f"{src / 'config.json'}: {key} {value!r} is not a whole number from 1 to {most}"
        )
    return value


def _state_dict(
    hf: dict[str, Any], weights: dict[str, torch.Tensor], vocab: list[str], target_vocab: list[str], src: Path
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    weights = dict(weights)
    enc, dec, out = _embeddings(hf, weights)
    d_model = _count(hf, "d_model", enc.size(1) if enc.dim() == 2 else 0, MAX_WIDTH, src)
    for what, matrix in (("the encoder's embedding", enc), ("the decoder's", dec), ("lm_head.weight", out)):
        if matrix.dim() != 2 or matrix.size(1) != d_model:
            raise ConversionError(
                f"{src}: {what} has shape {tuple(matrix.shape)}, config.json's d_model is {d_model}"
            )
    for what, pieces, matrix in (("vocab.json", vocab, enc), ("the target vocabulary", target_vocab, dec)):
        if len(pieces) != matrix.size(0):
            raise ConversionError(
                f"{src}: {what} has {len(pieces)} pieces but its embedding {matrix.size(0)} rows: "
                "the vocabulary does not match the weights"
            )
    if out.size(0) != dec.size(0):
        raise ConversionError(f"lm_head.weight has {out.size(0)} rows, the decoder's embedding {dec.size(0)}")
    max_positions = _count(hf, "max_position_embeddings", 1024, MAX_POSITIONS, src)
    heads = _count(hf, "encoder_attention_heads", 16, d_model, src)
    if d_model % heads:
        raise ConversionError(
            f"{src / 'config.json'}: {heads} attention heads do not divide d_model {d_model}"
        )
    positions, table = _positions(hf, weights, max_positions, d_model)
    eos = hf.get("eos_token_id", 0)
    eos = eos[0] if isinstance(eos, list) and eos else eos
    pad = hf.get("pad_token_id", vocab.index("<pad>") if "<pad>" in vocab else None)
    if "<unk>" not in vocab or pad is None:
        raise ConversionError(f"{src}: vocab.json has no <unk>, or config.json no pad_token_id")
    bias = weights.get("final_logits_bias")
    if bias is not None and tuple(bias.shape) not in ((1, dec.size(0)), (dec.size(0),)):
        raise ConversionError(
            f"final_logits_bias has shape {tuple(bias.shape)}, the target vocabulary {dec.size(0)} pieces"
        )
    same = enc is dec or (enc.shape == dec.shape and torch.equal(enc, dec))
    try:
        cfg = ModelConfig(
            vocab_size=len(target_vocab),
            source_vocab_size=0 if target_vocab == vocab else len(vocab),
            d_model=d_model,
            n_heads=heads,
            encoder_layers=_count(hf, "encoder_layers", 12, MAX_LAYERS, src),
            decoder_layers=_count(hf, "decoder_layers", 12, MAX_LAYERS, src),
            d_ff=_count(hf, "encoder_ffn_dim", 4096, MAX_WIDTH, src),
            dropout=float(hf.get("dropout", 0.1)),
            attention_dropout=float(hf.get("attention_dropout", 0.0)),
            activation_dropout=float(hf.get("activation_dropout", 0.0)),
            activation=ACTIVATIONS[str(hf.get("activation_function", "gelu"))],
            pre_norm=False,
            positions=positions,
            max_positions=max_positions,
            scale_embeddings=bool(hf.get("scale_embedding", False)),
            share_embeddings=same and target_vocab == vocab,
            tie_output=out is dec or torch.equal(out, dec),
            output_bias=True,  # final_logits_bias, and pad's mask below
            layer_norm_eps=1e-5,  # nn.LayerNorm's default, which transformers' Marian uses
            source_eos=True,  # MarianTokenizer ends every source with </s>
            pad_id=int(pad),
            unk_id=vocab.index("<unk>"),
            bos_id=int(hf.get("decoder_start_token_id", pad)),
            eos_id=int(eos),
        )
    except (TypeError, ValueError) as e:
        raise ConversionError(f"{src / 'config.json'}: {e}") from e
    state = _layers(weights, cfg, expected_shapes(cfg, "config.json"))
    state["embed.weight"] = dec
    if not cfg.share_embeddings:
        state["src_embed.weight"] = enc
    if not cfg.tie_output:
        state["out_proj.weight"] = out
    # <pad> is not in Marian's own vocabulary (the conversion to transformers appended it), and
    # neither Marian, CTranslate2 nor transformers' generate (bad_words_ids) ever produce it: its
    # logit is masked so that ours do not either, and its probability mass is not normalised over.
    state["output_bias"] = torch.zeros(cfg.vocab_size) if bias is None else bias.reshape(-1).clone()
    state["output_bias"][cfg.pad_id] = PAD_LOGIT
    if table is not None:
        state["positions.table"] = table
    _check_leftovers(weights)
    check_state(cfg, state, "config.json")
    return cfg, state


PAD_LOGIT = -1e9  # what CTranslate2 imports of Argos use too: finite, so no inf - inf anywhere


def _check_leftovers(weights: dict[str, torch.Tensor]) -> None:
    """Tensors of a layer or module this converter does not know (more layers than config.json
    says, an embedding LayerNorm...) mean another architecture: refuse them."""
    known = re.compile(
        r"^(lm_head\.weight|final_logits_bias|model\.(shared|(en|de)coder\.embed_(tokens|positions))\.weight)$"
    )
    unknown = sorted(k for k in weights if not known.match(k))
    if unknown:
        raise ConversionError(
            f"the weights have tensors this converter does not map: {', '.join(unknown[:5])}"
        )


def language(code: str) -> str:
    """The service's code for an OPUS-MT language code: ISO 639-1 where ``ISO639_1`` knows one."""
    return ISO639_1.get(code, code)


def _name_languages(src: Path) -> tuple[str | None, str | None]:
    """(source, target) from tokenizer_config.json, else from a name like ``opus-mt-de-en`` (or
    ``opus-mt-tc-big-en-ko``): the directory's, config.json's ``_name_or_path``, or a Hugging Face
    cache's ``models--Helsinki-NLP--opus-mt-de-en``."""
    settings = src / "tokenizer_config.json"
    data = read_object(settings) if settings.is_file() else {}
    found = (data.get("source_lang"), data.get("target_lang"))
    if all(found):
        return str(found[0]), str(found[1])
    path = src.resolve()
    names = [path.name, Path(str(read_json(src / "config.json").get("_name_or_path") or "")).name]
    names += [part.split("--")[-1] for part in path.parts if part.startswith("models--")]
    for name in names:
        if m := OPUS_NAME.match(name):
            return m.group(1), m.group(2)
    return None, None


def _info(
    cfg: ModelConfig, src: Path, vocab: list[str], source: str | None, target: str | None, command: str
) -> ModelInfo:
    guessed = _name_languages(src)
    source = language(source or guessed[0] or "")
    name = str(read_json(src / "config.json").get("_name_or_path") or src.resolve().name)
    origin = f"Hugging Face MarianMTModel {name} (OPUS-MT, Helsinki-NLP)"
    training = {"origin": origin, "licence": _licence(src), "command": command}
    tokens = {m.group(1): i for i, p in enumerate(vocab) if (m := LANGUAGE_TOKEN.match(p))}
    if not tokens:  # bilingual
        target = language(target or guessed[1] or "")
        if not source or not target:
            raise ConversionError(f"{src}: cannot tell its languages: pass --source and --target")
        return ModelInfo(cfg, source, target, training)
    # Multilingual (opus-mt-en-ROMANCE): >>fra<< before the source asks for French.
    prefix: dict[str, list[int]] = {}
    for code, i in tokens.items():
        prefix.setdefault(language(code), [i])  # the first token of a language wins (>>fr<< or >>fra<<)
    if target:
        wanted = [language(t.strip()) for t in target.split(",") if t.strip()]
        unknown = [t for t in wanted if t not in prefix]
        if unknown:
            raise ConversionError(f"{src}: no >>{unknown[0]}<< token; its targets: {', '.join(prefix)}")
        prefix = {t: prefix[t] for t in wanted}
    if not source:
        raise ConversionError(f"{src}: cannot tell its source language: pass --source")
    directions = [(source, t) for t in prefix if t != source]
    if not directions:
        raise ConversionError(f"{src}: its only language token is the source's ({source})")
    try:
        return ModelInfo.multilingual(cfg, directions, {t: prefix[t] for _, t in directions}, training)
    except ValueError as e:
        raise ConversionError(f"{src}: {e}") from e


def _licence(src: Path) -> str:
    """The licence the model card's front matter states (``license: ...``), else OPUS-MT's."""
    card = src / "README.md"
    if card.is_file():
        text = card.read_text(encoding="utf-8", errors="replace")
        front = text.split("---", 2)[1] if text.startswith("---") and text.count("---") >= 2 else ""
        found = re.search(r"^license:\s*(\S+)", front, re.MULTILINE)
        if found:
            return f"{found.group(1)} (stated by the model card)"
    return LICENCE


def _model_card(info: ModelInfo) -> str:
    pairs = ", ".join(f"{s}-{t}" for s, t in info.directions)
    t = info.training
    return (
        f"# OPUS-MT {pairs}, imported\n\n"
        f"- Origin: {t['origin']}\n"
        f"- Licence: {t['licence']}\n"
        f"- Converted with: `{t['command'] or 'model.convert.marian.convert'}`\n\n"
        "OPUS-MT models are trained by the Language Technology Research Group at the University of "
        'Helsinki with Marian NMT on OPUS data: Jörg Tiedemann and Santhosh Thottingal, "OPUS-MT — '
        'Building open translation services for the World", EAMT 2020. Attribute them when you '
        "redistribute or serve this model. The weights are theirs, converted unchanged in value "
        "(float32 or float16 as given) to this service's layout.\n"
    )
