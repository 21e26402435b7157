"""The Transformer's incremental decoder and its KV cache against the whole-prefix reference.

``decode`` (teacher forcing over the whole prefix, as in training) is the definition of the model;
``step`` over a ``KVCache`` (``source_kv`` appended once, one token per row per step, ``views`` in
and ``advance`` out) must compute the same next-token logits one token at a time, whatever the
cache does around a row: padding, rows joining at different steps (continuous batching), rows
leaving and the last rows moving into their places, beams copying each other's prefixes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import Tensor

from model import cache as model_cache
from model import transformer
from model.cache import KVCache
from model.layers import KEY_ALIGN
from model.runtime import kvrows, runners
from model.tokenizer import BOS_ID, EOS_ID, PAD_ID
from model.transformer import Transformer

TOL = 1e-5  # float32, step by step against the whole prefix; observed differences are ~1e-6
# The same step computation in a batch or alone: not bit-for-bit, as the linear layers' products
# round differently with the number of rows (one row: ~1e-6 on logits of ~2 against two or more),
# and the source width read (``KVCache.width``, the longest source) changes a softmax's summation
# order (test_neighbours_source_lengths_change_nothing).
EXACT = 1e-6  # absolute and relative
VOCAB = 64  # tiny_config's vocab_size
POSITIONS = 48  # the caches' positions (tiny_config's max_positions is 128)

MakeModel = Callable[..., Transformer]


def sources(lengths: list[int], seed: int = 0) -> Tensor:
    """Right-padded (B, S) source ids, each row ``n`` tokens long including its final eos."""
    g = torch.Generator().manual_seed(seed)
    src = torch.full((len(lengths), max(lengths)), PAD_ID, dtype=torch.long)
    for i, n in enumerate(lengths):
        src[i, : n - 1] = torch.randint(4, VOCAB, (n - 1,), generator=g)
        src[i, n - 1] = EOS_ID
    return src


def targets(batch: int, length: int, seed: int = 1) -> Tensor:
    """(B, T) decoder inputs: bos, then random non-special tokens."""
    g = torch.Generator().manual_seed(seed)
    tgt = torch.randint(4, VOCAB, (batch, length), generator=g)
    tgt[:, 0] = BOS_ID
    return tgt


def max_diff(a: Tensor, b: Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def new_cache(model: Transformer, capacity: int, positions: int = POSITIONS) -> KVCache:
    """A cache for the eager step: views read whole multiples of KEY_ALIGN (``EagerRunner.align``)."""
    return runners.new_cache(model, capacity=capacity, positions=positions, align=KEY_ALIGN)


def join(model: Transformer, cache: KVCache, src: Tensor) -> None:
    """Encode ``src`` (B, S) and add its rows after the cache's last one."""
    enc = model.encode(src)
    cache.append(model.source_kv(enc), enc.src_mask)


def step(model: Transformer, cache: KVCache, tokens: Tensor) -> Tensor:
    """One token per live row; returns the logits (R, V)."""
    logits, new_kv = model.step(tokens, *cache.views())
    cache.advance(new_kv)
    return logits


def alone(model: Transformer, source_kv: Tensor, src_mask: Tensor, tgt: Tensor) -> Tensor:
    """One row's source (``source_kv`` (1, L, 2, H, S, Dh), ``src_mask`` (1, S)) decoded step by
    step on its own, in a cache of one row: the logits (T, V) for the teacher-forced ``tgt`` (1, T)."""
    cache = new_cache(model, 1)
    cache.append(source_kv, src_mask)
    return torch.cat([step(model, cache, tgt[:, t]) for t in range(tgt.size(1))])


@pytest.mark.parametrize("tie_embeddings", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("pre_norm", [False, True], ids=["post-ln", "pre-ln"])
def test_step_by_step_decoding_matches_full_decode(
    make_model: MakeModel, pre_norm: bool, tie_embeddings: bool
) -> None:
    model = make_model(seed=0, pre_norm=pre_norm, share_embeddings=tie_embeddings, tie_output=tie_embeddings)
    src = sources([7, 3, 5])  # padded batch: rows of different source lengths
    tgt = targets(3, 9)
    with torch.inference_mode():
        enc = model.encode(src)
        full = model.decode(tgt, enc)  # (B, T, V)
        cache = new_cache(model, capacity=4)  # a row more than used
        cache.append(model.source_kv(enc), enc.src_mask)
        assert cache.rows == 3 and cache.source_lengths == [7, 3, 5] and cache.width == 7
        for t in range(tgt.size(1)):
            logits = step(model, cache, tgt[:, t])
            assert logits.shape == (3, VOCAB)
            assert max_diff(logits, full[:, t]) <= TOL, f"step {t}"
    assert cache.lengths[:3].tolist() == [9, 9, 9] and cache.max_length == 9


class Driver:
    """Drives a ``KVCache`` with teacher-forced sentences and checks every row's logits, at every
    step, against its sentence decoded alone: by the whole-prefix ``decode`` of the sentence
    without padding (within TOL), and step by step from the same source keys/values in a cache of
    its own (within EXACT, relative and absolute: what the cache did around the row changed
    nothing; a wrong prefix or source would differ by ~1e-1)."""

    def __init__(self, model: Transformer, lengths: list[int], capacity: int = 8, steps: int = 12) -> None:
        self.model = model
        self.src = sources(lengths, seed=11)
        self.tgt = targets(len(lengths), steps, seed=12)
        self.lengths = lengths
        self.cache = new_cache(model, capacity)
        self.held: list[tuple[int, int]] = []  # per cache row: (sentence, next position)
        self.alone: dict[int, Tensor] = {}  # per sentence: its logits decoded alone (T, V)
        self.reference()

    def reference(self) -> None:
        """Each sentence's logits by the whole-prefix decoder, without padding: (T, V) each."""
        self.full = [
            self.model.decode(self.tgt[i : i + 1], self.model.encode(self.src[i : i + 1, :n]))[0]
            for i, n in enumerate(self.lengths)
        ]

    def join(self, sentences: list[int]) -> None:
        width = max(self.lengths[i] for i in sentences)  # padded to the longest of them only
        enc = self.model.encode(self.src[sentences, :width])
        kv = self.model.source_kv(enc)
        self.cache.append(kv, enc.src_mask)
        self.held += [(i, 0) for i in sentences]
        for j, i in enumerate(sentences):
            n = self.lengths[i]
            own = alone(
                self.model, kv[j : j + 1, :, :, :, :n], enc.src_mask[j : j + 1, :n], self.tgt[i : i + 1]
            )
            self.alone[i] = own  # a sentence joining again replaces its earlier rows' reference

    def leave(self, rows: list[int]) -> dict[int, int]:
        moves = self.cache.remove(rows)
        held = list(self.held)
        for old, new in moves.items():
            held[new] = self.held[old]
        self.held = held[: self.cache.rows]
        return moves

    def step(self) -> None:
        tokens = torch.stack([self.tgt[i, t] for i, t in self.held])
        logits = step(self.model, self.cache, tokens)
        for row, (i, t) in enumerate(self.held):
            assert max_diff(logits[row], self.full[i][t]) <= TOL, f"row {row}: sentence {i} at {t}"
            torch.testing.assert_close(
                logits[row], self.alone[i][t], atol=EXACT, rtol=EXACT, msg=f"row {row}: sentence {i} at {t}"
            )
        self.held = [(i, t + 1) for i, t in self.held]
        assert self.cache.lengths[: self.cache.rows].tolist() == [t for _, t in self.held]
        assert self.cache.max_length == max(t for _, t in self.held)


@pytest.mark.parametrize("joins", [(0, 4, 1), (0, 0, 3), (0, 2, 2)], ids=str)
@pytest.mark.parametrize("pre_norm", [False, True], ids=["post-ln", "pre-ln"])
def test_rows_joining_at_different_steps_decode_as_if_alone(
    make_model: MakeModel, pre_norm: bool, joins: tuple[int, int, int]
) -> None:
    """Continuous batching: rows join a cache whose rows have decoded some steps (``joins``: the
    steps before each group of sentences joins), with sources of other lengths; each row goes on
    exactly as if decoded alone."""
    with torch.inference_mode():
        run = Driver(make_model(seed=2, pre_norm=pre_norm), [4, 9, 6, 2, 13])
        for group, steps in zip(([0], [1, 2], [3, 4]), joins, strict=True):
            for _ in range(steps):
                run.step()
            run.join(group)
        assert run.cache.rows == 5 and run.cache.width == 13
        for _ in range(4):
            run.step()


def test_remove_moves_the_last_rows_into_the_holes(make_model: MakeModel) -> None:
    """Rows leave from the middle: the last rows move into their places (the others stay), and
    every row goes on as if decoded alone; the source width shrinks to the longest remaining
    source; a freed place is reused, and an emptied cache starts again."""
    with torch.inference_mode():
        run = Driver(make_model(seed=6), [5, 3, 40, 4, 20], steps=14)
        run.join([0, 1])
        for _ in range(2):
            run.step()
        run.join([2, 3, 4])  # longer sources, at position 0 beside rows at position 2
        assert run.cache.width == 40 and run.cache.views()[3].size(3) == 48  # read in multiples of KEY_ALIGN
        for _ in range(2):
            run.step()
        before = run.cache.lengths.clone()
        moves = run.leave([0, 2])  # the longest source leaves: nobody needs its width any more
        assert moves == {3: 0, 4: 2}  # the last rows took the freed places; row 1 stayed
        assert run.cache.lengths[:3].tolist() == [int(before[3]), int(before[1]), int(before[4])]
        assert run.cache.source_lengths == [4, 3, 20] and run.cache.width == 20
        positions, self_kv, cross_kv, src_bias, slots = run.cache.views()
        assert cross_kv.size(4) == src_bias.size(3) == 32 and len(positions) == self_kv.size(0) == 3
        assert slots.tolist() == [0, 1, 2] and cross_kv.size(0) == 3  # a source each
        for _ in range(3):
            run.step()
        assert run.leave([2]) == {}  # the last row leaves: nothing moves
        buffer = run.cache.self_kv
        run.join([0])  # a place freed earlier is reused: no new memory
        run.step()
        assert run.cache.self_kv is buffer
        run.leave(list(range(run.cache.rows)))
        assert run.cache.rows == 0 and run.cache.max_length == 0 and run.cache.width == 0
        run.join([3, 1])  # an emptied cache starts again
        for _ in range(2):
            run.step()


def test_remove_leaving_rows_among_the_movers(make_model: MakeModel) -> None:
    """Leaving rows that are among the last ones: only the staying ones move, into the holes left
    before them."""
    with torch.inference_mode():
        run = Driver(make_model(seed=8, pre_norm=True), [6, 5, 7, 3, 8, 4])
        run.join([0, 1, 2])
        run.step()
        run.join([3, 4, 5])
        for _ in range(2):
            run.step()
        assert run.leave([1, 4, 5]) == {3: 1}
        for _ in range(3):
            run.step()


def test_reorder_copies_decoded_prefixes(make_model: MakeModel) -> None:
    """Beam reordering: rows that read each other's prefixes (a swap: each row both read and
    written), one prefix copied twice, and copies that then diverge without writing into each
    other's rows."""
    with torch.inference_mode():
        run = Driver(make_model(seed=7, pre_norm=True), [6, 6, 6], steps=9)
        run.src[1:] = run.src[0]  # beams of one input: one source, different prefixes
        run.tgt[2, :4] = run.tgt[0, :4]  # sentence 2 shares sentence 0's first 4 tokens, then diverges
        run.reference()
        assert max_diff(run.full[0][5:], run.full[2][5:]) > 1e-2  # the divergence is visible
        run.join([0, 1, 2])  # rows 0 and 2 follow prefix 0 (sentence 2 shares it), row 1 prefix 1
        for _ in range(3):
            run.step()
        run.cache.reorder([1, 0, 1])  # rows 0 and 2 take row 1's prefix, row 1 takes row 0's
        run.held = [run.held[1], run.held[0], run.held[1]]
        run.step()
        run.cache.reorder([0, 1, 1])  # row 2 (prefix 1) takes row 1's (prefix 0, 4 tokens)...
        run.held[2] = (2, run.held[1][1])  # ...and goes on as sentence 2, which shares them
        for _ in range(4):
            run.step()


def test_neighbours_source_lengths_change_nothing(make_model: MakeModel) -> None:
    """What ``KVCache.views`` promises: a row's logits do not depend on the other rows' lengths
    (same number of rows, same steps; only the neighbour's source differs: 4 or 37 tokens). Bit for
    bit with the eager step's alignment; unaligned (align=1) they moved by ~1e-6."""
    model = make_model(seed=2)
    src = sources([5, 4, 37], seed=9)
    tgt = targets(2, 6)
    with torch.inference_mode():
        runs = []
        for neighbour in (1, 2):
            cache = new_cache(model, 2)
            join(model, cache, src[:1, :5])
            join(model, cache, src[neighbour : neighbour + 1, : [4, 37][neighbour - 1]])
            runs.append(torch.stack([step(model, cache, tgt[:, t])[0] for t in range(tgt.size(1))]))
    assert torch.equal(runs[0], runs[1])


def test_cache_refuses_what_does_not_fit(make_model: MakeModel) -> None:
    model = make_model(seed=3)
    with torch.inference_mode():
        with pytest.raises(ValueError, match="max_positions"):
            new_cache(model, 2, positions=model.cfg.max_positions + 1)
        cache = new_cache(model, 2, positions=8)
        join(model, cache, sources([3, 5]))
        with pytest.raises(ValueError, match="capacity"):
            join(model, cache, sources([4]))  # a third row in a cache of two
        assert cache.rows == 2
        cache.remove([1])
        with pytest.raises(ValueError, match="exceeds"):
            join(model, cache, sources([9]))  # a source of 9 positions in a cache of 8
        assert cache.rows == 1 and cache.source_lengths == [3]
        join(model, cache, sources([8]))  # exactly 8 fits
        for _ in range(8):  # and so do 8 decoded positions, not 9
            step(model, cache, torch.full((2,), BOS_ID))
        with pytest.raises(ValueError, match="positions"):
            step(model, cache, torch.full((2,), BOS_ID))


# How a test's cache copies rows: from host indices, one row at a time (the CPU's way without the
# native copies); in one call each (``model.runtime.kvrows``: the CPU's way); by index ops (a device's).
COPIES = ["host-copies", "native", "index-ops"]


@pytest.fixture(scope="module")
def row_kernels(tmp_path_factory: pytest.TempPathFactory) -> model_cache.RowKernels:
    """The native row copies, built here (a C++ compiler is part of the test machine)."""
    assert kvrows.ensure(tmp_path_factory.mktemp("kvrows")), "the native row copies did not build"
    kernels = kvrows.kernels()
    assert kernels is not None
    return kernels


def copying(
    monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest, way: str
) -> Callable[[KVCache], KVCache]:
    """Caches that copy rows ``way`` (one of ``COPIES``): returns what to pass each new cache through."""
    monkeypatch.setattr(model_cache, "copies_on_host", lambda device: way != "index-ops")
    kernels = request.getfixturevalue("row_kernels") if way == "native" else None

    def made(cache: KVCache) -> KVCache:
        cache.kernels = kernels
        return cache

    return made


@pytest.mark.parametrize("way", COPIES)
def test_cache_rows_take_their_new_keys_and_their_parents_prefixes(
    monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest, make_model: MakeModel, way: str
) -> None:
    """``advance`` writes each row's new keys at its own next position, ``reorder`` gives each row
    the prefix its parent had before any row was written (a swap, a parent with two children),
    ``remove`` moves the last rows into the holes: checked against copies taken beforehand, with
    the rows copied one at a time from host indices, in one native call each, and by index ops."""
    made = copying(monkeypatch, request, way)
    monkeypatch.setattr(model_cache, "ROW_COPY_VECTORS", 0)  # (this tiny model's rows write few)
    model = make_model(seed=5)
    with torch.inference_mode():
        cache = made(new_cache(model, 6, positions=12))
        join(model, cache, sources([3, 5, 4, 7]))
        for t in range(3):
            step(model, cache, torch.full((4,), BOS_ID + t))
        join(model, cache, sources([6, 2]))  # rows 4 and 5 have decoded nothing yet
        new_kv = torch.randn(6, *cache.self_kv.shape[1:4], cache.self_kv.size(5))
        before = cache.self_kv.clone()
        cache.advance(new_kv)
        for row, at in enumerate([3, 3, 3, 3, 0, 0]):
            assert torch.equal(cache.self_kv[row, :, :, :, at], new_kv[row])
            assert torch.equal(cache.self_kv[row, :, :, :, :at], before[row, :, :, :, :at])
        assert cache.lengths.tolist() == [4, 4, 4, 4, 1, 1]
        index = [1, 0, 2, 2, 4, 5]  # rows 0 and 1 swap, row 3 takes row 2's prefix
        before = cache.self_kv.clone()
        cache.reorder(index)
        for row, parent in enumerate(index):
            assert torch.equal(cache.self_kv[row, :, :, :, :4], before[parent, :, :, :, :4])
        kept = cache.self_kv.clone(), cache.cross_kv.clone(), cache.src_bias.clone()
        assert cache.remove([0, 2]) == {4: 0, 5: 2}
        assert cache.lengths[: cache.rows].tolist() == [1, 4, 1, 4]
        for row, was in enumerate([4, 1, 5, 3]):
            width = cache.source_lengths[row]
            assert torch.equal(cache.cross_kv[row, ..., :width, :], kept[1][was, ..., :width, :])
            assert torch.equal(cache.src_bias[row], kept[2][was])
            length = cache.lengths[row]
            assert torch.equal(cache.self_kv[row, ..., :length, :], kept[0][was, ..., :length, :])


def test_native_row_copies_write_what_row_by_row_copies_write(
    make_model: MakeModel, row_kernels: model_cache.RowKernels
) -> None:
    """Two caches through the same random joins, steps, prefix exchanges (chains, swaps, longer
    cycles, a row copied into several) and removals, one copying rows in C, the other row by row
    from Python: after every operation each row's written keys/values are the same bytes."""
    model = make_model(seed=11)
    cfg = model.cfg
    rng = torch.Generator().manual_seed(3)

    def draw(n: int) -> int:
        return int(torch.randint(n, (1,), generator=rng))

    native, python = (new_cache(model, 16, positions=24) for _ in range(2))
    native.kernels, python.kernels = row_kernels, None
    shape = (*native.self_kv.shape[1:4], native.self_kv.size(5))
    for _ in range(300):
        rows = native.rows
        kind = draw(4) if rows else 3
        if kind == 0 and python.max_length < 24:
            new_kv = torch.randn(rows, *shape, generator=rng)
            native.advance(new_kv)
            python.advance(new_kv)
        elif kind == 1 and python.max_length:
            dst = torch.randperm(rows, generator=rng)[: 1 + draw(rows)].tolist()
            src = [draw(rows) for _ in dst]
            native.take_prefixes(dst, src)
            python.take_prefixes(dst, src)
        elif kind == 2:
            leaving = torch.randperm(rows, generator=rng)[: 1 + draw(rows)].tolist()
            assert native.remove(leaving) == python.remove(leaving)
        elif kind == 3 and rows < 14:
            k, s = 1 + draw(2), 1 + draw(6)
            kv = torch.randn(k, cfg.decoder_layers, *shape[1:3], s, shape[3], generator=rng)
            mask = torch.ones(k, s, dtype=torch.bool)
            native.append(kv, mask)
            python.append(kv, mask)
        assert native.rows == python.rows and torch.equal(native.lengths, python.lengths)
        for row, n in enumerate(native.lengths[: native.rows].tolist()):
            assert torch.equal(native.self_kv[row, ..., :n, :], python.self_kv[row, ..., :n, :])


def test_without_a_compiler_caches_copy_rows_from_python_and_say_why(tmp_path: Path) -> None:
    """The row copies' library cannot be built (no C++ compiler): ``ensure`` says so once, nothing
    half-built is left, and the caches a runner makes copy from Python, decoding as before."""
    script = f"""
import sys, logging, torch
sys.path.insert(0, {str(Path(__file__).parent.parent)!r})
logging.basicConfig(level=logging.WARNING)
from pathlib import Path
from model.config import ModelConfig
from model.runtime import kvrows, runners
from model.transformer import Transformer
print(kvrows.ensure(Path({str(tmp_path)!r})), kvrows.kernels())
model = Transformer(ModelConfig(vocab_size=32, d_model=16, n_heads=2, encoder_layers=1, decoder_layers=1,
                                d_ff=32, max_positions=16)).eval()
cache = runners.new_cache(model, capacity=2, positions=8)
cache.append(torch.randn(2, 1, 2, 2, 3, 8), torch.ones(2, 3, dtype=torch.bool))
cache.advance(torch.randn(2, 1, 2, 2, 8))
cache.take_prefixes([0, 1], [1, 0])
print(cache.kernels, cache.lengths.tolist())
"""
    out = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "CXX": "/bin/false"},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.split() == ["False", "None", "None", "[1,", "1]"], out.stdout + out.stderr
    assert "the cache's row-copy library is not available" in out.stderr
    assert out.stderr.count("not available") == 1
    assert not list(tmp_path.glob("*.so")) and not list(tmp_path.glob("*.o"))


@pytest.mark.parametrize("way", COPIES)
def test_the_beams_of_an_input_read_its_one_source_until_its_last_row_leaves(
    monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest, make_model: MakeModel, way: str
) -> None:
    """Inputs of 3, 1 and 2 beams hold one source each (``cross_kv`` has three slots), every row
    reading its input's: the logits are those of a cache holding a copy of the source per row (the
    reference), step by step, bit for bit; when the first input's rows leave, its slot is freed and
    the last slot moves into it, the rows reading it following, and decoding goes on unchanged."""
    made = copying(monkeypatch, request, way)
    model = make_model(seed=9)
    beams = [3, 1, 2]
    tokens = targets(6, 7, seed=4)
    with torch.inference_mode():
        enc = model.encode(sources([5, 9, 4], seed=3))
        kv = model.source_kv(enc)
        shared, copies = made(new_cache(model, 8)), made(new_cache(model, 8))
        shared.append(kv, enc.src_mask, beams)
        rows = torch.tensor([0, 0, 0, 1, 2, 2])
        copies.append(kv[rows], enc.src_mask[rows])
        positions, _, cross_kv, src_bias, slots = shared.views()
        assert cross_kv.size(0) == src_bias.size(0) == 3 and len(positions) == 6
        assert slots.tolist() == [0, 0, 0, 1, 2, 2] and shared.source_lengths == [5, 9, 4]
        for t in range(3):
            assert torch.equal(step(model, shared, tokens[:, t]), step(model, copies, tokens[:, t]))
        width = shared.source_lengths[2]
        last = shared.cross_kv[2, ..., :width, :].clone()
        assert shared.remove([0, 1, 2]) == copies.remove([0, 1, 2]) == {3: 0, 4: 1, 5: 2}
        assert shared.views()[4].tolist() == [1, 0, 0] and shared.source_lengths == [4, 9]
        assert torch.equal(shared.cross_kv[0, ..., :width, :], last)  # the last slot moved
        assert shared.width == copies.width == 9
        for t in range(3, 7):
            assert torch.equal(step(model, shared, tokens[3:, t]), step(model, copies, tokens[3:, t]))
        shared.remove([0])
        assert shared.views()[4].tolist() == [0, 0] and shared.source_lengths == [4]
        with pytest.raises(ValueError, match="capacity"):
            shared.append(kv, enc.src_mask, [2, 2, 3])  # 7 rows more beside 2, in 8


@pytest.mark.parametrize("pre_norm", [False, True], ids=["post-ln", "pre-ln"])
def test_padding_does_not_change_real_positions(make_model: MakeModel, pre_norm: bool) -> None:
    model = make_model(seed=4, pre_norm=pre_norm)
    batch = sources([4, 9])
    alone = batch[:1, :4]  # the same sentence without padding
    tgt = targets(1, 6)
    with torch.inference_mode():
        enc_alone = model.encode(alone)
        enc_batch = model.encode(batch)
        assert enc_batch.src_mask[0].tolist() == [True] * 4 + [False] * 5
        assert max_diff(enc_batch.memory[0, :4], enc_alone.memory[0]) <= 1e-5
        # ...and the decoder's cross-attention ignores the padded positions.
        logits_alone = model.decode(tgt, enc_alone)[0]
        logits_batch = model.decode(tgt.expand(2, -1), enc_batch)[0]
    assert max_diff(logits_batch, logits_alone) <= TOL


@pytest.mark.parametrize("pre_norm", [False, True], ids=["post-ln", "pre-ln"])
def test_packed_encoder_computes_what_the_padded_one_does(
    make_model: MakeModel, pre_norm: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = make_model(seed=5, pre_norm=pre_norm)
    src = sources([3, 11, 6, 1])  # 21 real tokens of 44 positions
    with torch.inference_mode():
        monkeypatch.setattr(transformer, "PACK_PADDING", 1.0)  # never pack
        padded = model.encode(src)
        padded_kv = model.source_kv(padded)
        monkeypatch.setattr(transformer, "PACK_PADDING", 0.1)  # the default: pack here
        packed = model.encode(src)
        packed_kv = model.source_kv(packed)
    assert padded.packing is None and packed.packing is not None
    assert packed.packed is not None and packed.packed.shape == (1, 21, model.cfg.d_model)
    real = src != PAD_ID
    assert max_diff(packed.memory[real], padded.memory[real]) <= 1e-5
    assert not packed.memory[~real].any()  # padding: zeros
    cfg = model.cfg
    assert packed_kv.shape == padded_kv.shape == (4, cfg.decoder_layers, 2, cfg.n_heads, 11, cfg.head_dim)
    cross_real = real[:, None, None, None, :, None].expand_as(packed_kv)
    assert max_diff(packed_kv[cross_real], padded_kv[cross_real]) <= 1e-5
    with torch.inference_mode():  # and decoding from either gives the same logits
        logits = []
        for enc, kv in ((packed, packed_kv), (padded, padded_kv)):
            cache = new_cache(model, 4)
            cache.append(kv, enc.src_mask)
            logits.append(step(model, cache, torch.full((4,), BOS_ID)))
    assert max_diff(logits[0], logits[1]) <= TOL


def test_eval_mode_is_deterministic_and_train_mode_is_not(make_model: MakeModel) -> None:
    """Guards the tests above: they run in eval mode, where dropout (0.1 in tiny_config) is off."""
    model = make_model(seed=6)
    src, tgt = sources([5, 3]), targets(2, 4)
    with torch.no_grad():
        assert torch.equal(model(src, tgt), model(src, tgt))
        model.train()
        assert not torch.equal(model(src, tgt), model(src, tgt))


@pytest.mark.parametrize("pre_norm", [False, True], ids=["post-ln", "pre-ln"])
def test_add_norm_places_the_layer_norm(pre_norm: bool) -> None:
    """Post-LN: LayerNorm(x + sublayer(x)) (the paper); pre-LN: x + sublayer(LayerNorm(x)).

    The cache tests compare two code paths through the same blocks, so they cannot see a wrong
    formula here; this pins it down."""
    from model.config import ModelConfig
    from model.layers import AddNorm

    cfg = ModelConfig(vocab_size=8, d_model=8, n_heads=2, pre_norm=pre_norm, dropout=0.0)
    block = AddNorm(cfg).eval()
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8) * 3 + 1
    weight = torch.randn(8, 8)

    def sublayer(y: Tensor) -> Tensor:
        return y @ weight

    ln = torch.nn.functional.layer_norm
    with torch.no_grad():
        got = block(x, sublayer)
        expected = (
            x + sublayer(ln(x, (8,), eps=cfg.layer_norm_eps)) if pre_norm else ln(x + sublayer(x), (8,))
        )
    assert max_diff(got, expected) <= 1e-5


def test_strip_dropout_changes_no_output(make_model: MakeModel) -> None:
    """Inference models lose their Dropout modules (``Translator.load`` does it): the eval model's
    outputs must not change, and no Dropout may be left anywhere in the tree."""
    src, tgt = sources([5, 7]), targets(2, 6)
    with torch.inference_mode():
        model = make_model(seed=6)
        before = model.decode(tgt, model.encode(src))
        assert any(isinstance(m, torch.nn.Dropout) for m in model.modules())
        stripped = transformer.strip_dropout(model)
        assert not any(isinstance(m, torch.nn.Dropout) for m in stripped.modules())
        assert torch.equal(stripped.decode(tgt, stripped.encode(src)), before)


def test_positions_layouts_are_the_papers_formula_interleaved_or_in_halves() -> None:
    from model.layers import sinusoids

    p, d = 7, 8
    pos, i = torch.arange(p, dtype=torch.float64)[:, None], torch.arange(d // 2, dtype=torch.float64)
    angle = pos / 10000 ** (2 * i / d)  # (P, D/2): PE(pos, 2i) = sin, PE(pos, 2i+1) = cos
    inter = torch.zeros(p, d, dtype=torch.float64)
    inter[:, 0::2], inter[:, 1::2] = torch.sin(angle), torch.cos(angle)
    torch.testing.assert_close(sinusoids(p, d).double(), inter, atol=1e-6, rtol=0)
    halves = torch.cat([torch.sin(angle), torch.cos(angle)], dim=1)
    torch.testing.assert_close(sinusoids(p, d, halves=True).double(), halves, atol=1e-6, rtol=0)


def test_a_config_written_with_tie_embeddings_reads_as_shared_and_tied() -> None:
    from model.config import ModelConfig

    untied = ModelConfig.from_dict({"vocab_size": 64, "d_model": 32, "n_heads": 4, "tie_embeddings": False})
    assert (untied.share_embeddings, untied.tie_output) == (False, False)
    assert ModelConfig.from_dict({"vocab_size": 64, "d_model": 32, "n_heads": 4}).tie_output


def test_learned_positions_and_output_bias_are_weights_and_sinusoids_are_not() -> None:
    from tests.conftest import tiny_config

    learned = Transformer(tiny_config(positions="learned", output_bias=True)).state_dict()
    assert learned["positions.table"].shape == (128, 32) and learned["output_bias"].shape == (64,)
    assert "positions.table" not in Transformer(tiny_config(positions="sinusoidal_halves")).state_dict()


def test_a_row_first_used_late_reads_zeros_not_what_its_memory_held(make_model: MakeModel) -> None:
    """Rows are zeroed when first used (a big cache costs the rows its batches reach): a row that
    joins after others decoded must see finite zeros in the positions they made readable, whatever
    its memory held before (NaN here)."""
    model = make_model(seed=3)
    with torch.inference_mode():
        cache = new_cache(model, 4)
        for buffer in (cache.self_kv, cache.cross_kv):
            buffer.fill_(float("nan"))  # what fresh memory may hold
        join(model, cache, sources([3]))
        for _ in range(5):
            step(model, cache, torch.full((1,), BOS_ID))
        assert torch.isnan(cache.self_kv[1:, :, :, :, :5]).all()  # rows not used yet: untouched
        join(model, cache, sources([7, 2]))  # rows 1 and 2, after five decoded positions
        _, self_kv, cross_kv, _, _ = cache.views()
        assert not torch.isnan(self_kv).any() and not torch.isnan(cross_kv).any()
        logits = step(model, cache, torch.full((3,), BOS_ID))
        assert torch.isfinite(logits).all()
