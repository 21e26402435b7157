"""Small Hugging Face MarianMTModel directories made offline, for the OPUS-MT converter's tests (and
benchmarks): what ``MarianMTModel.save_pretrained`` and ``MarianTokenizer`` write for an OPUS-MT
model (config.json, model.safetensors, source.spm, target.spm, vocab.json, tokenizer_config.json),
with SentencePiece models and weights trained in seconds on Multi30k. Their shape, config,
SentencePiece models and vocabulary are ``benchmarks.opus_shape``'s, as the benchmarks' OPUS-MT-sized
models' are.

The weights are trained (a few hundred Adam steps on CPU) rather than random so that greedy and
beam search end with eos like a real model's and the comparisons see varied, non-degenerate output.
A multilingual model's training targets open with a word its target token chooses (``OPENERS``), so
that the token steers its first output piece by a margin checked as the model is made.
transformers' Marian is post-norm only (its config has no normalize_before): pre-norm is not made
here; the converter refuses a config that asks for it.
"""

from __future__ import annotations

import gzip
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sentencepiece as spm
import torch
from safetensors.torch import save_file

from benchmarks.opus_shape import Shape, marian_vocab, random_marian, spm_pieces, train_spm

REPO = Path(__file__).resolve().parents[1]
# Multi30k beside the checkout (as CI has it, see benchmarks.common.DATA), or the shared data folder.
DATA_DIRS = (REPO.parent / "shared" / "data" / "multi30k", Path("/work/shared/data/multi30k"))
SOURCE = "de"
TARGETS = {"eng": "en", "fra": "fr", "ces": "cs"}  # a multilingual model's >>xxx<< tokens
# The word every training target of a multilingual model begins with, one per target token: the
# token alone then decides the first output piece, by a wide margin (``_check_steering``), so that
# tests can tell which token a translation was made with. Without it a model trained this briefly
# ignores its target token, and outputs for two targets differ only by quantization noise.
OPENERS = {"eng": "Behold", "fra": "Voici", "ces": "Hle"}
# Logits between the first piece and the runner-up, for every target token: int8 moves a first-step
# logit of this model by 0.14 at most (float32 training gives margins of 3 to 4 on AVX-512 and AVX2).
STEERING_MARGIN = 1.0
STEERING_SENTENCES = 50  # test_2016_flickr sources the margin is checked on
SHAPE = Shape(d_model=32, layers=2, heads=4, ffn=64, positions=128)  # trained in seconds on CPU
OPUS_MT_KEYS = {
    "normalize_before": False,
    "normalize_embedding": False,
    "static_position_embeddings": True,
    "add_bias_logits": False,
    "add_final_layer_norm": False,
    "num_beams": 4,
    "max_length": 512,
}


def data_dir() -> Path | None:
    return next((d for d in DATA_DIRS if (d / "train.de.gz").is_file()), None)


def read_gz(name: str, n: int, *, offset: int = 0) -> list[str]:
    """Lines ``offset``..``offset+n`` of Multi30k's gzipped file ``name`` (read, never copied)."""
    found = data_dir()
    if found is None:
        raise FileNotFoundError(f"Multi30k not found in {', '.join(map(str, DATA_DIRS))}")
    with gzip.open(found / name, "rt", encoding="utf-8") as f:
        lines = [line.strip() for _, line in zip(range(offset + n), f, strict=False)]
    return lines[offset:]


@dataclass(frozen=True)
class MarianOptions:
    activation: str = "swish"  # OPUS-MT's; also "relu", "gelu"
    scale_embedding: bool = True  # OPUS-MT's
    logits_bias: bool = False  # a non-zero final_logits_bias (OPUS-MT's are zero)
    tie_word_embeddings: bool = True  # False: lm_head and (in transformers 5) each embedding apart
    separate_vocabs: bool = False  # vocab.json + target_vocab.json, share_encoder_decoder_embeddings false
    multilingual: bool = False  # de -> >>eng<< / >>fra<< / >>ces<< (like opus-mt-en-ROMANCE)
    # The (non-persistent) sinusoid table written into the weights as old OPUS-MT checkpoints have it;
    # "perturbed" makes it a table no sinusoid matches (the converter imports it as learned).
    positions_in_weights: str = ""  # "" | "exact" | "perturbed"
    pytorch_bin: bool = False  # pytorch_model.bin (a plain state dict) instead of model.safetensors
    steps: int = 200  # training steps (0: the random initialisation)
    seed: int = 0


def _corpus(multilingual: bool, n: int, offset: int = 0) -> list[tuple[str, str, str]]:
    """(target code, source, target) triples: de-en, or de into each of TARGETS in turn, each
    target opened by its code's OPENERS word."""
    source = read_gz("train.de.gz", n, offset=offset)
    if not multilingual:
        return [("", s, t) for s, t in zip(source, read_gz("train.en.gz", n, offset=offset), strict=True)]
    targets = {code: read_gz(f"train.{lang}.gz", n, offset=offset) for code, lang in TARGETS.items()}
    codes = [list(TARGETS)[i % len(TARGETS)] for i in range(len(source))]
    return [
        (c, s, f"{OPENERS[c]} {targets[c][i]}") for i, (c, s) in enumerate(zip(codes, source, strict=True))
    ]


def make_marian_dir(out: Path, options: MarianOptions, *, cache: Path, sentences: int = 3000) -> Path:
    """A MarianMTModel directory with ``options`` in ``out``; SentencePiece models are kept in ``cache``."""
    out.mkdir(parents=True, exist_ok=True)
    corpus = _corpus(options.multilingual, sentences)
    kind = "mul" if options.multilingual else "en"
    # model_type, the default, written into the .spm files as these models have always had it.
    src_spm = train_spm([s for _, s, _ in corpus], cache / "spm-de", 400, model_type="unigram")
    tgt_spm = train_spm(
        [t for _, _, t in corpus],
        cache / f"spm-{kind}",
        500 if options.multilingual else 400,
        model_type="unigram",
    )
    codes = tuple(f">>{c}<<" for c in TARGETS) if options.multilingual else ()
    if options.separate_vocabs:
        # One pad id for both sides (transformers' Marian has one): <pad> right after the specials.
        vocab = marian_vocab(spm_pieces(src_spm), first=("<pad>", *codes))
        target_vocab = marian_vocab(spm_pieces(tgt_spm), first=("<pad>",))
    else:
        vocab = target_vocab = marian_vocab(spm_pieces(src_spm), spm_pieces(tgt_spm), first=codes)
    pad = vocab["<pad>"]
    assert target_vocab["<pad>"] == pad, "the separate vocabularies' <pad> ids differ"
    for name in ("source.spm", "target.spm"):
        (out / name).write_bytes((src_spm if name == "source.spm" else tgt_spm).read_bytes())
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False, indent=1))
    if options.separate_vocabs:
        (out / "target_vocab.json").write_text(json.dumps(target_vocab, ensure_ascii=False, indent=1))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "MarianTokenizer",
                "source_lang": SOURCE,
                "target_lang": "mul" if options.multilingual else "en",
                "separate_vocabs": options.separate_vocabs,
                "model_max_length": 512,
            }
        )
    )
    model = random_marian(
        SHAPE,
        vocab_size=len(vocab),
        pad=pad,
        seed=options.seed,
        activation=options.activation,
        scale_embedding=options.scale_embedding,
        decoder_vocab_size=len(target_vocab),
        share_encoder_decoder_embeddings=not options.separate_vocabs,
        tie_word_embeddings=options.tie_word_embeddings,
        dropout=0.0,
    )
    if options.logits_bias:
        model.final_logits_bias.normal_(0.0, 0.5)
    # Marian has no <pad> (transformers' conversion added it), and CTranslate2 drops it from the
    # vocabulary: its softmax has no pad term, transformers' has exp(logit of pad) (ours masks it:
    # model.convert.marian). In a
    # real OPUS-MT model that term is negligible (pad's logit is 0, the likely tokens' 10 to 20);
    # in these tiny ones it is not and would move beam scores, so pad's logit is put out of reach.
    model.final_logits_bias[0, pad] = -100.0
    _train(model, corpus, out, vocab, target_vocab, options)
    model.eval()
    with torch.no_grad():
        # As in the real OPUS-MT conversions: Marian has no pad, transformers' conversion added a zero
        # row for it (training here moved it through the tied output projection). The decoder starts
        # from it, and CTranslate2 starts from a zero vector instead.
        for module in {
            id(m): m for m in (model.model.encoder.embed_tokens, model.model.decoder.embed_tokens)
        }.values():
            module.weight[pad].zero_()
    if options.multilingual and options.steps:
        _check_steering(model, out, vocab)
    model.save_pretrained(out)
    config_file = out / "config.json"  # the Bart-era keys real OPUS-MT configs still carry (all off)
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **OPUS_MT_KEYS}, indent=2))
    _rewrite_weights(model, out, options)
    return out


def _train(
    model: Any,  # a MarianMTModel
    corpus: list[tuple[str, str, str]],
    out: Path,
    vocab: dict[str, int],
    target_vocab: dict[str, int],
    options: MarianOptions,
) -> None:
    """A few hundred Adam steps on the pairs: enough to learn lengths and ending with eos."""
    if options.steps == 0:
        return
    source_sp = spm.SentencePieceProcessor(model_file=str(out / "source.spm"))
    target_sp = spm.SentencePieceProcessor(model_file=str(out / "target.spm"))
    pad = model.config.pad_token_id
    pairs = [
        (
            ([vocab[f">>{code}<<"]] if code else []) + _ids(source_sp, s, vocab),
            _ids(target_sp, t, target_vocab),
        )
        for code, s, t in corpus
    ]
    rng = random.Random(options.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    model.train()
    for _ in range(options.steps):
        batch = rng.sample(pairs, 32)
        src = _pad([s for s, _ in batch], pad)
        labels = _pad([t for _, t in batch], -100)  # -100: not in the loss
        loss = model(input_ids=src, attention_mask=src != pad, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _ids(sp: spm.SentencePieceProcessor, text: str, vocab: dict[str, int]) -> list[int]:
    """A sentence as training feeds it: its pieces' ids in ``vocab`` (unknown ones unk), at most 24,
    then eos."""
    return [vocab.get(p, vocab["<unk>"]) for p in sp.Encode(text, out_type=str)][:24] + [0]


def _check_steering(model: Any, out: Path, vocab: dict[str, int]) -> None:
    """Raise unless a multilingual model's target token alone decides its first output piece: over
    STEERING_SENTENCES test sources, each token's first piece is the same for every source, differs
    from every other token's, and leads the runner-up by STEERING_MARGIN logits or more (far beyond
    what int8 quantization moves a logit), so that two targets never give the same translation."""
    source_sp = spm.SentencePieceProcessor(model_file=str(out / "source.spm"))
    texts = read_gz("test_2016_flickr.de.gz", STEERING_SENTENCES)
    pad = model.config.pad_token_id
    firsts: dict[str, set[int]] = {}
    with torch.no_grad():
        for code in TARGETS:
            src = _pad([[vocab[f">>{code}<<"], *_ids(source_sp, t, vocab)] for t in texts], pad)
            start = torch.full((len(texts), 1), model.config.decoder_start_token_id)
            logits = model(input_ids=src, attention_mask=src != pad, decoder_input_ids=start).logits[:, 0]
            top = logits.topk(2, dim=-1)
            margin = float((top.values[:, 0] - top.values[:, 1]).min())
            if margin < STEERING_MARGIN:
                raise RuntimeError(
                    f">>{code}<< leads its first piece by only {margin:.2f} logits (< {STEERING_MARGIN})"
                )
            firsts[code] = set(top.indices[:, 0].tolist())
    if any(len(ids) != 1 for ids in firsts.values()) or len(set.union(*firsts.values())) != len(TARGETS):
        raise RuntimeError(f"the target tokens do not each choose their own first piece: {firsts}")


def _pad(rows: list[list[int]], value: int) -> torch.Tensor:
    width = max(map(len, rows))
    return torch.tensor([row + [value] * (width - len(row)) for row in rows])


def _rewrite_weights(model: Any, out: Path, options: MarianOptions) -> None:
    """Old OPUS-MT checkpoints: the position tables in the weights, or a pickled state dict."""
    if not options.positions_in_weights and not options.pytorch_bin:
        return
    from safetensors.torch import load_file

    state = load_file(str(out / "model.safetensors"))
    if options.positions_in_weights:
        table = model.model.encoder.embed_positions.weight.detach().clone()
        if options.positions_in_weights == "perturbed":
            table += 0.05 * torch.randn(table.shape, generator=torch.Generator().manual_seed(1))
        for side in ("encoder", "decoder"):
            state[f"model.{side}.embed_positions.weight"] = table.clone()
    if options.pytorch_bin:
        # Every name of the module, tied ones repeated, as torch.save(model.state_dict()) wrote them.
        full = {k: v.detach().clone() for k, v in model.state_dict().items()}
        full.update(state)
        (out / "model.safetensors").unlink()
        torch.save(full, out / "pytorch_model.bin")
    else:
        save_file(
            {k: v.contiguous() for k, v in state.items()},
            str(out / "model.safetensors"),
            metadata={"format": "pt"},
        )
