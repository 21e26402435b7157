"""Raw parallel text -> a prepared corpus: token arrays on disk, which training reads batches from.

    python -m training.prepare --config C [--data-dir D] [--out O | --prepared-dir P] [--init MODEL_DIR]

``training.train`` does this itself on first use; running it beforehand (e.g. once, on shared
storage, before a multi-node job) gives the same directory, which training then finds and reuses.

A prepared corpus is one directory, ``<prepared_dir>/data-<key>/``:

    manifest.json               what it holds: files, directions, counts, filters, inputs' fingerprint
    sentencepiece.model         the vocabulary its tokens are of
    tokenizer/                  instead, when fine-tuning (``--init``): the initial model's tokenizer
                                files and config.json (its special ids, directions and target tokens)
    {file}.tokens               token ids of every line of one input file, concatenated
                                (uint16, int32 for vocabularies over 65,535 pieces)
    {file}.offsets              int64, lines + 1: line i is tokens[offsets[i]:offsets[i + 1]]
    {split}.{src}-{tgt}.pairs   int64: the line numbers of the pairs kept (not empty, not too long)
    {split}.{src}-{tgt}.sizes   int32: their padded size in a batch (source + target + 2)
    {valid file}.txt            the validation text, for BLEU

(``{file}`` is the input's name without .gz: ``train.de``; when fine-tuning, with ``.source`` or
``.target`` after it: a model may tokenize the two sides differently). The vocabulary is trained
(unless given) on a sample of the training text and cached beside it in ``<prepared_dir>/vocab-<key>/``.

Everything streams: input lines are read (plain or gzip), encoded and appended in chunks, and the
vocabulary's sample is drawn by reservoir sampling, so memory stays flat whatever the corpus size.
A key is a hash of everything the result depends on (the input files' paths, sizes and
modification times; the vocabulary's bytes or its training settings, or the initial model's
tokenizer files and special ids; directions, splits and filters): a changed input is prepared
afresh, never reused by mistake. A directory is written under a temporary name and renamed when
complete, so an interrupted preparation leaves nothing that looks usable.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import random
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from model.checkpoint import CONFIG_FILE, ModelDirError, ModelInfo, load_tokenizer, read_info, source_prefix
from model.config import ModelConfig
from model.tokenizer import Tokenizer, target_token
from training.arrays import DiskArray, token_dtype
from training.config import ConfigError, DataConfig, from_command_line
from training.finetune import apply_init, copy_tokenizer, tokenizer_sha256
from training.text import (
    DataError,
    Sources,
    file_id,
    fingerprint,
    language_of,
    reservoir_sample,
    sha256_file,
    stream_lines,
)

__all__ = ["DataError", "main", "prepare", "prepared_corpus"]

FORMAT = 1
MANIFEST = "manifest.json"
SPM_FILE = "sentencepiece.model"
TOKENIZER_DIR = "tokenizer"  # fine-tuning: the initial model's tokenizer files and config.json
SELECT_LINES = 1 << 20  # lines whose pairs are filtered per numpy pass


Log = Callable[[str], None]


def _stderr(msg: str) -> None:
    tqdm.write(msg, file=sys.stderr)


def _key(spec: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


# -- the vocabulary --------------------------------------------------------------------------------
def control_symbols(pairs: list[tuple[str, str]]) -> list[str]:
    """A multilingual vocabulary's target-language tokens, one per target language (sorted)."""
    if len(pairs) < 2:
        return []
    return [target_token(lang) for lang in sorted({t for _, t in pairs})]


def vocabulary(data: DataConfig, sources: Sources, root: Path, log: Log) -> Path:
    """The SentencePiece model trained on a sample of the training text, cached in ``root`` by its
    settings and inputs (trained on a miss)."""
    by_lang: dict[str, list[Path]] = {}
    for path in sources.files("train").values():
        by_lang.setdefault(language_of(path), []).append(path)
    symbols = control_symbols(sources.pairs)
    spec = {
        "format": FORMAT,
        "vocab_size": data.vocab_size,
        "sample": data.spm_sample_sentences,
        "control_symbols": symbols,
        "inputs": {lang: [fingerprint(p) for p in paths] for lang, paths in sorted(by_lang.items())},
    }
    final = root / f"vocab-{_key(spec)}"
    if (final / SPM_FILE).is_file():
        log(f"vocabulary: reusing {final / SPM_FILE}")
        return final / SPM_FILE
    # An equal share per language, so that a language with little text still gets its pieces.
    share = max(1, data.spm_sample_sentences // len(by_lang))
    sample: list[str] = []
    for lang, paths in sorted(by_lang.items()):
        rng = random.Random(f"spm-sample-{lang}")
        lines = (
            line
            for path in paths
            for block in stream_lines(path, f"sampling {path.name}")
            for line in block
            if line.strip()
        )
        sample += reservoir_sample(lines, share, rng)
    log(f"vocabulary: training a {data.vocab_size}-piece SentencePiece model on {len(sample)} sentences")
    tmp = _temporary(root, final.name)
    try:  # model_prefix "sentencepiece": writes sentencepiece.model and sentencepiece.vocab
        Tokenizer.train(sample, tmp / "sentencepiece", data.vocab_size, control_symbols=symbols)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    (tmp / "vocab.json").write_text(json.dumps(spec, indent=2) + "\n")
    return _publish(tmp, final) / SPM_FILE


def target_prefixes(
    tokenizer: Tokenizer, pairs: list[tuple[str, str]], spm_path: Path
) -> dict[str, list[int]]:
    """Multilingual: each target language's token ids (its control symbol), read from the vocabulary."""
    prefixes: dict[str, list[int]] = {}
    for piece in control_symbols(pairs):
        i = tokenizer.control_id(piece)
        if i is None:
            raise DataError(
                f"{spm_path}: no control symbol {piece}: a multilingual model's vocabulary needs one per "
                "target language (leave data.spm_model empty to train such a vocabulary)"
            )
        prefixes[piece[2:-1]] = [i]
    return prefixes


def model_info(
    config: ModelConfig, pairs: list[tuple[str, str]], prefixes: dict[str, list[int]]
) -> ModelInfo:
    """The metadata of a model over ``pairs``: bilingual for one direction without target tokens,
    multilingual for more (or for one of a multilingual model's directions, when fine-tuning it)."""
    if len(pairs) == 1 and not prefixes:
        return ModelInfo(config, *pairs[0])
    return ModelInfo.multilingual(config, pairs, prefixes)


# -- encoding --------------------------------------------------------------------------------------
def encode_file(
    tokenizer: Tokenizer, path: Path, prefix: Path, dtype: np.dtype[Any], *, target: bool = False
) -> tuple[int, int]:
    """Encode every line of ``path`` (as the target side: ``target``) into ``prefix``.tokens /
    .offsets; returns (lines, tokens)."""
    lines, tokens = 0, 0
    with open(f"{prefix}.tokens", "wb") as tok_file, open(f"{prefix}.offsets", "wb") as off_file:
        off_file.write(np.zeros(1, np.int64).tobytes())
        for block in stream_lines(path, f"encoding {path.name}"):
            ids = _encode(tokenizer, block, target)
            lengths = np.fromiter(map(len, ids), np.int64, len(ids))
            flat = np.fromiter(itertools.chain.from_iterable(ids), dtype, int(lengths.sum()))
            tok_file.write(flat.tobytes())
            off_file.write((tokens + np.cumsum(lengths)).tobytes())
            lines, tokens = lines + len(ids), tokens + int(lengths.sum())
    return lines, tokens


def _encode(tokenizer: Tokenizer, block: list[str], target: bool) -> list[list[int]]:
    if tokenizer.mapped:  # pieces mapped to the model's ids, one side's or the other's
        return tokenizer.encode(block, target=target)
    return tokenizer.sp.Encode(block)  # type: ignore[no-any-return]  # the list form: one call per chunk


@dataclass
class FilterStats:
    kept: int = 0
    empty: int = 0
    too_long: int = 0
    bad_ratio: int = 0


def select_pairs(
    src_offsets: DiskArray,
    tgt_offsets: DiskArray,
    out: Path,
    *,
    prefix_len: int,
    max_tokens: int,
    max_ratio: float,
) -> FilterStats:
    """Write the line numbers (``out``.pairs) and batch sizes (``out``.sizes) of the usable pairs:
    empty, over-long and (optionally) badly aligned pairs are dropped and counted."""
    stats = FilterStats()
    n = len(src_offsets) - 1
    with open(f"{out}.pairs", "wb") as pairs_file, open(f"{out}.sizes", "wb") as sizes_file:
        for start in range(0, n, SELECT_LINES):
            stop = min(start + SELECT_LINES, n)
            ls = np.diff(src_offsets[start : stop + 1])
            lt = np.diff(tgt_offsets[start : stop + 1])
            empty = (ls == 0) | (lt == 0)
            too_long = ~empty & ((ls + prefix_len + 1 > max_tokens) | (lt + 1 > max_tokens))
            bad = ~empty & ~too_long & (np.maximum(ls, lt) > max_ratio * np.minimum(ls, lt))
            if not max_ratio:  # 0: no ratio filter
                bad[:] = False
            keep = ~(empty | too_long | bad)
            pairs_file.write((start + np.flatnonzero(keep)).astype(np.int64).tobytes())
            sizes_file.write((ls + prefix_len + lt + 2)[keep].astype(np.int32).tobytes())
            stats.kept += int(keep.sum())
            stats.empty += int(empty.sum())
            stats.too_long += int(too_long.sum())
            stats.bad_ratio += int(bad.sum())
    return stats


# -- the prepared corpus ---------------------------------------------------------------------------
def _temporary(root: Path, name: str) -> Path:
    tmp = root / f".{name}.{os.uname().nodename}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def _publish(tmp: Path, final: Path) -> Path:
    """Rename a completed directory into place; if another process got there first, keep theirs."""
    try:
        tmp.rename(final)
    except OSError:
        if not final.is_dir():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def corpus_spec(data: DataConfig, sources: Sources, vocab_sha: str, *, init: bool = False) -> dict[str, Any]:
    """Everything a prepared corpus depends on (its key is a hash of this). ``vocab_sha``: the
    SentencePiece model's sha256, or with ``init`` the initial model's ``tokenizer_sha256``."""
    return {
        "format": FORMAT,
        "vocab_sha256": vocab_sha,
        **({"tokenizer": "init"} if init else {}),
        "directions": [f"{s}-{t}" for s, t in sources.pairs],
        "splits": sources.splits,
        "max_tokens_per_sentence": data.max_tokens_per_sentence,
        "max_length_ratio": data.max_length_ratio,
        "inputs": {
            role: {fid: fingerprint(p) for fid, p in sorted(sources.files(role).items())}
            for role in ("train", "valid")
        },
    }


def init_tokenizer(init: str | Path) -> tuple[ModelInfo, str]:
    """The initial model's metadata and ``tokenizer_sha256`` (``ModelDirError`` if it has none)."""
    info = read_info(init)
    return info, tokenizer_sha256(init, info)


def prepare(
    data: DataConfig,
    root: str | Path,
    *,
    vocab: str | Path | None = None,
    init: str | Path | None = None,
    log: Log = _stderr,
) -> Path:
    """The prepared corpus of ``data`` under ``root``: found by its key, or built.

    ``vocab``: the SentencePiece model to use (else ``data.spm_model``, else one trained on a
    sample of the training text and cached in ``root`` too). ``init``: fine-tuning, the model
    directory whose tokenizer (and special ids, target tokens) to use instead.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    sources = Sources.find(data)
    if init is not None:
        vocab = Path(init)
        spec = corpus_spec(data, sources, init_tokenizer(init)[1], init=True)
    else:
        vocab = (
            Path(vocab or data.spm_model)
            if (vocab or data.spm_model)
            else vocabulary(data, sources, root, log)
        )
        if not vocab.is_file():
            raise DataError(f"{vocab}: SentencePiece model not found")
        spec = corpus_spec(data, sources, sha256_file(vocab))
    final = root / f"data-{_key(spec)}"
    if (final / MANIFEST).is_file():
        log(f"prepared data: reusing {final}")
        return final
    start = time.perf_counter()
    tmp = _temporary(root, final.name)
    try:
        manifest = _build(data, sources, vocab, spec, tmp, log, init=init is not None)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    manifest["seconds"] = round(time.perf_counter() - start, 1)
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")  # written last: marks it complete
    log(f"prepared data: {final} ({manifest['seconds']} s)")
    return _publish(tmp, final)


def _build(
    data: DataConfig, sources: Sources, vocab: Path, spec: dict[str, Any], out: Path, log: Log, *, init: bool
) -> dict[str, Any]:
    """Encode the corpus with the SentencePiece model ``vocab``, or with ``init`` the tokenizer of
    the model directory ``vocab`` (its files and config.json copied into ``out``/tokenizer)."""
    if init:
        prefixes, config, tokenizer = _init_tokenizer(vocab, out / TOKENIZER_DIR)
    else:
        shutil.copyfile(vocab, out / SPM_FILE)
        if vocab.with_suffix(".vocab").is_file():
            shutil.copyfile(vocab.with_suffix(".vocab"), out / "sentencepiece.vocab")
        try:
            tokenizer = Tokenizer(out / SPM_FILE)
        except ValueError as e:
            raise DataError(str(e)) from e
        prefixes = target_prefixes(tokenizer, sources.pairs, vocab)
        config = ModelConfig(vocab_size=tokenizer.vocab_size)
    info = model_info(config, sources.pairs, prefixes)
    dtype = token_dtype(max(config.vocab_size, config.source_vocab))

    def side(path: Path, target: bool) -> str:  # the file id of one side's tokens
        return f"{file_id(path)}.{'target' if target else 'source'}" if init else file_id(path)

    files: dict[str, dict[str, Any]] = {}
    for role in ("train", "valid"):
        for src_path, tgt_path in sources.sides[role].values():
            for path, target in ((src_path, False), (tgt_path, True)):
                fid = side(path, target)
                if fid in files:
                    continue
                lines, tokens = encode_file(tokenizer, path, out / fid, dtype, target=target)
                files[fid] = {"path": str(path), "lang": language_of(path), "lines": lines, "tokens": tokens}
                if role == "valid":  # validation BLEU translates the text and scores against the text
                    with (out / f"{fid}.txt").open("w", encoding="utf-8") as f:
                        for block in stream_lines(path):
                            f.write("".join(line + "\n" for line in block))
    directions: dict[str, dict[str, Any]] = {}
    for role, split in sources.splits.items():
        directions[role] = {}
        for name, (src_path, tgt_path) in sources.sides[role].items():
            src_id, tgt_id = side(src_path, False), side(tgt_path, True)
            src, tgt = files[src_id], files[tgt_id]
            if src["lines"] != tgt["lines"]:
                counts = f"{src_path} has {src['lines']} lines but {tgt_path} has {tgt['lines']}"
                raise DataError(f"{counts}: files are not parallel")
            stats = select_pairs(
                DiskArray(out / f"{src_id}.offsets", np.int64),
                DiskArray(out / f"{tgt_id}.offsets", np.int64),
                out / f"{split}.{name}",
                prefix_len=len(source_prefix(info, name.split("-")[1])),
                max_tokens=data.max_tokens_per_sentence if role == "train" else 10**9,
                max_ratio=data.max_length_ratio if role == "train" else 0.0,
            )
            if role == "train":
                log(
                    f"{name} train pairs: {stats.kept} kept, {stats.empty} empty, {stats.too_long} longer "
                    f"than {data.max_tokens_per_sentence} tokens, {stats.bad_ratio} over the length ratio "
                    "(dropped)"
                )
                if not stats.kept:
                    raise DataError(f"{data.dir}: no usable training pairs for {name} in split '{split}'")
            directions[role][name] = {"src": src_id, "tgt": tgt_id, **asdict(stats)}
    return {
        "format": FORMAT,
        "spec": spec,
        "vocab_size": config.vocab_size,
        "token_dtype": dtype.name,
        "target_prefix": prefixes,
        "files": files,
        "directions": directions,
    }


def _init_tokenizer(model_dir: Path, out: Path) -> tuple[dict[str, list[int]], ModelConfig, Tokenizer]:
    """Copy the tokenizer of ``model_dir`` (and its config.json) into ``out`` and open it there:
    (target-language tokens, the model's config, the tokenizer)."""
    copy_tokenizer(model_dir, out)
    shutil.copyfile(model_dir / CONFIG_FILE, out / CONFIG_FILE)
    try:
        info = read_info(out)
        return info.target_prefix, info.config, load_tokenizer(out, info)
    except ModelDirError as e:
        raise DataError(f"--init {model_dir}: {e}") from e


def check_matches(
    data: DataConfig, corpus: Path, vocab: str | Path | None, init: str | Path | None = None
) -> None:
    """A prepared corpus given as it is (``prepared_dir`` holding manifest.json) must hold what
    the config asks for: ``ConfigError`` naming what differs."""
    spec = json.loads((corpus / MANIFEST).read_text())["spec"]
    wanted = {
        "directions": [f"{s}-{t}" for s, t in data.pairs],
        "splits": {"train": data.train_split, "valid": data.valid_split},
        "max_tokens_per_sentence": data.max_tokens_per_sentence,
        "max_length_ratio": data.max_length_ratio,
    }
    if init is not None:
        wanted["vocab_sha256"] = init_tokenizer(init)[1]
    elif vocab or data.spm_model:
        wanted["vocab_sha256"] = sha256_file(Path(vocab or data.spm_model))
    differ = [f"{k} is {spec.get(k)!r} there, {v!r} here" for k, v in wanted.items() if spec.get(k) != v]
    if differ:
        raise ConfigError(f"{corpus}: prepared for another configuration: {'; '.join(differ)}")


def prepared_corpus(
    data: DataConfig,
    out: Path,
    *,
    vocab: str | Path | None = None,
    init: str | Path | None = None,
    log: Log = _stderr,
) -> Path:
    """Where training finds its prepared corpus: ``data.prepared_dir`` itself when it is one, else
    the one for this config under ``data.prepared_dir`` (default ``<out>/prepared``), built if missing."""
    root = Path(data.prepared_dir) if data.prepared_dir else out / "prepared"
    if (root / MANIFEST).is_file():
        check_matches(data, root, vocab, init)
        log(f"prepared data: using {root} as it is")
        return root
    return prepare(data, root, vocab=vocab, init=init, log=log)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.prepare", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="the training config (its [data] table is what counts)")
    ap.add_argument("--data-dir", help="directory of {split}.{lang}[.gz] files (overrides data.dir)")
    ap.add_argument("--out", help="the training run's output directory: prepares into <out>/prepared")
    ap.add_argument(
        "--prepared-dir", help="prepare under this directory instead (overrides data.prepared_dir)"
    )
    ap.add_argument("--init", help="fine-tuning: tokenize with this model directory's tokenizer")
    args = ap.parse_args(argv)
    try:
        cfg, out = from_command_line(
            args.config, data_dir=args.data_dir, prepared_dir=args.prepared_dir, out=args.out
        )
        if args.init:
            apply_init(cfg, read_info(args.init), args.init)
        path = prepared_corpus(cfg.data, out, init=args.init)
    except (ConfigError, DataError, ModelDirError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
