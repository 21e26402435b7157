"""model.convert.argos: Argos packages (CTranslate2 models) imported as model directories.

The packages are made here, offline: a tiny MarianMTModel (trained a few seconds on Multi30k) converted by
CTranslate2's own converter in float32 and int8, and pre-norm OpenNMT-style specs (ReLU, GELU,
CTranslate2's computed sinusoids, separate embeddings and output projection) written with random
weights by CTranslate2's spec API; each zipped as an .argosmodel. CTranslate2 is the oracle: our
reader's weights against the source's, and our greedy translations against its translate_batch.
"""

from __future__ import annotations

import gzip
import json
import shutil
import struct
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from model.convert.__main__ import main as cli
from model.convert.argos import convert
from model.convert.ct2_model import read_model
from model.convert.ct2_transformer import builtin_sinusoids
from model.convert.errors import ConversionError
from model.decoding.options import DecodeOptions
from model.decoding.translator import Translator
from tests.conftest import under_ci

ctranslate2 = pytest.importorskip("ctranslate2")
spm = pytest.importorskip("sentencepiece")

N_SENTENCES = 20
MAX_TOKENS = 40  # output limit, eos included, in both engines (CTranslate2's excludes eos: 39)
GREEDY = DecodeOptions(beam_size=1, max_length_a=0, max_length_b=MAX_TOKENS, max_output_tokens=MAX_TOKENS)
METADATA = {"package_version": "1.0", "argos_version": "1.5", "from_code": "de", "to_code": "en"}


# -- the models (private helpers: the Marian converter's tests have their own) -------------------

# Multi30k beside the checkout (as on the build machines and in CI), or the shared data folder.
_DATA = [
    Path(__file__).resolve().parents[2] / "shared" / "data" / "multi30k",
    Path("/work/shared/data/multi30k"),
]


def multi30k() -> Path:
    """Multi30k's folder (read, never copied); missing, it skips the test, except under CI."""
    found = next((p for p in _DATA if (p / "train.de.gz").is_file()), None)
    if found is None:
        if under_ci():
            pytest.fail(f"Multi30k is missing: looked in {', '.join(map(str, _DATA))}")
        pytest.skip("Multi30k not found (the tiny models are trained on it)")
    return found


def read_gz(path: Path, n: int) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [line.strip() for _, line in zip(range(n), f, strict=False)]


def train_joint_spm(out_dir: Path, *, lines: int = 3000, symbols: tuple[str, ...] = ()) -> Path:
    """A 500-piece SentencePiece model of German and English (unk 0, eos 1, no bos, no pad);
    ``symbols``: pieces of its own (user symbols: language tokens the training data never has)."""
    data, text = multi30k(), out_dir / "spm-train.txt"
    both = read_gz(data / "train.de.gz", lines) + read_gz(data / "train.en.gz", lines)
    text.write_text("\n".join(both), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(out_dir / "sentencepiece"), vocab_size=500, unk_id=0, eos_id=1,
        bos_id=-1, pad_id=-1, character_coverage=1.0, num_threads=1, minloglevel=2,
        user_defined_symbols=list(symbols),
    )  # fmt: skip
    return out_dir / "sentencepiece.model"


def spm_pieces(model: Path) -> list[str]:
    sp = spm.SentencePieceProcessor(model_file=str(model))
    return [sp.id_to_piece(i) for i in range(sp.get_piece_size())]


def make_marian(
    out_dir: Path, spm_model: Path, *, steps: int = 300, seed: int = 0, target_prefix: str = ""
) -> Path:
    """A MarianMTModel (d_model 32, 2+2 layers, 4 heads, ffn 64, swish, tied embeddings) and its
    MarianTokenizer: vocab.json = the joint SentencePiece pieces in id order, then <pad> (last, as in
    OPUS-MT), so that it packs as an Argos model. Trained ``steps`` Adam steps on Multi30k pairs, so
    that it ends outputs with eos; a random final_logits_bias (a bias to convert) pushing eos.
    ``target_prefix``: a piece every training target starts with (a multilingual model's language
    token, which Argos then forces: tests/test_target_prefix.py)."""
    from transformers import MarianConfig, MarianMTModel, MarianTokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = {p: i for i, p in enumerate([*spm_pieces(spm_model), "<pad>"])}
    (out_dir / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    for name in ("source.spm", "target.spm"):
        shutil.copyfile(spm_model, out_dir / name)
    source, target, vocab_json = (str(out_dir / n) for n in ("source.spm", "target.spm", "vocab.json"))
    tokenizer = MarianTokenizer(source, target, vocab_json, source_lang="de", target_lang="en")
    pad, eos = vocab["<pad>"], vocab["</s>"]
    torch.manual_seed(seed)
    config = MarianConfig(
        vocab_size=len(vocab), d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=256,
        activation_function="swish", pad_token_id=pad, eos_token_id=eos, decoder_start_token_id=pad,
        forced_eos_token_id=eos, scale_embedding=True, share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
    )  # fmt: skip
    model = MarianMTModel(config)
    data = multi30k()
    src, tgt = read_gz(data / "train.de.gz", 2000), read_gz(data / "train.en.gz", 2000)
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        idx = torch.randint(len(src), (32,), generator=g).tolist()
        batch = tokenizer(
            [src[i] for i in idx],
            text_target=[f"{target_prefix} {tgt[i]}" if target_prefix else tgt[i] for i in idx],
            padding=True,
            return_tensors="pt",
        )
        labels = batch["labels"].masked_fill(batch["labels"] == pad, -100)
        loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        model.final_logits_bias.copy_(0.1 * torch.randn(model.final_logits_bias.shape, generator=g))
        model.final_logits_bias[0, eos] += 2.0  # a little training often ends in a repeated piece
    model.eval()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def convert_ct2(hf_dir: Path, out_dir: Path, quantization: str) -> Path:
    """CTranslate2's own conversion of ``hf_dir``."""
    from ctranslate2.converters import TransformersConverter

    TransformersConverter(str(hf_dir)).convert(str(out_dir), quantization=quantization, force=True)
    return out_dir


def pack(ct2_dir: Path, spm_model: Path, out: Path, **metadata: Any) -> Path:
    """``out`` (.argosmodel): one top-level directory with metadata.json, model/, sentencepiece.model."""
    top = "translate-de_en-1_0"
    with zipfile.ZipFile(out, "w") as z:
        z.writestr(f"{top}/metadata.json", json.dumps({**METADATA, **metadata}))
        for file in sorted(ct2_dir.iterdir()):
            z.write(file, f"{top}/model/{file.name}")
        z.write(spm_model, f"{top}/sentencepiece.model")
        z.writestr(f"{top}/README.md", "Test package. Licence: CC0.\n")
    return out


def random_spec(out: Path, pieces: list[str], activation: str, *, seed: int = 0, **options: Any) -> Path:
    """A pre-norm OpenNMT-py-like CTranslate2 model (d 32, 2+2 layers, 4 heads, ffn 64) with random
    weights: separate source/target embeddings and output projection, no stored positions."""
    from ctranslate2.specs import common_spec, transformer_spec

    rng = np.random.default_rng(seed)

    def w(*shape: int, s: float | None = None) -> np.ndarray:
        return (rng.standard_normal(shape) * (s or shape[-1] ** -0.5)).astype(np.float32)

    d, ff, v = 32, 64, len(pieces)
    act = {"relu": common_spec.Activation.RELU, "gelu": common_spec.Activation.GELU}[activation]
    spec = transformer_spec.TransformerSpec.from_config(2, 4, pre_norm=True, activation=act, **options)

    def lin(layer: Any, o: int, i: int) -> None:
        layer.weight, layer.bias = w(o, i), w(o, s=0.1)

    def norm(n: Any) -> None:
        n.gamma, n.beta = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32), w(d, s=0.1)

    spec.encoder.embeddings[0].weight = w(v, d, s=1.0)
    spec.decoder.embeddings.weight = w(v, d, s=1.0)
    for layer in [*spec.encoder.layer, *spec.decoder.layer]:
        lin(layer.self_attention.linear[0], 3 * d, d)
        lin(layer.self_attention.linear[1], d, d)
        norm(layer.self_attention.layer_norm)
        if hasattr(layer, "attention"):
            lin(layer.attention.linear[0], d, d)
            lin(layer.attention.linear[1], 2 * d, d)
            lin(layer.attention.linear[2], d, d)
            norm(layer.attention.layer_norm)
        lin(layer.ffn.linear_0, ff, d)
        lin(layer.ffn.linear_1, d, ff)
        norm(layer.ffn.layer_norm)
        for name in ("relative_position_keys", "relative_position_values"):
            if hasattr(layer.self_attention, name):
                setattr(layer.self_attention, name, w(2 * 8 + 1, d // 4))
    norm(spec.encoder.layer_norm)
    norm(spec.decoder.layer_norm)
    spec.decoder.projection.weight = w(v, d)
    spec.register_source_vocabulary(pieces)
    spec.register_target_vocabulary(pieces)
    spec.config.layer_norm_epsilon = 1e-6  # OpenNMT-py's
    spec.validate()
    spec.optimize(quantization="float32")
    out.mkdir(parents=True, exist_ok=True)
    spec.save(str(out))
    return out


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The tiny SentencePiece model, the Marian model, its CTranslate2 conversions and packages."""
    root = tmp_path_factory.mktemp("argos")
    spm_model = train_joint_spm(root)
    hf = make_marian(root / "hf", spm_model)
    found: dict[str, Any] = {"root": root, "spm": spm_model, "hf": hf}
    for q in ("float32", "int8"):
        found[f"ct2-{q}"] = convert_ct2(hf, root / f"ct2-{q}", q)
        found[f"pkg-{q}"] = pack(found[f"ct2-{q}"], spm_model, root / f"de_en-{q}.argosmodel")
    found["sentences"] = read_gz(multi30k() / "test_2016_flickr.de.gz", N_SENTENCES)
    return found


def greedy(
    ct2_dir: Path, ours: Path, sentences: list[str], *, compute: str, quantization: str = "none"
) -> tuple[list[list[int]], list[list[int]]]:
    """(our token ids, CTranslate2's token ids) of greedy translations, given the same input:
    our tokenization of each sentence, with an eos where the model's sources end with one."""
    tr = Translator.load(ours, device="cpu", prepack=False, quantization=quantization, options=GREEDY)
    mine = [r.tokens[0] for r in tr.translate_batch(sentences)]
    source = [tr.tokenizer.pieces(ids, source=True) for ids in tr.source_ids(sentences)]
    engine = ctranslate2.Translator(str(ct2_dir), device="cpu", compute_type=compute)
    results = engine.translate_batch(source, beam_size=1, max_decoding_length=MAX_TOKENS - 1)
    index = {p: i for i, p in enumerate(tr.tokenizer.vocabulary())}
    return mine, [[index[p] for p in r.hypotheses[0]] for r in results]


# -- the reader ---------------------------------------------------------------------------------


def test_reader_float32_weights_are_the_source_weights(work: dict[str, Any]) -> None:
    from transformers import MarianMTModel

    hf = MarianMTModel.from_pretrained(work["hf"]).state_dict()
    ct2 = read_model(work["ct2-float32"])
    v = ct2.variables
    assert (ct2.spec, ct2.binary_version) == ("TransformerSpec", 6)
    # CTranslate2 drops Marian's last row (<pad>), since its decoder starts from a zero embedding.
    assert torch.equal(v["encoder/embeddings_0/weight"], hf["model.shared.weight"][:-1])
    assert torch.equal(v["decoder/projection/weight"], v["decoder/embeddings/weight"])  # an alias
    assert torch.equal(v["decoder/projection/bias"], hf["final_logits_bias"][0, :-1])
    assert torch.equal(v["encoder/position_encodings/encodings"], hf["model.encoder.embed_positions.weight"])
    for i, stack in ((0, "encoder"), (1, "decoder")):
        attn = f"model.{stack}.layers.{i}.self_attn"
        qkv = torch.cat([hf[f"{attn}.{p}_proj.weight"] for p in "qkv"])  # fused [q; k; v]
        assert torch.equal(v[f"{stack}/layer_{i}/self_attention/linear_0/weight"], qkv)
        assert torch.equal(
            v[f"{stack}/layer_{i}/ffn/linear_1/bias"], hf[f"model.{stack}.layers.{i}.fc2.bias"]
        )
    cross = "model.decoder.layers.1.encoder_attn"
    kv = torch.cat([hf[f"{cross}.k_proj.weight"], hf[f"{cross}.v_proj.weight"]])
    assert torch.equal(v["decoder/layer_1/attention/linear_1/weight"], kv)
    assert ct2.source_vocabulary == spm_pieces(work["spm"])


def test_reader_int8_weights_within_a_quantization_step(work: dict[str, Any]) -> None:
    f32, i8 = read_model(work["ct2-float32"]).variables, read_model(work["ct2-int8"]).variables
    assert f32.keys() == i8.keys()
    for name, value in f32.items():
        if name.endswith("weight") and value.dim() == 2:  # quantized per row: step = max|row| / 127
            step = value.abs().amax(dim=1, keepdim=True) / 127
            assert ((i8[name] - value).abs() <= step / 2 + 1e-7).all(), name
            assert not torch.equal(i8[name], value), f"{name} was not quantized"
        else:
            assert torch.equal(i8[name], value), name


# -- the converted model translates as CTranslate2 does -------------------------------------------


@pytest.mark.parametrize("quantization", ["float32", "int8"])
def test_marian_package_translates_as_ctranslate2(work: dict[str, Any], quantization: str) -> None:
    ours = convert(work[f"pkg-{quantization}"], work["root"] / f"ours-{quantization}", command="pytest")
    cfg = json.loads((ours / "config.json").read_text())
    model = cfg["model"]
    assert (cfg["source_lang"], cfg["target_lang"]) == ("de", "en")
    assert cfg["training"]["command"] == "pytest" and "Argos" in cfg["training"]["origin"]
    assert "CC0" in (ours / "README.md").read_text()
    assert model["activation"] == "swish" and not model["pre_norm"] and model["positions"] == "learned"
    assert model["share_embeddings"] and model["tie_output"] and model["output_bias"]
    vocab = json.loads((ours / "shared_vocabulary.json").read_text())
    assert model["bos_id"] == model["pad_id"] == len(vocab) - 1  # the appended zero start row
    # The int8 package's weights dequantized, run in float32 by both: the same numbers exactly.
    mine, theirs = greedy(work[f"ct2-{quantization}"], ours, work["sentences"], compute="float32")
    assert mine == theirs
    assert sum(len(t) for t in mine) > 5 * len(mine)  # real outputs, not empty ones


def test_int8_agreement_with_ctranslate2_int8(work: dict[str, Any]) -> None:
    """CTranslate2 in int8 also quantizes activations, so only agreement is expected. Measured
    against CTranslate2's own agreement between its int8 and float32 runs of the same weights (a
    tiny model's greedy outputs diverge quickly once they differ): ours must agree about as well."""
    ours = convert(work["pkg-int8"], work["root"] / "ours-int8-agree", command="pytest")
    sentences, ct2_dir = work["sentences"], work["ct2-int8"]
    _, ct2_float = greedy(ct2_dir, ours, sentences, compute="float32")
    mine, ct2_int8 = greedy(ct2_dir, ours, sentences, compute="int8")
    mine_int8, _ = greedy(ct2_dir, ours, sentences, compute="int8", quantization="int8")
    rates = {
        "CTranslate2 int8 vs its float32": _agreement(ct2_int8, ct2_float),
        "ours float32 vs CTranslate2 int8": _agreement(mine, ct2_int8),
        "ours int8 vs CTranslate2 int8": _agreement(mine_int8, ct2_int8),
    }
    for name, (same, first, prefix) in rates.items():
        print(f"{name}: {same:.0%} identical, {first:.0%} same first token, mean common prefix {prefix:.1f}")
    baseline = rates["CTranslate2 int8 vs its float32"]
    for _same, first, prefix in list(rates.values())[1:]:
        assert first >= 0.8 and prefix >= 0.7 * baseline[2]


def _agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, float, float]:
    """(share identical, share with the same first token, mean common prefix in tokens)."""
    pairs = list(zip(a, b, strict=True))
    same = sum(x == y for x, y in pairs) / len(pairs)
    first = sum(x[:1] == y[:1] for x, y in pairs) / len(pairs)
    return same, first, float(np.mean([_common_prefix(x, y) for x, y in pairs]))


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_prenorm_spec_with_computed_positions(work: dict[str, Any], activation: str) -> None:
    root = work["root"] / f"spec-{activation}"
    pieces = ["<blank>", "<s>", *spm_pieces(work["spm"])]  # OpenNMT-py's pad and bos, then SentencePiece's
    ct2_dir = random_spec(root / "ct2", pieces, activation)
    ours = convert(pack(ct2_dir, work["spm"], root / "pkg.argosmodel"), root / "ours")
    cfg = json.loads((ours / "config.json").read_text())
    model = cfg["model"]
    assert model["pre_norm"] and model["activation"] == activation and model["layer_norm_eps"] == 1e-6
    assert not model["share_embeddings"] and not model["tie_output"] and not model["output_bias"]
    assert (model["pad_id"], model["bos_id"]) == (0, 1)
    assert model["source_eos"] is False  # OpenNMT-py's sources have no eos, as CTranslate2 reads them
    from safetensors.torch import load_file

    table = load_file(ours / "model.safetensors")["positions.table"]
    assert torch.equal(table, builtin_sinusoids(table.shape[0], 32))
    mine, theirs = greedy(ct2_dir, ours, work["sentences"], compute="float32")
    assert mine == theirs


# -- bad input: a ConversionError that says what is wrong, and nothing written ------------------------


def _first_size_offset(model_bin: bytes) -> int:
    """Offset of the first variable's byte count in a version-6 model.bin."""
    pos = 4
    pos += 2 + struct.unpack_from("<H", model_bin, pos)[0] + 4 + 4  # spec name, revision, count
    pos += 2 + struct.unpack_from("<H", model_bin, pos)[0]  # the variable's name
    rank = model_bin[pos]
    return pos + 1 + 4 * rank + 1


def _broken_package(work: dict[str, Any], tmp: Path, how: str) -> Path:
    src = work["ct2-float32"]
    ct2 = tmp / "ct2"
    ct2.mkdir()
    for f in src.iterdir():
        (ct2 / f.name).write_bytes(f.read_bytes())
    data = bytearray((ct2 / "model.bin").read_bytes())
    metadata: dict[str, Any] = {}
    if how == "truncated":
        del data[-1000:]
    elif how == "version":
        data[:4] = struct.pack("<I", 99)
    elif how == "size":
        at = _first_size_offset(bytes(data))
        data[at : at + 4] = struct.pack("<I", struct.unpack_from("<I", data, at)[0] + 4)
    elif how == "vocabulary":
        vocab = json.loads((ct2 / "shared_vocabulary.json").read_text())
        (ct2 / "shared_vocabulary.json").write_text(json.dumps(vocab[:-3]))
    elif how == "target_prefix":
        metadata["target_prefix"] = "__en__"
    elif how == "activation":  # GELU with the tanh approximation (id 1): not one we compute
        for stack in (b"encoder", b"decoder"):
            pos = bytes(data).index(stack + b"/activation\0") + len(stack) + len(b"/activation\0")
            data[pos + 1 + 1 + 4] = 1  # after rank 0, the dtype byte and the u32 size: the int8 value
    (ct2 / "model.bin").write_bytes(bytes(data))
    return pack(ct2, work["spm"], tmp / "broken.argosmodel", **metadata)


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("truncated", "truncated"),
        ("version", "binary version 99"),
        ("size", "needs"),
        ("vocabulary", "embedding rows"),
        ("target_prefix", "not a piece of the model's target vocabulary"),
        ("activation", "GELU (tanh approximation)"),
    ],
)
def test_bad_package(work: dict[str, Any], tmp_path: Path, how: str, message: str) -> None:
    package = _broken_package(work, tmp_path, how)
    out = tmp_path / "out"
    with pytest.raises(ConversionError, match="broken.argosmodel") as e:
        convert(package, out)
    assert message in str(e.value)
    assert not out.exists() and not any(p.name.startswith(".out") for p in tmp_path.iterdir())


def test_unsupported_relative_positions(work: dict[str, Any], tmp_path: Path) -> None:
    pieces = ["<blank>", "<s>", *spm_pieces(work["spm"])]
    ct2_dir = random_spec(tmp_path / "ct2", pieces, "relu", with_relative_position=True)
    with pytest.raises(ConversionError, match="relative position representations"):
        convert(pack(ct2_dir, work["spm"], tmp_path / "rel.argosmodel"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_not_a_package(tmp_path: Path) -> None:
    text = tmp_path / "model.argosmodel"
    text.write_text("not a zip")
    with pytest.raises(ConversionError, match="not a zip"):
        convert(text, tmp_path / "out")
    empty = tmp_path / "empty.argosmodel"
    with zipfile.ZipFile(empty, "w") as z:
        z.writestr("pkg/model/config.json", "{}")
    with pytest.raises(ConversionError, match="no metadata.json"):
        convert(empty, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_existing_output_and_the_cli(
    work: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("x")
    with pytest.raises(FileExistsError):
        convert(work["pkg-float32"], out)
    assert (out / "keep").exists()
    assert cli(["argos", str(work["pkg-float32"]), str(out), "--force", "--target", "en"]) == 0
    assert not (out / "keep").exists() and (out / "model.safetensors").is_file()
    assert "--force" in json.loads((out / "config.json").read_text())["training"]["command"]
    assert cli(["argos", str(tmp_path / "missing.argosmodel"), str(tmp_path / "o2")]) == 2
    assert "no such file" in capsys.readouterr().err
