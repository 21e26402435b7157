"""The CUDA-graph runner (``model.runtime.graphs``) without a GPU: its buckets, its pooled caches and
static buffers, and that padding rows and positions change nothing, checked with the same runner
run eagerly over the same buckets and buffers (``capture=False``) against the plain eager step.
The capture itself runs where there is a GPU (tests/test_devices.py, BENCHMARKS.md "On a GPU")."""

from __future__ import annotations

import gc
import random

import pytest
import torch
from conftest import random_model
from torch import Tensor

from model.decoding.batch import decode
from model.decoding.options import DecodeOptions
from model.decoding.search import Hypothesis
from model.runtime.graphs import GraphRunner, bucket, row_buckets, width_buckets
from model.runtime.runners import EagerRunner
from model.runtime.step import DecodeStep
from model.transformer import Transformer

TOP = 10
CAPACITY = 12  # row buckets 1, 2, 4, 8, 12: a batch's rows rarely fill one


def test_row_buckets_double_up_to_the_capacity_and_include_it() -> None:
    assert row_buckets(1) == [1]
    assert row_buckets(12) == [1, 2, 4, 8, 12]
    assert row_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert bucket(5, row_buckets(12)) == 8 and bucket(9, row_buckets(12)) == 12


def test_width_buckets_are_whole_key_blocks_that_hold_every_view() -> None:
    assert width_buckets(1) == [16]
    assert width_buckets(40) == [32, 48]
    assert width_buckets(256) == [32, 64, 128, 256]
    assert width_buckets(300) == [32, 64, 128, 256, 304]
    assert all(b % 16 == 0 for b in width_buckets(500))


class Recording(DecodeStep):
    """The step, recording the rows and widths it was called with."""

    def __init__(self, model: Transformer) -> None:
        super().__init__(model, top=TOP)
        self.shapes: list[tuple[int, int, int]] = []

    def forward(self, *args: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        self.shapes.append((args[0].size(0), args[2].size(4), args[3].size(4)))
        return super().forward(*args)


def sources(n: int, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(rng.randrange(1, 30))] + [3] for _ in range(n)]


def decoded(
    runner: EagerRunner | GraphRunner, model: Transformer, srcs: list[list[int]], beam: int
) -> list[list[Hypothesis]]:
    options = DecodeOptions(beam_size=beam, n_best=min(beam, 2), max_output_tokens=40)
    with torch.inference_mode():
        return decode(model, runner, srcs, options, capacity=CAPACITY, positions=64)


@pytest.mark.parametrize("beam", [1, 3])
def test_padded_rows_and_positions_decode_exactly_as_the_eager_step(beam: int) -> None:
    """Sources of many lengths join and leave a batch of 12 rows (buckets 1, 2, 4, 8, 12; widths 32,
    64): every hypothesis is the plain eager step's, and the bucketed step saw bucket shapes only
    (so the padding ran). Tokens are equal; scores to float rounding: the CPU's matrix products
    round a row differently for some row counts (3 rows against 4), padding or not."""
    model = random_model(3, sharpen=4.0, eos_boost=1.5)
    srcs = sources(23, seed=beam, vocab=model.cfg.vocab_size)
    expected = decoded(EagerRunner(DecodeStep(model, top=TOP)), model, srcs, beam)
    step = Recording(model).eval()
    runner = GraphRunner(step, capture=False)
    got = decoded(runner, model, srcs, beam)
    assert [[h.tokens for h in n_best] for n_best in got] == [[h.tokens for h in n] for n in expected]
    for n_best, want in zip(got, expected, strict=True):
        assert [h.score for h in n_best] == pytest.approx([h.score for h in want], rel=1e-5)
    assert step.shapes and {rows for rows, _, _ in step.shapes} <= set(row_buckets(CAPACITY))
    assert {w for _, keys, src in step.shapes for w in (keys, src)} <= set(width_buckets(64))
    assert any(rows > 1 for rows, _, _ in step.shapes)


def test_a_cache_given_back_is_handed_out_again_and_decodes_the_same() -> None:
    """A batch's cache returns to the pool when the batch is gone, stale rows and all; the next
    batch gets the same buffers (the graphs captured for them) and the same answers."""
    model = random_model(5, sharpen=4.0, eos_boost=1.5)
    runner = GraphRunner(DecodeStep(model, top=TOP).eval(), capture=False)
    srcs = sources(9, seed=7, vocab=model.cfg.vocab_size)
    first = decoded(runner, model, srcs, 2)
    gc.collect()
    held = runner.new_cache(capacity=CAPACITY, positions=64)
    other = runner.new_cache(capacity=CAPACITY, positions=64)
    assert len(runner._pools) == 2  # the one decode used, then one more while it is held
    assert held.self_kv.data_ptr() != other.self_kv.data_ptr()
    del held, other
    gc.collect()
    assert decoded(runner, model, srcs[::-1], 2) == first[::-1]
    assert len(runner._pools) == 2  # nothing new made


def test_padding_rows_that_ended_at_the_last_position_do_not_break_the_step() -> None:
    """Rows that left at the cache's last position keep that length in the buffer; as padding rows
    of a later, smaller batch their position must not index past the embedding table."""
    model = random_model(2, sharpen=4.0, eos_boost=0.0, max_positions=24)  # eos never wins: full length
    runner = GraphRunner(DecodeStep(model, top=TOP).eval(), capture=False)
    options = DecodeOptions(beam_size=1, max_output_tokens=24, max_length_a=0.0, max_length_b=24)
    srcs = sources(4, seed=1, vocab=model.cfg.vocab_size)
    with torch.inference_mode():
        long = decode(model, runner, srcs, options, capacity=4, positions=24)  # rows 0-3 end at 24
        assert all(len(h[0].tokens) == 23 for h in long)
        gc.collect()
        again = decode(model, runner, srcs[:3], options.but(max_length_b=5), capacity=4, positions=24)
    assert len(runner._pools) == 1  # the same buffers: row 3 pads the 3 rows' bucket of 4
    assert [h[0].tokens for h in again] == [h[0].tokens[:4] for h in long[:3]]


def test_stale_beam_rows_of_a_larger_call_do_not_reach_a_smaller_one() -> None:
    """The static beam rows past this call's are reset: a larger call's row 7 would index past a
    bucket of 4 rows."""
    model = random_model(4)
    runner = GraphRunner(DecodeStep(model, top=TOP).eval(), capture=False)
    cache = runner.new_cache(capacity=8, positions=32)
    src = torch.tensor([[5, 6, 7, 3]] * 8)
    enc = model.encode(src)
    cache.append(model.source_kv(enc), enc.src_mask)
    tokens = torch.full((8,), model.cfg.bos_id)
    with torch.inference_mode():
        runner(tokens, *cache.views(), torch.full((8,), 7), torch.zeros((8, 2), dtype=torch.long))
        cache.remove(list(range(3, 8)))
        out = runner(tokens[:3], *cache.views(), torch.tensor([2]), torch.zeros((1, 2), dtype=torch.long))
    assert out[1].shape == (1, TOP) and out[0].shape == (3,)


def test_a_cache_the_runner_did_not_make_and_a_wider_forced_run_eagerly() -> None:
    model = random_model(1)
    step = Recording(model).eval()
    runner = GraphRunner(step, capture=False)
    eager = EagerRunner(DecodeStep(model, top=TOP).eval())
    cache = eager.new_cache(capacity=4, positions=32)  # not pooled
    src = torch.tensor([[5, 6, 7, 3]])
    enc = model.encode(src)
    cache.append(model.source_kv(enc), enc.src_mask)
    with torch.inference_mode():
        args = (torch.tensor([model.cfg.bos_id]), *cache.views(), torch.zeros(1, dtype=torch.long))
        for width in (2, 3):
            forced = torch.full((1, width), 9)
            got, want = runner(*args, forced), eager(*args, forced)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert step.shapes == [(1, 16, 16), (1, 16, 16)]  # as handed: no bucket


def test_runner_kind_says_whether_graphs_are_replayed() -> None:
    model = random_model(0)
    assert GraphRunner(DecodeStep(model, top=TOP), capture=False).kind == "eager"
