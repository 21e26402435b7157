"""Training data of any size: preparation into token arrays on disk (streamed, cached by key),
the epoch plan (pools, batches, temperature sampling), and each rank's shard of it."""

from __future__ import annotations

import gzip
import json
import os
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from model.tokenizer import EOS_ID, Tokenizer
from tests.corpora import tiny_config, write_corpus
from training import prepare as prepare_cli
from training.arrays import DiskArray
from training.config import ConfigError
from training.data import PreparedCorpus, collate, iterate
from training.prepare import MANIFEST, DataError, prepare, prepared_corpus
from training.sampling import EpochPlan, cut_batches, epoch_draws, piece_size
from training.text import reservoir_sample


def quiet(_: str) -> None:
    pass


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_corpus(tmp_path_factory.mktemp("corpus"), n_train=300, n_val=20)
    # odd lines a pipeline must survive: an empty pair, an over-long one, a lone \r inside a line
    src = (path / "train.de").read_text().splitlines()
    tgt = (path / "train.en").read_text().splitlines()
    src[5], tgt[5] = "", "An empty source."
    src[6], tgt[6] = "Ein Mann " * 150, "A man."
    src[7], tgt[7] = "Ein\rHund.", "A\rdog."
    with gzip.open(path / "train.de.gz", "wt", encoding="utf-8") as f:  # the source side gzipped
        f.write("".join(s + "\n" for s in src))
    (path / "train.de").unlink()
    (path / "train.en").write_text("".join(t + "\n" for t in tgt))
    return path


@pytest.fixture(scope="module")
def prepared(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = tiny_config(corpus)
    cfg.data.max_tokens_per_sentence = 100
    return prepare(cfg.data, tmp_path_factory.mktemp("prepared"), log=quiet)


# -- preparation -----------------------------------------------------------------------------------
def test_prepared_arrays_hold_every_line_and_keep_only_usable_pairs(corpus: Path, prepared: Path) -> None:
    data = PreparedCorpus(prepared)
    tok = data.tokenizer
    with gzip.open(corpus / "train.de.gz", "rt", encoding="utf-8", newline="\n") as f:
        src = [line.rstrip("\n") for line in f]
    tgt = (corpus / "train.en").read_bytes().decode().split("\n")[:-1]
    assert len(src) == len(tgt) == 300  # "\r" inside a line did not split it
    (train,) = data.train
    for i in (0, 7, 123, 299):  # every line's tokens, as SentencePiece encodes it
        assert train.src.line(i).tolist() == tok.encode([src[i]])[0]
        assert train.tgt.line(i).tolist() == tok.encode([tgt[i]])[0]
    kept = train.pairs[:].tolist()
    assert 5 not in kept and 6 not in kept and len(kept) == 298  # empty and too long dropped
    entry = data.manifest["directions"]["train"]["de-en"]
    assert (entry["kept"], entry["empty"], entry["too_long"]) == (298, 1, 1)
    k = kept.index(7)
    ls, lt = len(train.src.line(7)), len(train.tgt.line(7))
    assert train.sizes.item(k) == ls + lt + 2
    assert data.manifest["token_dtype"] == "uint16"
    sources, references = data.valid_text(data.valid[0])
    assert sources == (corpus / "val.de").read_text().splitlines() and len(references) == 20


def test_preparation_is_cached_by_key(corpus: Path, tmp_path: Path) -> None:
    cfg = tiny_config(corpus)
    first = prepare(cfg.data, tmp_path, log=quiet)
    stamp = (first / MANIFEST).stat().st_mtime_ns
    messages: list[str] = []
    assert prepare(cfg.data, tmp_path, log=messages.append) == first  # the same inputs: reused
    assert (first / MANIFEST).stat().st_mtime_ns == stamp and any("reusing" in m for m in messages)
    cfg.data.max_tokens_per_sentence = 50  # another filter: new arrays, the same vocabulary
    filtered = prepare(cfg.data, tmp_path, log=quiet)
    assert filtered != first
    assert PreparedCorpus(filtered).vocab_sha256 == PreparedCorpus(first).vocab_sha256
    cfg.data.vocab_size = 150  # another vocabulary: everything anew
    revocab = prepare(cfg.data, tmp_path, log=quiet)
    assert PreparedCorpus(revocab).vocab_sha256 != PreparedCorpus(first).vocab_sha256
    cfg.data.vocab_size, cfg.data.max_tokens_per_sentence = 200, 200
    path = corpus / "val.en"
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # the data changed
    assert prepare(cfg.data, tmp_path, log=quiet) not in (first, filtered, revocab)
    assert sorted(p.name[:5] for p in tmp_path.iterdir()) == ["data-"] * 4 + ["vocab"] * 2  # no temporaries


def test_a_prepared_corpus_is_usable_without_the_raw_files(prepared: Path, tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path / "no-such-dir")
    cfg.data.max_tokens_per_sentence = 100
    cfg.data.prepared_dir = str(prepared)
    assert prepared_corpus(cfg.data, tmp_path, log=quiet) == prepared
    cfg.data.max_tokens_per_sentence = 120
    with pytest.raises(ConfigError, match="max_tokens_per_sentence is 100 there, 120 here"):
        prepared_corpus(cfg.data, tmp_path, log=quiet)


def test_vocabulary_is_trained_on_a_sample_of_each_language(corpus: Path, tmp_path: Path) -> None:
    cfg = tiny_config(corpus)
    cfg.data.spm_sample_sentences = 60
    messages: list[str] = []
    prepare(cfg.data, tmp_path, log=messages.append)
    assert any("SentencePiece model on 60 sentences" in m for m in messages)  # 30 per language


def test_reservoir_sample_is_uniform_in_one_pass() -> None:
    lines = [str(i) for i in range(1000)]
    assert reservoir_sample(iter(lines[:5]), 10, random.Random(0)) == lines[:5]
    sample = reservoir_sample(iter(lines), 100, random.Random(0))
    assert len(set(sample)) == 100 and set(sample) <= set(lines)
    assert sample == reservoir_sample(iter(lines), 100, random.Random(0))
    hits = Counter(x for seed in range(200) for x in reservoir_sample(iter(lines), 100, random.Random(seed)))
    firsts, lasts = sum(hits[str(i)] for i in range(500)), sum(hits[str(i)] for i in range(500, 1000))
    assert abs(firsts - lasts) < 0.1 * (firsts + lasts)  # the end of the input as likely as the start


def test_prepare_cli_prepares_where_training_looks(corpus: Path, tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text((Path(__file__).parents[1] / "training" / "configs" / "tiny.toml").read_text())
    args = ["--config", str(config), "--data-dir", str(corpus), "--out", str(tmp_path / "run")]
    assert prepare_cli.main(args) == 0
    cfg = tiny_config(corpus)
    assert prepared_corpus(cfg.data, tmp_path / "run", log=quiet).parent == tmp_path / "run" / "prepared"
    (tmp_path / "bad").mkdir()
    write_corpus(tmp_path / "bad", n_train=20)
    (tmp_path / "bad" / "train.en").write_text("one line\n")
    with pytest.raises(DataError, match="files are not parallel"):
        prepare(tiny_config(tmp_path / "bad").data, tmp_path / "p", log=quiet)
    assert not [p for p in (tmp_path / "p").iterdir() if p.name.startswith(".data")]  # nothing half-written


def test_collate_pads_and_puts_the_prefix_first() -> None:
    batch = collate([([7], np.array([10, 11]), np.array([20])), ([], np.array([12]), np.array([21, 22, 23]))])
    assert batch.src.tolist() == [[7, 10, 11, EOS_ID], [12, EOS_ID, 0, 0]]
    assert batch.tgt_in.tolist() == [[2, 20, 0, 0], [2, 21, 22, 23]]
    assert batch.tgt_out.tolist() == [[20, EOS_ID, 0, 0], [21, 22, 23, EOS_ID]]
    assert batch.n_tokens == 6


# -- the epoch plan --------------------------------------------------------------------------------
def sizes_of(*counts: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(4, 60, n).astype(np.int32) for n in counts]


def pairs_of(plan: EpochPlan, start: int = 0) -> list[tuple[int, int]]:
    return [
        (d, k)
        for b in plan.batches(start)
        for d, k in zip(b.directions.tolist(), b.indices.tolist(), strict=True)
    ]


@pytest.mark.parametrize("pool", [100, 10**9])  # many pools; one
def test_an_epoch_covers_every_pair_once_in_batches_within_the_budget(pool: int) -> None:
    sizes = sizes_of(2000)
    plan = EpochPlan(sizes, max_tokens=400, pool=pool, seed=3, epoch=0)
    batches = list(plan.batches())
    assert sorted(pairs_of(plan)) == [(0, k) for k in range(2000)]
    for b in batches:
        assert len(b.indices) == 1 or int(sizes[0][b.indices].max()) * len(b.indices) <= 400
    assert len(plan) == len(batches)
    again = EpochPlan(sizes, max_tokens=400, pool=pool, seed=3, epoch=0)
    assert pairs_of(again) == pairs_of(plan)  # deterministic: resume relies on it
    assert pairs_of(EpochPlan(sizes, max_tokens=400, pool=pool, seed=3, epoch=1)) != pairs_of(plan)
    if pool == 100:  # a pool's pairs are in memory at a time: ~pool of them, whatever the corpus size
        assert max(int((p[:, 2] - p[:, 1]).sum()) for p in plan.pools()) < 100 + piece_size(2000)


def test_resuming_mid_epoch_skips_exactly_the_batches_trained_on() -> None:
    plan = EpochPlan(sizes_of(3000, 500), max_tokens=300, pool=256, seed=1, epoch=2, temperature=2.0)
    whole = [(b.directions.tolist(), b.indices.tolist()) for b in plan.batches()]
    for start in (0, 1, 17, len(whole) - 1, len(whole)):
        fresh = EpochPlan(sizes_of(3000, 500), max_tokens=300, pool=256, seed=1, epoch=2, temperature=2.0)
        if start % 2:
            len(fresh)  # with or without the pool counts known
        assert [(b.directions.tolist(), b.indices.tolist()) for b in fresh.batches(start)] == whole[start:]


def test_ranks_take_disjoint_equal_shares_of_the_same_batches() -> None:
    sizes = sizes_of(1500, 700)
    whole = EpochPlan(sizes, max_tokens=300, pool=400, seed=5, epoch=0, temperature=1.0)
    n_pools = len(list(whole.pools()))
    shards = [EpochPlan(sizes, max_tokens=300, pool=400, seed=5, epoch=0, rank=r, world=3) for r in range(3)]
    assert len({len(s) for s in shards}) == 1  # every rank steps as often: no all-reduce waits forever
    batches = [
        [tuple(zip(b.directions.tolist(), b.indices.tolist(), strict=True)) for b in s.batches()]
        for s in shards
    ]
    everything = [tuple(zip(b.directions.tolist(), b.indices.tolist(), strict=True)) for b in whole.batches()]
    seen = [b for shard in batches for b in shard]
    assert len(set(seen)) == len(seen) and set(seen) <= set(everything)  # no batch twice, none made up
    assert len(everything) - len(seen) <= 2 * n_pools  # at most world - 1 left over per pool


def test_temperature_sampling_lifts_small_directions() -> None:
    assert epoch_draws([9000, 1000], 1.0) == [9000, 1000]
    flat = epoch_draws([9000, 1000], 5.0)
    assert sum(flat) == 10000 and flat[1] > 2500  # (0.1 ** 0.2) / (0.9 ** 0.2 + 0.1 ** 0.2) ~ 0.39
    assert epoch_draws([9000, 1000], 1000.0) == pytest.approx([5000, 5000], abs=10)  # ~ uniform
    plan = EpochPlan(sizes_of(9000, 1000), max_tokens=600, pool=2048, seed=0, epoch=0, temperature=5.0)
    counts = Counter(pairs_of(plan))
    small = [counts[(1, k)] for k in range(1000)]
    assert sum(small) == flat[1] and min(small) >= 3  # every small pair seen, repeated
    large = [k for k in range(9000) if counts[(0, k)]]
    assert len(large) == flat[0] and max(counts[(0, k)] for k in large) == 1  # a subset, each once
    mixed = [b for b in plan.batches() if len(set(b.directions.tolist())) == 2]
    assert len(mixed) > len(plan) // 2  # batches mix the directions


def test_cut_batches_is_greedy_within_the_budget() -> None:
    sizes = np.array([3, 3, 4, 5, 9, 9, 50, 200])
    cuts = cut_batches(sizes, 20)
    assert cuts == [0, 4, 6, 7, 8]  # 4 x 5 = 20; 2 x 9; 50 alone; 200 alone (over the budget)


def test_reading_batches_from_the_prepared_corpus(prepared: Path) -> None:
    data = PreparedCorpus(prepared)
    plan = EpochPlan([d.sizes for d in data.train], max_tokens=512, pool=64, seed=0, epoch=0)
    tokens = sum(b.n_tokens for b in iterate(data.train, plan))
    (train,) = data.train
    assert tokens == sum(len(train.example(k)[1]) + 1 for k in range(len(train)))
    meta = json.loads((prepared / MANIFEST).read_text())
    assert meta["files"]["train.de"]["lines"] == 300
    assert Tokenizer(data.spm_path).vocab_size == meta["vocab_size"]


def test_disk_array_reads_only_contiguous_slices(tmp_path: Path) -> None:
    values = np.arange(1000, dtype=np.int32) * 7
    (tmp_path / "a.bin").write_bytes(values.tobytes())
    array = DiskArray(tmp_path / "a.bin", np.int32)
    assert len(array) == 1000
    assert array[10:20].tolist() == values[10:20].tolist()
    assert array[990:2000].tolist() == values[990:].tolist()  # clipped at the end, as numpy does
    assert array.item(999) == 6993 and array[5:5].size == 0
    with pytest.raises(IndexError):
        array.item(1000)
    with pytest.raises(ValueError, match="contiguous"):
        array[::2]
