"""Step runners (``model.runtime.runners``): the compiled step chooses as the eager one, a row's
results do not depend on its neighbours, the package is kept on disk and loaded by the next
process, its name follows what the graph depends on, and a runner that cannot compile falls back
to the eager step."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import compile_cache_dir, needs_cpu_package

from model.cache import KVCache
from model.decoding.options import DecodeOptions
from model.runtime import runners
from model.runtime.runners import EagerRunner, PackagedRunner, Runner, load_runner
from model.runtime.step import DecodeStep, StepChoice
from model.translator import Translator

CAPACITY, TOP = 64, 16  # as the tests' translators and executors compile it: one package for all


def positions(translator: Translator) -> int:
    return DecodeOptions().positions(translator.model.cfg.max_positions)


def runner_of(translator: Translator, *, compile: bool) -> Runner:
    """The step of ``translator``'s model as the tests' translators and executors make it."""
    return load_runner(
        translator.model,
        top=TOP,
        capacity=CAPACITY,
        positions=positions(translator),
        compile=compile,
        cache_dir=compile_cache_dir(),
    )


@pytest.fixture(scope="module")
def compiled(translator: Translator) -> Runner:
    needs_cpu_package()
    runner = runner_of(translator, compile=True)
    assert runner.kind == "compiled"
    return runner


@pytest.fixture(scope="module")
def eager(translator: Translator) -> Runner:
    return runner_of(translator, compile=False)


def new_cache(translator: Translator, align: int = 1) -> KVCache:
    model = translator.model
    return KVCache(
        model.cfg,
        capacity=CAPACITY,
        positions=positions(translator),
        dtype=model.dtype,
        device=model.device,
        align=align,
    )


def join(cache: KVCache, translator: Translator, sources: list[list[int]]) -> None:
    enc = translator.model.encode(translator.batch(sources))
    cache.append(translator.model.source_kv(enc), enc.src_mask)


def step(runner: Runner, cache: KVCache, tokens: torch.Tensor, beam_rows: list[int]) -> StepChoice:
    forced = torch.zeros((len(beam_rows), 2), dtype=torch.long)  # nothing forced: dummy columns
    choice, top_tokens, top_lprobs, eos_lprob, new_kv, _ = runner(
        tokens, *cache.views(), torch.tensor(beam_rows), forced
    )
    cache.advance(new_kv)
    return StepChoice(choice, top_tokens, top_lprobs, eos_lprob)


def decode(
    runner: Runner, translator: Translator, sources: list[list[int]], steps: int, beam_rows: list[int]
) -> list[StepChoice]:
    cache = new_cache(translator, runner.align)
    join(cache, translator, sources)
    tokens = torch.full((len(sources),), translator.model.cfg.bos_id, dtype=torch.long)
    out = []
    for _ in range(steps):
        out.append(step(runner, cache, tokens, beam_rows))
        tokens = out[-1].choice
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
    compiled: Runner, eager: Runner, translator: Translator
) -> None:
    """Every batch size the graph serves (one row, a few, the capacity), mixed greedy and beam rows:
    the same argmax and best candidates as ``DecodeStep`` run eagerly, log-probs to float rounding."""
    for rows, beam_rows in ((1, [0]), (3, [0, 2]), (CAPACITY, list(range(10, 30)))):
        sources = source_ids(translator, rows, seed=rows)
        got = decode(compiled, translator, sources, 12, beam_rows)
        want = decode(eager, translator, sources, 12, beam_rows)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g.choice, w.choice)
            assert torch.equal(g.top_tokens, w.top_tokens)
            torch.testing.assert_close(g.top_lprobs, w.top_lprobs, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(g.eos_lprob, w.eos_lprob, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("which", ["compiled", "eager"])
@torch.inference_mode()
def test_a_rows_results_do_not_depend_on_its_neighbours(
    which: str, compiled: Runner, eager: Runner, translator: Translator
) -> None:
    """Bit for bit, for both runners: a row decoded alone, and beside rows with longer sources and
    longer histories (so the step reads more cached and source positions than the row has)."""
    runner = compiled if which == "compiled" else eager
    model = translator.model
    mine = source_ids(translator, 1, seed=11)[0][:6] + [model.cfg.eos_id]
    others = source_ids(translator, 5, seed=12)
    alone = decode(runner, translator, [mine], 8, [0])

    cache = new_cache(translator, runner.align)
    join(cache, translator, others)
    tokens = torch.full((len(others),), model.cfg.bos_id, dtype=torch.long)
    for _ in range(9):  # the neighbours have decoded 9 tokens before ours joins
        tokens = step(runner, cache, tokens, [0]).choice
    join(cache, translator, [mine])
    row = cache.rows - 1
    tokens = torch.cat([tokens, torch.tensor([model.cfg.bos_id])])
    for t, expected in enumerate(alone):
        got = step(runner, cache, tokens, [1, row])
        assert int(got.choice[row]) == int(expected.choice[0]), t
        assert torch.equal(got.top_lprobs[1], expected.top_lprobs[0]), t  # bit for bit
        assert torch.equal(got.eos_lprob[1], expected.eos_lprob[0]), t
        tokens = got.choice


def test_the_package_is_kept_and_loaded_by_the_next_process(compiled: Runner, model_dir: Path) -> None:
    """A new process with the same model and settings finds the package and loads it (no compiling)."""
    assert isinstance(compiled, PackagedRunner)
    assert list(compile_cache_dir().glob(f"step-{compiled.key()}.pt2"))
    code = (
        "import torch\n"
        "from pathlib import Path\n"
        "from model.translator import Translator\n"
        f"t = Translator.load({str(model_dir)!r}, device='cpu', max_beam_size={TOP // 2}, compile=True,"
        f" cache_dir=Path({str(compile_cache_dir())!r}))\n"
        "r = t.runner\n"
        "print(r.kind, r.cached, r.compile_seconds)\n"
    )
    # The same threads as this process: the kernels' parallel loops are part of the package's name.
    code = f"import torch; torch.set_num_threads({torch.get_num_threads()})\n" + code
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    kind, cached, seconds = out.stdout.split()
    assert (kind, cached) == ("compiled", "True") and float(seconds) < 20


def test_the_package_name_changes_with_what_the_graph_depends_on(translator: Translator) -> None:
    step = DecodeStep(translator.model, top=TOP)
    at = positions(translator)
    key = PackagedRunner(step, capacity=CAPACITY, positions=at).key()
    assert PackagedRunner(step, capacity=CAPACITY, positions=at).key() == key  # stable
    assert PackagedRunner(step, capacity=CAPACITY * 2, positions=at).key() != key
    assert PackagedRunner(step, capacity=CAPACITY, positions=at - 16).key() != key  # the cache's strides
    other_top = DecodeStep(translator.model, top=TOP + 2)
    assert PackagedRunner(other_top, capacity=CAPACITY, positions=at).key() != key
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert PackagedRunner(step, capacity=CAPACITY, positions=at).key() != key  # loops sized when compiled
    finally:
        torch.set_num_threads(threads)
    with torch.no_grad():  # the weights are the package's inputs, not part of it
        weight = translator.model.embed.weight
        weight[5, 0] += 1.0
        try:
            assert PackagedRunner(step, capacity=CAPACITY, positions=at).key() == key
        finally:
            weight[5, 0] -= 1.0


@torch.inference_mode()
def test_a_second_model_of_the_same_architecture_compiles_nothing_and_decodes_with_its_own_weights(
    compiled: Runner, eager: Runner, translator: Translator, model_dir: Path
) -> None:
    """Another model of the same shape (its embedding perturbed): its step is the first
    model's package, loaded, not compiled, handed the second model's weights, and it chooses as the
    second model's eager step (not as the first model's), while the first model's package still
    chooses with the first model's weights."""
    assert isinstance(compiled, PackagedRunner)
    other = Translator.load(model_dir, device="cpu")
    with torch.no_grad():
        g = torch.Generator().manual_seed(5)
        other.model.embed.weight.add_(torch.randn(other.model.embed.weight.shape, generator=g) * 0.5)
    packages = set(compile_cache_dir().glob("step-*.pt2"))
    second = runner_of(other, compile=True)
    assert isinstance(second, PackagedRunner) and second.cached and second.key() == compiled.key()
    assert set(compile_cache_dir().glob("step-*.pt2")) == packages  # nothing new compiled
    second_eager = runner_of(other, compile=False)
    sources = source_ids(translator, 4, seed=21)

    def choices(runner: Runner, which: Translator) -> torch.Tensor:
        return torch.stack([s.choice for s in decode(runner, which, sources, 10, [0, 1])])

    mine, first = choices(second, other), choices(compiled, translator)
    assert torch.equal(mine, choices(second_eager, other))
    assert torch.equal(first, choices(eager, translator))
    assert not torch.equal(mine, first)  # the weights differ, and so do the choices


def test_the_package_name_ignores_the_search_code() -> None:
    """Editing the beam bookkeeping or the running batch recompiles nothing: their source is not
    part of the package's name."""
    named = {path.name for path in runners.PackagedRunner.sources}
    assert "search.py" not in named and "batch.py" not in named
    assert {"layers.py", "transformer.py", "step.py", "cache.py", "prepack.py"} <= named


def test_a_runner_that_cannot_compile_decodes_eagerly(
    translator: Translator, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def broken(self: PackagedRunner, cache_dir: Path) -> None:
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(PackagedRunner, "prepare", broken)
    runner = load_runner(
        translator.model,
        top=TOP,
        capacity=1,  # warmed up on the one row it holds
        positions=positions(translator),
        compile=True,
        cache_dir=tmp_path,
    )
    assert isinstance(runner, EagerRunner) and runner.kind == "eager"


def test_under_a_torch_the_package_was_not_tested_with_the_cpu_step_is_eager_and_never_loaded(
    translator: Translator, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A GPU machine's own torch crashed loading the CPU package (a segfault, not an exception):
    under a release outside ``PACKAGED_TORCH`` no package is made or loaded."""

    prepared: list[Path] = []  # (load_runner falls back on any exception: record, not raise)

    def never(self: PackagedRunner, cache_dir: Path) -> None:
        prepared.append(cache_dir)

    assert runners.packaged_runs_under("2.13.0+cpu")  # the torch the README pins
    monkeypatch.setattr(PackagedRunner, "prepare", never)
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    assert not runners.packaged_runs_under(torch.__version__)
    runner = load_runner(
        translator.model,
        top=TOP,
        capacity=1,
        positions=positions(translator),
        compile=True,
        cache_dir=tmp_path,
    )
    assert runner.kind == "eager" and not prepared


@torch.inference_mode()
def test_garbage_in_never_written_buffer_memory_reaches_no_result(
    eager: Runner, translator: Translator
) -> None:
    """The buffers are allocated, not zeroed (memory is taken only for the positions used): NaN
    wherever nothing was written yet changes nothing, and zeroing positions as the rows reach them
    loses nothing written, rows of different lengths and joins included."""
    model = translator.model
    # Short sources and a long decoding: the cached positions outgrow the source ones.
    first = [ids[:4] + [model.cfg.eos_id] for ids in source_ids(translator, 3, seed=4)]
    later = [ids[:7] + [model.cfg.eos_id] for ids in source_ids(translator, 2, seed=5)]

    def run(poison: bool) -> list[torch.Tensor]:
        cache = new_cache(translator, eager.align)
        if poison:  # garbage wherever nothing was written
            cache.self_kv.fill_(float("nan"))
            cache.cross_kv.fill_(float("nan"))
        else:  # the reference: every position zeroed from the start, none left to zero later
            cache.self_kv.zero_()
            cache.cross_kv.zero_()
            cache._clean = cache.self_kv.size(4)
        join(cache, translator, first)
        tokens = torch.full((3,), model.cfg.bos_id, dtype=torch.long)
        out = []
        for t in range(40):
            if t == 5:  # newcomers with other source lengths join mid-way
                join(cache, translator, later)
                tokens = torch.cat([tokens, torch.full((2,), model.cfg.bos_id, dtype=torch.long)])
            got = step(eager, cache, tokens, list(range(cache.rows)))
            out.append(got.top_lprobs)
            tokens = got.choice
        return out

    for clean, poisoned in zip(run(False), run(True), strict=True):
        assert torch.isfinite(poisoned).all()
        assert torch.equal(clean, poisoned)
