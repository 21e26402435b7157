"""Fine-tuning (``training.train --init``): a tiny model trained on part of Multi30k's training set
is fine-tuned on another split; the validation loss on that split falls below the initial model's
(logged at step 0), the tokenizer is copied and never retrained, the run resumes exactly, and the
exported directory is servable with the initial model's attribution. The same for an imported
model's layout: SentencePiece models per side mapped through vocabulary lists, Marian's special
ids (eos 0, unk 1, pad last, the decoder starting from pad)."""

from __future__ import annotations

import gzip
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from model.checkpoint import (
    ModelInfo,
    read_info,
    read_info_and_tokenizer,
    save_model_dir,
    tokenizer_files,
)
from model.tokenizer import Tokenizer, target_token
from model.transformer import Transformer
from model.translator import Translator
from tests.conftest import under_ci
from tests.corpora import REPO, tiny_config, write_corpus
from training import train as train_cli
from training.config import ConfigError, TrainConfig
from training.data import PreparedCorpus
from training.finetune import apply_init
from training.prepare import prepare
from training.train import TrainResult, train

# Multi30k beside the checkout (as CI has it) or in the shared data folder; read, never copied here.
FOUND = next(
    (
        p
        for p in (REPO.parent / "shared" / "data" / "multi30k", Path("/work/shared/data/multi30k"))
        if p.is_dir()
    ),
    None,
)
if FOUND is None and not under_ci():
    pytest.skip("Multi30k not found (../shared/data/multi30k)", allow_module_level=True)
MULTI30K = FOUND or REPO.parent / "shared" / "data" / "multi30k"


def quiet(_: str) -> None:
    pass


def lines(split: str, lang: str, start: int, stop: int) -> list[str]:
    with gzip.open(MULTI30K / f"{split}.{lang}.gz", "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for _, line in zip(range(stop), f, strict=False)][start:]


def write_split(out: Path, name: str, split: str, start: int, stop: int) -> None:
    for lang in ("de", "en"):
        (out / f"{name}.{lang}").write_text("".join(s + "\n" for s in lines(split, lang, start, stop)))


@pytest.fixture(scope="module")
def general(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the initial model is trained on: 1,000 pairs of Multi30k's training set."""
    out = tmp_path_factory.mktemp("general")
    write_split(out, "train", "train", 0, 1000)
    write_split(out, "val", "val", 0, 50)
    return out


@pytest.fixture(scope="module")
def domain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 'team's data': another split (test_2016_flickr), 400 pairs to train on and 60 to validate."""
    out = tmp_path_factory.mktemp("domain")
    write_split(out, "train", "test_2016_flickr", 0, 400)
    write_split(out, "val", "test_2016_flickr", 400, 460)
    return out


@pytest.fixture(scope="module")
def init_model(general: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = tiny_config(general, epochs=2)
    cfg.data.vocab_size = 500
    result = train(cfg, tmp_path_factory.mktemp("init"))
    assert result.model_dir is not None
    # An imported model's attribution (model.convert writes these), which the fine-tuned copy must keep.
    config = json.loads((result.model_dir / "config.json").read_text())
    config["training"].update(origin="https://example.org/tiny-de-en", licence="CC-BY-4.0")
    (result.model_dir / "config.json").write_text(json.dumps(config, indent=2))
    return result.model_dir


def finetune_config(domain: Path, **overrides: object) -> TrainConfig:
    return tiny_config(domain, **{"epochs": 4, "lr": 3e-3, "warmup_steps": 5, **overrides})


@pytest.fixture(scope="module")
def finetuned(
    domain: Path, init_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[TrainResult, Path]:
    out = tmp_path_factory.mktemp("finetuned")
    return train(finetune_config(domain), out, init=init_model), out


def valid_records(out: Path) -> list[dict[str, object]]:
    records = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == "valid"]


def test_finetuning_lowers_the_validation_loss_of_the_initial_model(
    finetuned: tuple[TrainResult, Path],
) -> None:
    _, out = finetuned
    valid = valid_records(out)
    assert [(r["step"], r["epoch"]) for r in valid][0] == (0, 0)  # the initial model, scored first
    assert [r["epoch"] for r in valid] == [0, 1, 2, 3, 4]
    before, after = valid[0]["valid_loss"], valid[-1]["valid_loss"]
    assert isinstance(before, float) and isinstance(after, float)
    print(f"domain validation loss: initial model {before:.3f}, fine-tuned {after:.3f}")
    assert after < before - 0.1, (before, after)


def test_the_tokenizer_is_the_initial_models_unchanged(
    finetuned: tuple[TrainResult, Path], init_model: Path
) -> None:
    _, out = finetuned
    originals = tokenizer_files(init_model)
    assert [p.name for p in originals] == ["sentencepiece.model"]
    assert [p.name for p in tokenizer_files(out / "model")] == [p.name for p in originals]
    for original in originals:
        assert (out / "model" / original.name).read_bytes() == original.read_bytes()
    (prepared,) = (out / "prepared").glob("data-*")
    assert not list((out / "prepared").glob("vocab-*"))  # no SentencePiece model was trained
    assert (prepared / "tokenizer" / "sentencepiece.model").read_bytes() == originals[0].read_bytes()


def test_the_exported_model_is_servable_and_keeps_the_attribution(
    finetuned: tuple[TrainResult, Path], init_model: Path
) -> None:
    result, out = finetuned
    info, tokenizer = read_info_and_tokenizer(out / "model")
    initial = read_info(init_model)
    assert info.config == initial.config  # the architecture and special ids are the model's
    assert (info.source_lang, info.target_lang) == ("de", "en")
    assert info.training["steps"] == result.state.step
    assert info.training["origin"] == "https://example.org/tiny-de-en"
    assert info.training["licence"] == "CC-BY-4.0"
    record = info.training["init"]
    assert record["model_dir"] == str(init_model.resolve())
    assert record["origin"] == "https://example.org/tiny-de-en" and record["licence"] == "CC-BY-4.0"
    assert record["steps"] == initial.training["steps"]
    translator = Translator.load(out / "model", device="cpu")
    (hyp,) = translator.translate_batch(["Ein Mann mit einem Hut."], beam_size=2)
    assert hyp.hypotheses[0].strip()
    assert tokenizer.vocab_size == info.config.vocab_size


def test_resume_after_an_interruption_continues_exactly(
    domain: Path, init_model: Path, tmp_path: Path
) -> None:
    overrides = {"epochs": 5, "checkpoint_every": 7, "shuffle_pool": 64}
    straight = train(finetune_config(domain, max_steps=20, **overrides), tmp_path / "a", init=init_model)
    train(finetune_config(domain, max_steps=9, **overrides), tmp_path / "b", init=init_model)
    resumed = train(
        finetune_config(domain, max_steps=20, **overrides),
        tmp_path / "b",
        resume=True,
        init=init_model,
    )
    assert resumed.state.step == straight.state.step == 20
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    log = [json.loads(line) for line in (tmp_path / "b" / "train_log.jsonl").read_text().splitlines()]
    keys = [(rec["kind"], rec["step"]) for rec in log]
    assert len(keys) == len(set(keys)) and keys[0] == ("valid", 0)  # step 0 scored once, kept
    # forgetting --init on resume is refused with what to do, not trained from scratch
    with pytest.raises(ConfigError, match="resume with the --init it was started with"):
        train(finetune_config(domain, max_steps=25, **overrides), tmp_path / "b", resume=True)


def test_cli_finetunes_with_the_default_config(
    domain: Path, init_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):  # argparse's usage error
        train_cli.main(["--init", str(init_model)])
    assert "--data-dir says where the fine-tuning data is" in capsys.readouterr().err
    config = tmp_path / "ft.toml"
    text = (REPO / "training" / "configs" / "finetune.toml").read_text()
    config.write_text(text.replace("epochs = 10", "epochs = 1").replace("max_steps = 0", "max_steps = 3"))
    args = ["--init", str(init_model), "--data-dir", str(domain), "--out", str(tmp_path / "out")]
    assert train_cli.main([*args, "--config", str(config)]) == 0
    assert read_info(tmp_path / "out" / "model").training["config"]["train"]["lr"] == 1e-4
    bad = tmp_path / "bad.toml"
    bad.write_text(text + "\n[model]\nd_model = 64\ndropout = 0.3\n")
    assert train_cli.main([*args, "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "[model] may set only dropout" in err and "d_model = 64 (the model's is 32)" in err


def test_the_config_may_not_contradict_the_model(init_model: Path, domain: Path) -> None:
    info = read_info(init_model)
    cfg = finetune_config(domain)
    cfg.given["model"] = {"dropout", "d_model"}
    cfg.model.dropout = 0.25
    apply_init(cfg, info, "m")  # d_model is 32 in both: no conflict
    assert cfg.model.dropout == 0.25 and cfg.model.vocab_size == info.config.vocab_size
    cfg = finetune_config(domain)
    cfg.data.source_lang, cfg.data.target_lang = "en", "de"
    with pytest.raises(ConfigError, match="the model translates de-en, not en-de"):
        apply_init(cfg, info, "m")
    cfg = finetune_config(domain)
    cfg.given["data"] = set()
    cfg.data.source_lang = "fr"
    apply_init(cfg, info, "m")  # languages not set: the model's
    assert cfg.data.pairs == [("de", "en")]


def test_prepared_data_is_keyed_by_the_tokenizer(
    domain: Path, init_model: Path, spm_model: Path, tmp_path: Path
) -> None:
    cfg = finetune_config(domain)
    root = tmp_path / "prepared"
    first = prepare(cfg.data, root, init=init_model, log=quiet)
    assert prepare(cfg.data, root, init=init_model, log=quiet) == first
    other = Path(shutil.copytree(init_model, tmp_path / "other"))
    shutil.copyfile(spm_model, other / "sentencepiece.model")  # the same model, another tokenizer
    second = prepare(cfg.data, root, init=other, log=quiet)
    assert second != first
    assert prepare(cfg.data, root, vocab=init_model / "sentencepiece.model", log=quiet) not in (first, second)


def test_a_multilingual_model_fine_tuned_on_one_direction_stays_multilingual(tmp_path: Path) -> None:
    """Its directions and target tokens are kept, and the training sources carry the target token."""
    (tmp_path / "data").mkdir()
    corpus = write_corpus(tmp_path / "data", n_train=200, n_val=10, langs=("de", "en", "fr"))
    texts = [
        line for lang in ("de", "en", "fr") for line in (corpus / f"train.{lang}").read_text().splitlines()
    ]
    symbols = [target_token(lang) for lang in ("en", "fr")]
    spm = Tokenizer.train(texts, tmp_path / "spm" / "sentencepiece", 120, control_symbols=symbols)
    tokenizer = Tokenizer(spm)
    prefixes = {lang: [int(tokenizer.sp.PieceToId(target_token(lang)))] for lang in ("en", "fr")}
    cfg = tiny_config(corpus, epochs=1, max_steps=4)
    cfg.data.source_lang, cfg.data.target_lang = "de", "fr"
    torch.manual_seed(0)
    model = Transformer(replace(cfg.model, vocab_size=tokenizer.vocab_size))
    info = ModelInfo.multilingual(model.cfg, [("de", "en"), ("de", "fr")], prefixes)
    init = save_model_dir(tmp_path / "multi", model, info, spm)
    train(cfg, tmp_path / "out", init=init)
    exported = read_info(tmp_path / "out" / "model")
    assert exported.directions == [("de", "en"), ("de", "fr")] and exported.target_prefix == prefixes
    assert exported.training["train_pairs_per_direction"] == {"de-fr": 200}
    (prepared,) = (tmp_path / "out" / "prepared").glob("data-*")
    (direction,) = PreparedCorpus(prepared).train
    assert direction.name == "de-fr" and direction.prefix == prefixes["fr"]


def marian_like(general: Path, out: Path, cfg: TrainConfig) -> Path:
    """A model directory laid out as model.convert writes an OPUS-MT model: source.spm and
    target.spm, source_vocabulary.json and target_vocabulary.json (different sizes, separate
    embeddings), eos 0, unk 1, pad the last id and bos = pad; swish, [sin | cos] positions, an
    output bias. Random weights."""
    out.mkdir()
    vocabs = {}
    for lang, name in (("de", "source"), ("en", "target")):
        texts = (general / f"train.{lang}").read_text().splitlines()
        spm = Tokenizer.train(texts, out / "spm" / lang, 300 if lang == "de" else 250)
        shutil.copyfile(spm, out / f"{name}.spm")
        pieces = Tokenizer(spm).vocabulary()[4:]  # SentencePiece's own specials are not the model's
        vocabs[name] = ["</s>", "<unk>", *pieces, "<pad>"]
        (out / f"{name}_vocabulary.json").write_text(json.dumps(vocabs[name], ensure_ascii=False))
    shutil.rmtree(out / "spm")
    pad = len(vocabs["target"]) - 1
    config = replace(
        cfg.model,
        vocab_size=len(vocabs["target"]),
        source_vocab_size=len(vocabs["source"]),
        share_embeddings=False,
        activation="swish",
        positions="sinusoidal_halves",
        output_bias=True,
        pad_id=pad,
        unk_id=1,
        bos_id=pad,
        eos_id=0,
    )
    torch.manual_seed(0)
    info = ModelInfo(config, "de", "en", training={"origin": "hand-made", "licence": "CC0-1.0"})
    return save_model_dir(out, Transformer(config), info, out)  # the tokenizer files are there already


def test_a_model_with_mapped_vocabularies_and_marian_ids_fine_tunes(
    general: Path, domain: Path, tmp_path: Path
) -> None:
    cfg = finetune_config(domain, epochs=2)
    init = marian_like(general, tmp_path / "marian", cfg)
    config = read_info(init).config
    assert config.source_vocab_size != config.vocab_size and (config.pad_id, config.eos_id) != (0, 3)
    result = train(cfg, tmp_path / "out", init=init)
    valid = valid_records(tmp_path / "out")
    before, after = valid[0]["valid_loss"], valid[-1]["valid_loss"]
    assert isinstance(before, float) and isinstance(after, float)
    print(f"mapped vocabularies: domain validation loss {before:.3f} (random init) -> {after:.3f}")
    assert after < before - 0.5
    # Each side was encoded with its own model and vocabulary: few unknowns, ids in that side's range.
    (prepared,) = (tmp_path / "out" / "prepared").glob("data-*")
    (direction,) = PreparedCorpus(prepared).train
    for side, size in ((direction.src, config.source_vocab_size), (direction.tgt, config.vocab_size)):
        ids = side.tokens[0 : len(side.tokens)]
        assert ids.max() < size - 1  # never pad (the last id)
        assert (ids == config.unk_id).mean() < 0.01 and not (ids == config.eos_id).any()
    for file in tokenizer_files(init):
        assert (tmp_path / "out" / "model" / file.name).read_bytes() == file.read_bytes()
    assert {f.name for f in tokenizer_files(tmp_path / "out" / "model")} == {
        "source.spm",
        "target.spm",
        "source_vocabulary.json",
        "target_vocabulary.json",
    }
    info, _ = read_info_and_tokenizer(tmp_path / "out" / "model")
    assert info.config == config and info.training["licence"] == "CC0-1.0"
    assert result.model_dir is not None
    (hyp,) = Translator.load(result.model_dir, device="cpu").translate_batch(["Ein Mann mit einem Hut."])
    assert hyp.hypotheses[0].strip()
