"""The decoding step compiled ahead of time (``model.compiled_step``): the same choices as the step
run eagerly, a row's results independent of its neighbours, and the package kept on disk and
loaded, not recompiled, by the next process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import compile_cache_dir

from model.compiled_step import CompiledDecoder
from model.static_slots import StaticSlots, StepChoice
from model.translator import Translator

CAPACITY, TOP = 64, 16  # as tests/test_executor.py compiles it: one package for both


@pytest.fixture(scope="module")
def decoders(translator: Translator) -> tuple[CompiledDecoder, CompiledDecoder]:
    """The tiny model's step compiled, and run eagerly."""
    compiled = CompiledDecoder(translator.model, top=TOP, cache_dir=compile_cache_dir())
    compiled.warm_up(CAPACITY)
    eager = CompiledDecoder(translator.model, top=TOP, compile=False)
    eager.warm_up(CAPACITY)
    return compiled, eager


def decode(
    decoder: CompiledDecoder,
    translator: Translator,
    sources: list[list[int]],
    steps: int,
    beam_rows: list[int],
) -> list[StepChoice]:
    model = translator.model
    slots = StaticSlots(model, decoder.capacity)
    slots.append(model.start_cache(model.encode(translator.batch(sources)), capacity=1))
    tokens = torch.full((len(sources),), model.cfg.bos_id, dtype=torch.long)
    out = []
    for _ in range(steps):
        step = slots.decode(decoder, tokens, torch.tensor(beam_rows))
        out.append(step)
        tokens = step.choice
    return out


def source_ids(translator: Translator, n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    vocab = translator.model.cfg.vocab_size
    lengths = torch.randint(1, 40, (n,), generator=g).tolist()
    return [
        torch.randint(4, vocab, (k,), generator=g).tolist() + [translator.model.cfg.eos_id] for k in lengths
    ]


@torch.inference_mode()
def test_the_compiled_step_chooses_as_the_eager_one(
    decoders: tuple[CompiledDecoder, CompiledDecoder], translator: Translator
) -> None:
    """Every batch size the graph serves (one row, a few, the capacity), mixed greedy and beam rows:
    the same argmax and best candidates as ``StaticStep`` run eagerly, log-probs to float rounding."""
    compiled, eager = decoders
    for rows, beam_rows in ((1, [0]), (3, [0, 2]), (CAPACITY, list(range(10, 30)))):
        sources = source_ids(translator, rows, seed=rows)
        got = decode(compiled, translator, sources, 12, beam_rows)
        want = decode(eager, translator, sources, 12, beam_rows)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g.choice, w.choice)
            assert torch.equal(g.top_tokens, w.top_tokens)
            torch.testing.assert_close(g.top_lprobs, w.top_lprobs, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(g.eos_lprob, w.eos_lprob, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_a_rows_compiled_results_do_not_depend_on_its_neighbours(
    decoders: tuple[CompiledDecoder, CompiledDecoder], translator: Translator
) -> None:
    """Bit for bit: a row decoded alone, and beside rows with longer sources and longer histories
    (so the step reads more cached and source positions than the row has), in any place."""
    compiled, _ = decoders
    model = translator.model
    mine = source_ids(translator, 1, seed=11)[0][:6] + [model.cfg.eos_id]
    others = source_ids(translator, 5, seed=12)
    alone = decode(compiled, translator, [mine], 8, [0])

    slots = StaticSlots(model, CAPACITY)
    slots.append(model.start_cache(model.encode(translator.batch(others)), capacity=1))
    tokens = torch.full((len(others),), model.cfg.bos_id, dtype=torch.long)
    for _ in range(9):  # the neighbours have decoded 9 tokens before ours joins
        tokens = slots.decode(compiled, tokens, torch.tensor([0])).choice
    slots.append(model.start_cache(model.encode(translator.batch([mine])), capacity=1))
    row = slots.rows - 1
    tokens = torch.cat([tokens, torch.tensor([model.cfg.bos_id])])
    for t, expected in enumerate(alone):
        step = slots.decode(compiled, tokens, torch.tensor([1, row]))
        assert int(step.choice[row]) == int(expected.choice[0]), t
        assert torch.equal(step.top_lprobs[1], expected.top_lprobs[0]), t  # bit for bit
        assert torch.equal(step.eos_lprob[1], expected.eos_lprob[0]), t
        tokens = step.choice


def test_the_package_is_kept_and_loaded_by_the_next_process(
    decoders: tuple[CompiledDecoder, CompiledDecoder], model_dir: Path
) -> None:
    """A new process with the same model and settings finds the package and loads it (no compiling)."""
    compiled, _ = decoders
    assert list(compile_cache_dir().glob(f"step-{compiled.key(CAPACITY)}.pt2"))
    code = (
        "import sys, torch; torch.set_num_threads(1)\n"
        "from pathlib import Path\n"
        "from model.compiled_step import CompiledDecoder\n"
        "from model.translator import Translator\n"
        f"t = Translator.load({str(model_dir)!r}, device='cpu')\n"
        f"d = CompiledDecoder(t.model, top={TOP}, cache_dir=Path({str(compile_cache_dir())!r}))\n"
        f"seconds = d.warm_up({CAPACITY})\n"
        "print(d.cached, seconds)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    cached, seconds = out.stdout.split()
    assert cached == "True" and float(seconds) < 20


def test_the_package_name_changes_with_what_the_graph_depends_on(translator: Translator) -> None:
    decoder = CompiledDecoder(translator.model, top=TOP)
    key = decoder.key(CAPACITY)
    assert decoder.key(CAPACITY) == key  # stable
    assert decoder.key(CAPACITY * 2) != key
    assert CompiledDecoder(translator.model, top=TOP + 2).key(CAPACITY) != key
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert decoder.key(CAPACITY) != key  # the kernels' parallel loops are sized when compiled
    finally:
        torch.set_num_threads(threads)
    with torch.no_grad():
        weight = translator.model.embed.weight
        weight[5, 0] += 1.0
        try:
            assert decoder.key(CAPACITY) != key
        finally:
            weight[5, 0] -= 1.0


@torch.inference_mode()
def test_garbage_in_never_written_buffer_memory_reaches_no_result(translator: Translator) -> None:
    """The buffers are allocated, not zeroed (memory is taken only for the positions used): NaN
    wherever nothing was written yet changes nothing, and zeroing positions as the rows reach them
    loses nothing written, rows of different lengths and joins included."""
    model = translator.model
    eager = CompiledDecoder(model, top=TOP, compile=False)
    eager.warm_up(CAPACITY)
    # Short sources and a long decoding: the cached positions outgrow the source ones.
    first = [ids[:4] + [model.cfg.eos_id] for ids in source_ids(translator, 3, seed=4)]
    later = [ids[:7] + [model.cfg.eos_id] for ids in source_ids(translator, 2, seed=5)]

    def run(poison: bool) -> list[torch.Tensor]:
        slots = StaticSlots(model, CAPACITY)
        if poison:  # garbage wherever nothing was written
            slots.self_kv.fill_(float("nan"))
            slots.cross_kv.fill_(float("nan"))
        else:  # the reference: every position zeroed from the start, none left to zero later
            slots.self_kv.zero_()
            slots.cross_kv.zero_()
            slots._clean = slots.self_kv.size(4)
        slots.append(model.start_cache(model.encode(translator.batch(first)), capacity=1))
        tokens = torch.full((3,), model.cfg.bos_id, dtype=torch.long)
        out = []
        for t in range(40):
            if t == 5:  # newcomers with other source lengths join mid-way
                slots.append(model.start_cache(model.encode(translator.batch(later)), capacity=1))
                tokens = torch.cat([tokens, torch.full((2,), model.cfg.bos_id, dtype=torch.long)])
            step = slots.decode(eager, tokens, torch.arange(slots.rows))
            out.append(step.top_lprobs)
            tokens = step.choice
        return out

    for clean, poisoned in zip(run(False), run(True), strict=True):
        assert torch.isfinite(poisoned).all()
        assert torch.equal(clean, poisoned)
