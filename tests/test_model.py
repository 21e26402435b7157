"""The Transformer's incremental decoder and its KV cache against the whole-prefix reference.

``decode`` (teacher forcing over the whole prefix, as in training) is the definition of the model;
``start_cache`` + ``decode_step`` must compute the same next-token logits one token at a time,
whatever the batch does around a row: padding, growth of the cache, reordering, dropping and
duplicating rows (beam search), and rows at different lengths (continuous batching).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from model import transformer
from model.cache import CacheSlots
from model.layers import KEY_ALIGN
from model.tokenizer import BOS_ID, EOS_ID, PAD_ID
from model.transformer import Transformer

TOL = 1e-4  # float32; observed differences are ~1e-6
VOCAB = 64  # tiny_config's vocab_size

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


@pytest.mark.parametrize("capacity", [32, 1], ids=["preallocated", "growing"])
@pytest.mark.parametrize("pre_norm", [False, True], ids=["post-ln", "pre-ln"])
def test_cached_decoding_matches_full_decode(make_model: MakeModel, pre_norm: bool, capacity: int) -> None:
    model = make_model(seed=0, pre_norm=pre_norm)
    src = sources([7, 3, 5])  # padded batch: rows of different source lengths
    tgt = targets(3, 9)
    with torch.inference_mode():
        enc = model.encode(src)
        full = model.decode(tgt, enc)  # (B, T, V)
        cache = model.start_cache(enc, capacity=capacity)
        for t in range(tgt.size(1)):
            logits, cache = model.decode_step(tgt[:, t], cache)
            assert max_diff(logits, full[:, t]) <= TOL, f"step {t}"
    assert cache.lengths.tolist() == [9, 9, 9] and cache.max_length == 9 and cache.uniform
    assert cache.capacity >= 9


@pytest.mark.parametrize("tie_embeddings", [True, False], ids=["tied", "untied"])
def test_cached_decoding_matches_full_decode_untied(make_model: MakeModel, tie_embeddings: bool) -> None:
    model = make_model(seed=5, tie_embeddings=tie_embeddings, pre_norm=True)
    src, tgt = sources([4, 6]), targets(2, 6)
    with torch.inference_mode():
        enc = model.encode(src)
        full = model.decode(tgt, enc)
        cache = model.start_cache(enc, capacity=2)
        steps = [model.decode_step(tgt[:, t], cache)[0] for t in range(tgt.size(1))]
    assert max_diff(torch.stack(steps, dim=1), full) <= TOL


@pytest.mark.parametrize("steps_a, steps_b", [(4, 1), (0, 3), (2, 2)])
@pytest.mark.parametrize("pre_norm", [False, True], ids=["post-ln", "pre-ln"])
def test_slots_join_rows_at_different_lengths(
    make_model: MakeModel, pre_norm: bool, steps_a: int, steps_b: int
) -> None:
    """Continuous batching: a row that has decoded more steps is joined by one that has decoded fewer
    (or none: a new arrival); each row must go on exactly as if it were decoded alone."""
    model = make_model(seed=2, pre_norm=pre_norm)
    src_a, src_b = sources([4], seed=3), sources([9], seed=4)  # different source lengths too
    tgt_a, tgt_b = targets(1, 10, seed=5), targets(1, 10, seed=6)
    with torch.inference_mode():
        enc_a, enc_b = model.encode(src_a), model.encode(src_b)
        full_a, full_b = model.decode(tgt_a, enc_a)[0], model.decode(tgt_b, enc_b)[0]  # (T, V)
        cache_a = model.start_cache(enc_a, capacity=8)
        for t in range(steps_a):
            model.decode_step(tgt_a[:, t], cache_a)
        cache_b = model.start_cache(enc_b, capacity=1)  # smaller: decoding grows it
        for t in range(steps_b):
            model.decode_step(tgt_b[:, t], cache_b)

        slots = CacheSlots()
        slots.append(cache_a)
        slots.append(cache_b)
        assert slots.rows == 2
        assert slots.uniform == (steps_a == steps_b)
        assert slots.lengths is not None and slots.lengths.tolist() == [steps_a, steps_b]
        assert slots.max_length == max(steps_a, steps_b)
        pos = [steps_a, steps_b]
        for _ in range(4):
            tokens = torch.stack([tgt_a[0, pos[0]], tgt_b[0, pos[1]]])
            logits, cache = model.decode_step(tokens, slots.view())
            slots.advance(cache)
            assert max_diff(logits[0], full_a[pos[0]]) <= TOL, f"row a at position {pos[0]}"
            assert max_diff(logits[1], full_b[pos[1]]) <= TOL, f"row b at position {pos[1]}"
            pos = [pos[0] + 1, pos[1] + 1]
        assert slots.lengths.tolist() == pos

        # Row a finishes and leaves: row b moves into its place and goes on alone, however far
        # behind it was.
        assert slots.remove([0]) == {1: 0}
        assert slots.max_length == pos[1]
        for _ in range(2):
            logits, cache = model.decode_step(tgt_b[:, pos[1]], slots.view())
            slots.advance(cache)
            assert max_diff(logits[0], full_b[pos[1]]) <= TOL, f"row b alone at position {pos[1]}"
            pos[1] += 1


def test_index_select_reorders_drops_and_duplicates_rows(make_model: MakeModel) -> None:
    """What beam search does every step: rows in a new order, some dropped, some copied; copies
    then diverge and must not write into each other's cache."""
    model = make_model(seed=3, pre_norm=True)
    src = sources([5, 3, 8])  # row 2 is the longest, so it is unpadded
    tgt = targets(3, 8)
    alt = tgt[2].clone()
    alt[3:] = torch.tensor([5, 6, 7, 8, 9])  # row 2 with a different continuation after 3 steps
    with torch.inference_mode():
        enc = model.encode(src)
        full = model.decode(tgt, enc)
        full_alt = model.decode(alt[None], model.encode(src[2:3]))[0]
        cache = model.start_cache(enc)
        for t in range(3):
            model.decode_step(tgt[:, t], cache)

        index = torch.tensor([2, 0, 2])  # reorder, drop row 1, duplicate row 2
        cache = cache.index_select(index)
        assert cache.batch_size == 3 and cache.lengths.tolist() == [3, 3, 3]
        expected = [full[2], full[0], full_alt]
        inputs = torch.stack([tgt[2], tgt[0], alt])
        for t in range(3, 8):
            logits, cache = model.decode_step(inputs[:, t], cache)
            for row in range(3):
                assert max_diff(logits[row], expected[row][t]) <= TOL, f"row {row}, step {t}"
    # The copies really diverged: otherwise the test above would not check independence.
    assert max_diff(full[2, 4:], full_alt[4:]) > 1e-2


def test_index_select_same_sources_keeps_the_source_side(make_model: MakeModel) -> None:
    """Beams of one sentence reordered among themselves: the cross-attention K/V are not copied
    and decoding goes on exactly as with a full copy."""
    model = make_model(seed=4)
    src = sources([6, 4]).repeat_interleave(2, dim=0)  # two sentences x two beams
    tgt = targets(4, 6)
    with torch.inference_mode():
        cache = model.start_cache(model.encode(src))
        for t in range(2):
            model.decode_step(tgt[:, t], cache)
        index = torch.tensor([1, 1, 3, 2])  # beams move only within their sentence
        same = cache.index_select(index, same_sources=True)
        copied = cache.index_select(index)
        assert same.cross_kv is cache.cross_kv and same.src_mask is cache.src_mask
        for t in range(2, 6):
            a, same = model.decode_step(tgt[index, t], same)
            b, copied = model.decode_step(tgt[index, t], copied)
            assert max_diff(a, b) == 0.0


def test_index_select_cuts_source_padding_nobody_needs(make_model: MakeModel) -> None:
    """When the longest source leaves, the others' cross-attention K/V lose the padding it forced
    on them (down to a whole multiple of KEY_ALIGN positions), and decoding goes on unchanged."""
    model = make_model(seed=5)
    src = sources([4, 40, 20])
    tgt = targets(3, 6)
    with torch.inference_mode():
        enc = model.encode(src)
        full = model.decode(tgt, enc)
        cache = model.start_cache(enc)
        for t in range(2):
            model.decode_step(tgt[:, t], cache)
        assert cache.cross_kv.size(4) == 40
        kept = cache.index_select(torch.tensor([1, 2]))  # the longest stays: nothing to cut
        assert kept.cross_kv.size(4) == 40 and kept.src_mask.size(1) == 40
        cache = cache.index_select(torch.tensor([2, 0]))  # the longest leaves
        assert KEY_ALIGN == 16 and cache.cross_kv.size(4) == 32 and cache.src_mask.shape == (2, 32)
        for t in range(2, 6):
            logits, cache = model.decode_step(tgt[[2, 0], t], cache)
            assert max_diff(logits[0], full[2, t]) <= TOL and max_diff(logits[1], full[0, t]) <= TOL


def test_index_select_to_empty_batch(make_model: MakeModel) -> None:
    model = make_model(seed=3)
    with torch.inference_mode():
        cache = model.start_cache(model.encode(sources([3, 4])))
        model.decode_step(torch.full((2,), BOS_ID), cache)
        empty = cache.index_select(torch.tensor([], dtype=torch.long))
    assert empty.batch_size == 0


class SlotsDriver:
    """Drives ``CacheSlots`` with teacher-forced sentences and checks every row's logits against the
    full decode of its own sentence alone."""

    def __init__(self, model: Transformer, lengths: list[int], steps: int = 12) -> None:
        self.model = model
        self.src = sources(lengths, seed=11)
        self.tgt = targets(len(lengths), steps, seed=12)
        self.full = [
            model.decode(self.tgt[i : i + 1], model.encode(self.src[i : i + 1, :n]))[0]
            for i, n in enumerate(lengths)
        ]  # (T, V) per sentence, each decoded alone without padding
        self.lengths = lengths
        self.slots = CacheSlots()
        self.held: list[tuple[int, int]] = []  # per slot row: (sentence, next position)

    def join(self, sentences: list[int], capacity: int = 1) -> None:
        width = max(self.lengths[i] for i in sentences)
        enc = self.model.encode(self.src[sentences, :width])
        self.slots.append(self.model.start_cache(enc, capacity=capacity))
        self.held += [(i, 0) for i in sentences]

    def leave(self, rows: list[int]) -> dict[int, int]:
        moves = self.slots.remove(rows)
        held = list(self.held)
        for old, new in moves.items():
            held[new] = self.held[old]
        self.held = held[: self.slots.rows]
        return moves

    def step(self) -> None:
        tokens = torch.stack([self.tgt[i, t] for i, t in self.held])
        logits, cache = self.model.decode_step(tokens, self.slots.view())
        self.slots.advance(cache)
        for row, (i, t) in enumerate(self.held):
            assert max_diff(logits[row], self.full[i][t]) <= TOL, f"row {row}: sentence {i} at {t}"
        self.held = [(i, t + 1) for i, t in self.held]


def test_slots_rows_join_leave_and_move_as_if_decoded_alone(make_model: MakeModel) -> None:
    """Continuous batching on ``CacheSlots``: rows join at different steps (buffers growing in
    rows, source and decoded positions), leave from the middle (the last rows move into their
    places), and every row decodes exactly what its sentence alone would."""
    with torch.inference_mode():
        run = SlotsDriver(make_model(seed=6), [5, 3, 40, 4, 20])
        run.join([0, 1])
        for _ in range(2):
            run.step()
        run.join([2, 3, 4], capacity=4)  # longer source, more rows, at position 0 beside position 2
        assert not run.slots.uniform and run.slots.view().src_mask.shape == (5, 40)
        for _ in range(2):
            run.step()
        moves = run.leave([0, 2])  # the longest source leaves: nobody needs its width any more
        assert moves == {3: 0, 4: 2}  # the last rows took the freed places; row 1 stayed
        view = run.slots.view()
        # Cut to the longest remaining source (20), aligned: 32 of the buffer's 40 positions.
        assert view.batch_size == 3 and view.src_mask.shape == (3, 32) and view.cross_kv.size(4) == 32
        for _ in range(3):
            run.step()
        run.join([0])  # a place freed earlier is reused: no new memory
        buffer = run.slots.self_kv
        assert buffer is not None
        run.step()
        assert run.slots.self_kv is buffer
        run.leave(list(range(run.slots.rows)))
        assert run.slots.rows == 0 and run.slots.max_length == 0 and run.slots.uniform
        run.join([3, 1])  # an emptied batch starts again
        run.step()


def test_slots_reorder_copies_decoded_prefixes(make_model: MakeModel) -> None:
    """Beam reordering: rows that read each other's prefixes (a swap: each row both read and
    written) and one prefix copied twice."""
    with torch.inference_mode():
        run = SlotsDriver(make_model(seed=7), [6, 6])
        run.src[1] = run.src[0]  # beams of one input: one source, two different prefixes
        run.full[1] = run.model.decode(run.tgt[1:2], run.model.encode(run.src[:1]))[0]
        run.join([0, 1, 0])  # rows 0 and 2 follow prefix 0, row 1 prefix 1
        for _ in range(3):
            run.step()
        run.slots.reorder([1, 0, 1])  # rows 0 and 2 take row 1's prefix, row 1 takes row 0's
        run.held = [run.held[1], run.held[0], run.held[1]]
        for _ in range(3):
            run.step()


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
        padded_cache = model.start_cache(padded)
        monkeypatch.setattr(transformer, "PACK_PADDING", 0.1)  # the default: pack here
        packed = model.encode(src)
        packed_cache = model.start_cache(packed)
    assert padded.packing is None and packed.packing is not None
    assert packed.packed is not None and packed.packed.shape == (1, 21, model.cfg.d_model)
    real = src != PAD_ID
    assert max_diff(packed.memory[real], padded.memory[real]) <= 1e-5
    assert not packed.memory[~real].any()  # padding: zeros
    cross_real = real[None, None, :, None, :, None].expand_as(packed_cache.cross_kv)
    assert max_diff(packed_cache.cross_kv[cross_real], padded_cache.cross_kv[cross_real]) <= 1e-5
    with torch.inference_mode():  # and decoding from either gives the same logits
        tokens = torch.full((4,), BOS_ID)
        a, _ = model.decode_step(tokens, packed_cache)
        b, _ = model.decode_step(tokens, padded_cache)
    assert max_diff(a, b) <= TOL


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
