"""model.convert.marian: an OPUS-MT (transformers MarianMTModel) directory imported as a model
directory computes what transformers computes, decodes as transformers and CTranslate2 do, and
tokenizes as MarianTokenizer; bad inputs are refused by name, leaving nothing behind.

The Marian directories are small models trained here in seconds (tests/marian_models.py), one per
set of options, each made once per session.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from model.checkpoint import load_model, read_info_and_tokenizer
from model.convert.errors import ConversionError
from model.convert.marian import convert
from model.decoding.options import DecodeOptions, ctranslate2_options
from model.translator import Translator
from tests.conftest import compile_cache_dir, under_ci
from tests.marian_models import MarianOptions, data_dir, read_gz

transformers = pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parents[1]
if data_dir() is None and not under_ci():
    pytest.skip("Multi30k not found: the Marian test models train on it", allow_module_level=True)

VARIANTS = {
    # OPUS-MT's own: swish, scaled embeddings, one embedding matrix for everything, zero bias.
    "opus-mt": MarianOptions(),
    # An old checkpoint: pytorch_model.bin with every (tied) name and the sinusoid tables stored.
    "relu-unscaled-bias-bin": MarianOptions(
        activation="relu",
        scale_embedding=False,
        logits_bias=True,
        pytorch_bin=True,
        positions_in_weights="exact",
    ),
    # tie_word_embeddings false: lm_head and both embeddings apart (transformers 5); a position
    # table no sinusoid matches, which transformers loads: imported as a learned table.
    "gelu-untied-learned": MarianOptions(
        activation="gelu", tie_word_embeddings=False, logits_bias=True, positions_in_weights="perturbed"
    ),
    # share_encoder_decoder_embeddings false: vocab.json + target_vocab.json, decoder tied to lm_head.
    "separate-vocabs": MarianOptions(separate_vocabs=True),
    # >>eng<< >>fra<< >>ces<< before the source choose the target (opus-mt-en-ROMANCE's scheme).
    "multilingual": MarianOptions(multilingual=True),
}
TARGETS = {"eng": "en", "fra": "fr", "ces": "cs"}
LIMIT = 48  # output tokens, eos included, on every side: no a * source + b budget in the others


@pytest.fixture(scope="session")
def marian(marian_dirs: Callable[[MarianOptions], tuple[Path, Path]]) -> Callable[[str], tuple[Path, Path]]:
    """``marian(variant)``: (the transformers directory, our converted directory), made once."""
    return lambda variant: marian_dirs(VARIANTS[variant])


def sentences_de(n: int = 20) -> list[str]:
    return read_gz("test_2016_flickr.de.gz", n)


def hf_inputs(variant: str, texts: list[str], target: str) -> list[str]:
    """The text MarianTokenizer takes: a multilingual model's >>xxx<< token first."""
    code = {v: k for k, v in TARGETS.items()}[target]
    return [f">>{code}<< {t}" for t in texts] if VARIANTS[variant].multilingual else texts


def target_of(variant: str) -> str | None:
    return "fr" if VARIANTS[variant].multilingual else None


@pytest.mark.parametrize("variant", VARIANTS)
def test_teacher_forced_logits_match_transformers(marian: Any, variant: str) -> None:
    hf_dir, ours_dir = marian(variant)
    theirs = transformers.MarianMTModel.from_pretrained(hf_dir).eval()
    tokenizer = transformers.MarianTokenizer.from_pretrained(hf_dir)
    info, _ = read_info_and_tokenizer(ours_dir)
    ours = load_model(ours_dir, info)
    batch = tokenizer(
        hf_inputs(variant, sentences_de(8), "en"),
        text_target=read_gz("test_2016_flickr.en.gz", 8),
        return_tensors="pt",
        padding=True,
    )
    labels, pad = batch["labels"], info.config.pad_id
    tgt_in = torch.cat([torch.full_like(labels[:, :1], info.config.bos_id), labels[:, :-1]], dim=1)
    with torch.no_grad():
        expected = theirs(**batch).logits
        got = ours(batch["input_ids"], tgt_in)
    real = labels != pad  # positions after a row's end see padding as input: not compared
    assert got.shape == expected.shape
    # pad's logit is masked in ours (Marian's vocabulary has no pad; generate bans it): the rest
    # must be transformers' own.
    assert (got[..., pad] < -1e8).all()
    keep = torch.arange(got.size(-1)) != pad
    assert (got - expected)[real][:, keep].abs().max().item() < 1e-4


def hf_greedy(hf_dir: Path, texts: list[str]) -> list[list[int]]:
    model = transformers.MarianMTModel.from_pretrained(hf_dir).eval()
    tokenizer = transformers.MarianTokenizer.from_pretrained(hf_dir)
    out = model.generate(
        **tokenizer(texts, return_tensors="pt", padding=True),
        num_beams=1,
        do_sample=False,
        max_new_tokens=LIMIT,  # eos included; forced_eos_token_id ends it at the limit, as ours
    )
    eos, pad = model.config.eos_token_id, model.config.pad_token_id
    rows = []
    for row in out[:, 1:].tolist():  # without the decoder start
        ids = row[: row.index(eos)] if eos in row else row
        rows.append([i for i in ids if i != pad] if eos in row else ids)
    return rows


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_output_is_transformers_generate(marian: Any, variant: str) -> None:
    hf_dir, ours_dir = marian(variant)
    texts = sentences_de()
    options = DecodeOptions(beam_size=1, max_length_a=0, max_length_b=LIMIT, max_output_tokens=LIMIT)
    ours = Translator.load(ours_dir, device="cpu", prepack=False, options=options)
    got = ours.translate_batch(texts, target=target_of(variant))
    expected = hf_greedy(hf_dir, hf_inputs(variant, texts, target_of(variant) or "en"))
    assert [r.tokens[0] for r in got] == expected
    tokenizer = transformers.MarianTokenizer.from_pretrained(hf_dir)
    # MarianTokenizer strips its text; SentencePiece keeps the space of an output ending in "▁".
    texts_of = [r.hypotheses[0].strip() for r in got]
    assert texts_of == tokenizer.batch_decode(expected, skip_special_tokens=True)
    assert sum(len(t) < LIMIT - 1 for t in expected) >= len(texts) // 2  # most end with eos


def test_compiled_prepacked_path_decodes_alike(marian: Any) -> None:
    """The service's default CPU path: prepacked linears and the compiled step."""
    hf_dir, ours_dir = marian("opus-mt")
    texts = sentences_de()
    options = DecodeOptions(beam_size=1, max_length_a=0, max_length_b=LIMIT, max_output_tokens=LIMIT)
    fast = Translator.load(
        ours_dir, device="cpu", options=options, compile=True, cache_dir=compile_cache_dir()
    )
    assert fast.runner.kind == "compiled"
    assert [r.tokens[0] for r in fast.translate_batch(texts)] == hf_greedy(hf_dir, texts)


@pytest.mark.parametrize("variant", VARIANTS)
def test_beam_output_is_ctranslate2s(marian: Any, variant: str, tmp_path: Path) -> None:
    """Beam 4 as CTranslate2 decodes the same weights: converted from the transformers directory
    by CTranslate2's own converter, or, for separate vocabularies (which that converter maps
    through the source's vocabulary on both sides), exported from ours."""
    ctranslate2 = pytest.importorskip("ctranslate2")
    hf_dir, ours_dir = marian(variant)
    options = DecodeOptions(beam_size=4, max_length_a=0, max_length_b=LIMIT, max_output_tokens=LIMIT)
    ours = Translator.load(ours_dir, device="cpu", prepack=False, options=options)
    texts, target = sentences_de(), target_of(variant)
    sources = ours.source_ids(texts, target=target)  # ids + eos
    if VARIANTS[variant].separate_vocabs:
        from model.convert.ctranslate2 import export

        export(ours_dir, tmp_path / "ct2", options=options)
        pieces = [ours.tokenizer.pieces(ids[:-1], source=True) for ids in sources]  # it adds the eos
    else:
        ctranslate2.converters.TransformersConverter(str(hf_dir)).convert(str(tmp_path / "ct2"))
        pieces = [ours.tokenizer.pieces(ids, source=True) for ids in sources]
    engine = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu", intra_threads=1)
    theirs = engine.translate_batch(pieces, **ctranslate2_options(options))
    index = {p: i for i, p in enumerate(ours.tokenizer.vocabulary())}
    expected = [[index[p] for p in r.hypotheses[0]] for r in theirs]
    assert [nbest[0].tokens for nbest in ours.generate(sources)] == expected


@pytest.mark.parametrize("variant", ["opus-mt", "separate-vocabs", "multilingual"])
def test_tokenizer_is_marian_tokenizers(marian: Any, variant: str) -> None:
    hf_dir, ours_dir = marian(variant)
    tokenizer = transformers.MarianTokenizer.from_pretrained(hf_dir)
    info, ours = read_info_and_tokenizer(ours_dir)
    texts = [*sentences_de(50), "Ein ☃ im Schnee", "  zwei   Leerzeichen ", "Ünïcödé ß"]
    target = target_of(variant) or "en"
    expected = tokenizer(hf_inputs(variant, texts, target))["input_ids"]
    prefix = info.target_prefix.get(target, [])
    assert [prefix + ids for ids in ours.encode(texts)] == [ids[:-1] for ids in expected]  # without eos
    references = read_gz("test_2016_flickr.en.gz", 50)
    labels = tokenizer(text_target=references)["input_ids"]
    assert ours.encode(references, target=True) == [ids[:-1] for ids in labels]
    assert ours.decode(labels) == tokenizer.batch_decode(labels, skip_special_tokens=True)


def test_converted_config_and_files(marian: Any) -> None:
    """The facts of the mapping: special ids, options, vocabulary files, metadata, model card."""
    _, ours = marian("opus-mt")
    info, tokenizer = read_info_and_tokenizer(ours)
    cfg = info.config
    assert (cfg.activation, cfg.positions, cfg.pre_norm, cfg.scale_embeddings) == (
        "swish", "sinusoidal_halves", False, True,
    )  # fmt: skip
    assert (cfg.share_embeddings, cfg.tie_output, cfg.output_bias) == (True, True, True)
    assert (cfg.eos_id, cfg.unk_id, cfg.pad_id, cfg.bos_id) == (0, 1, cfg.vocab_size - 1, cfg.vocab_size - 1)
    assert (info.source_lang, info.target_lang, info.training["command"]) == ("de", "en", "test")
    assert "CC-BY-4.0" in info.training["licence"] and (ours / "README.md").is_file()
    assert sorted(p.name for p in ours.iterdir()) == [
        "README.md", "config.json", "model.safetensors", "shared_vocabulary.json", "source.spm", "target.spm",
    ]  # fmt: skip
    _, separate = marian("separate-vocabs")
    info, tokenizer = read_info_and_tokenizer(separate)
    assert not info.config.share_embeddings and info.config.source_vocab_size == tokenizer.source_vocab_size
    assert (separate / "source_vocabulary.json").is_file() and (separate / "target_vocabulary.json").is_file()
    _, untied = marian("gelu-untied-learned")
    cfg = read_info_and_tokenizer(untied)[0].config
    assert (cfg.positions, cfg.share_embeddings, cfg.tie_output) == ("learned", False, False)
    assert (
        read_info_and_tokenizer(marian("relu-unscaled-bias-bin")[1])[0].config.positions
        == "sinusoidal_halves"
    )
    info = read_info_and_tokenizer(marian("multilingual")[1])[0]
    assert info.directions == [("de", "en"), ("de", "fr"), ("de", "cs")] and info.target_prefix["fr"] == [3]


def test_cli_writes_a_model_directory(marian: Any, tmp_path: Path) -> None:
    hf_dir, _ = marian("opus-mt")
    out = tmp_path / "de-en"
    args = ["marian", str(hf_dir), str(out), "--source", "de", "--target", "en"]
    done = run_cli(args)
    assert done.returncode == 0, done.stderr
    info, _ = read_info_and_tokenizer(out)
    assert "python -m model.convert marian" in info.training["command"]
    assert info.training["command"] in (out / "README.md").read_text()
    again = run_cli(args)  # a non-empty OUT_DIR without --force
    assert again.returncode == 2 and "exists" in again.stderr
    assert run_cli([*args, "--force"]).returncode == 0


def run_cli(args: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "model.convert", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def damaged(hf_dir: Path, tmp_path: Path, damage: str) -> Path:
    bad = Path(shutil.copytree(hf_dir, tmp_path / "opus-mt-de-en"))
    config = json.loads((bad / "config.json").read_text())
    if damage == "no config.json":
        (bad / "config.json").unlink()
    elif damage == "bart":
        config["model_type"] = "bart"
    elif damage in ("normalize_before", "normalize_embedding"):
        config[damage] = True
    elif damage == "gelu_new":
        config["activation_function"] = "gelu_new"
    elif damage == "truncated":
        data = (bad / "model.safetensors").read_bytes()
        (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    elif damage in ("vocab short", "vocab gap"):
        vocab = json.loads((bad / "vocab.json").read_text())
        last = max(vocab, key=vocab.__getitem__)
        if damage == "vocab gap":
            vocab[last] += 1
        else:
            del vocab[last]
        (bad / "vocab.json").write_text(json.dumps(vocab))
    elif damage == "pickle":
        (bad / "model.safetensors").unlink()
        (bad / "pytorch_model.bin").write_bytes(_evil_pickle(tmp_path / "pwned"))
    (bad / "config.json").write_text(json.dumps(config)) if damage != "no config.json" else None
    return bad


class _Evil:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.path}",))


def _evil_pickle(path: Path) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save({"model.shared.weight": _Evil(path)}, buffer)
    return buffer.getvalue()


BAD = {  # damage: what the message names
    "no config.json": "config.json: missing",
    "bart": "model_type is 'bart'",
    "normalize_before": "normalize_before",
    "normalize_embedding": "normalize_embedding",
    "gelu_new": "activation_function 'gelu_new'",
    "truncated": "model.safetensors: cannot read the weights",
    "vocab short": "does not match the weights",
    "vocab gap": "ids are not 0..",
    "pickle": "pytorch_model.bin: cannot read the weights",
}


@pytest.mark.parametrize("damage", BAD)
def test_bad_input_is_refused_by_name_and_leaves_nothing(marian: Any, tmp_path: Path, damage: str) -> None:
    bad = damaged(marian("opus-mt")[0], tmp_path, damage)
    out = tmp_path / "out"
    with pytest.raises(ConversionError, match=BAD[damage]):
        convert(bad, out)
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == [bad.name]  # no temporary left
    assert not (tmp_path / "pwned").exists()


def test_cli_exits_2_on_bad_input(marian: Any, tmp_path: Path) -> None:
    bad = damaged(marian("opus-mt")[0], tmp_path, "vocab short")
    done = run_cli(["marian", str(bad), str(tmp_path / "out")])
    assert done.returncode == 2 and "does not match the weights" in done.stderr
    assert not (tmp_path / "out").exists()


def test_languages_from_the_name_or_asked_for(marian: Any, tmp_path: Path) -> None:
    hf_dir, _ = marian("opus-mt")
    named = Path(shutil.copytree(hf_dir, tmp_path / "opus-mt-deu-eng"))
    (named / "tokenizer_config.json").unlink()
    info = read_info_and_tokenizer(convert(named, tmp_path / "a"))[0]
    assert (info.source_lang, info.target_lang) == ("de", "en")  # 3-letter codes mapped
    cached = Path(
        shutil.copytree(named, tmp_path / "models--Helsinki-NLP--opus-mt-fr-en" / "snapshots" / "0a1b")
    )
    info = read_info_and_tokenizer(convert(cached, tmp_path / "cached"))[0]
    assert (info.source_lang, info.target_lang) == ("fr", "en")  # a Hugging Face cache's snapshot
    anonymous = Path(shutil.copytree(named, tmp_path / "model"))
    with pytest.raises(ConversionError, match="--source and --target"):
        convert(anonymous, tmp_path / "b")
    info = read_info_and_tokenizer(convert(anonymous, tmp_path / "b", source="de", target="en"))[0]
    assert (info.source_lang, info.target_lang) == ("de", "en")
    multi = marian("multilingual")[0]
    info = read_info_and_tokenizer(convert(multi, tmp_path / "c", target="fr,cs"))[0]
    assert info.directions == [("de", "fr"), ("de", "cs")]
    with pytest.raises(ConversionError, match="no >>es<< token"):
        convert(multi, tmp_path / "d", target="es")


def test_licence_from_the_model_card(marian: Any, tmp_path: Path) -> None:
    hf_dir = Path(shutil.copytree(marian("opus-mt")[0], tmp_path / "opus-mt-de-en"))
    (hf_dir / "README.md").write_text(
        "---\nlanguage:\n- de\n- en\nlicense: apache-2.0\n---\n# opus-mt-de-en\n"
    )
    out = convert(hf_dir, tmp_path / "out")
    assert read_info_and_tokenizer(out)[0].training["licence"] == "apache-2.0 (stated by the model card)"
    assert "apache-2.0" in (out / "README.md").read_text()
