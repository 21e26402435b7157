"""The compiled step called through its library's C interface (``model.runtime.native``): the same
bits as torch's binding of the package, without the GIL, in two threads at once, unpacked once,
and torch's binding wherever the native path fails."""

from __future__ import annotations

import logging
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import compile_cache_dir, needs_cpu_package

from model.runtime import native
from model.runtime import package as packages
from model.runtime.package import constant_names
from model.runtime.runners import PackagedRunner, warm_up
from model.runtime.step import DecodeStep
from model.translator import Translator
from tests.test_runners import CAPACITY, TOP, join, new_cache, positions, runner_of, source_ids


@pytest.fixture(scope="module")
def compiled(translator: Translator) -> PackagedRunner:
    """The step as ``load_runner`` makes it: native."""
    needs_cpu_package()
    runner = runner_of(translator, compile=True)
    assert isinstance(runner, PackagedRunner) and runner.native
    return runner


@pytest.fixture(scope="module")
def bound(compiled: PackagedRunner, translator: Translator) -> PackagedRunner:
    """The same package run through torch's binding (``native=False``)."""
    runner = PackagedRunner(
        DecodeStep(translator.model, top=TOP),
        capacity=CAPACITY,
        positions=positions(translator),
        native=False,
    )
    runner.prepare(compile_cache_dir())
    warm_up(runner, translator.model, capacity=CAPACITY, positions=positions(translator))
    assert runner.package == compiled.package and not runner.native and runner._native is None
    return runner


def inputs(translator: Translator, rows: int, beam_rows: list[int], seed: int) -> tuple[torch.Tensor, ...]:
    """A step's inputs: ``rows`` sources of their own lengths, 5 tokens decoded already."""
    cache = new_cache(translator)
    join(cache, translator, source_ids(translator, rows, seed=seed))
    g = torch.Generator().manual_seed(seed)
    vocab = translator.model.cfg.vocab_size
    for _ in range(5):
        cache.advance(torch.randn(cache.self_kv[:rows, :, :, :, :1].shape, generator=g))
    tokens = torch.randint(4, vocab, (rows,), generator=g)
    forced = torch.randint(4, vocab, (len(beam_rows), 3), generator=g)
    return (tokens, *cache.views(), torch.tensor(beam_rows), forced)


@torch.inference_mode()
def test_the_native_step_computes_the_bits_torchs_binding_computes(
    compiled: PackagedRunner, bound: PackagedRunner, translator: Translator
) -> None:
    """Every output, bit for bit, on the same inputs: one row, a few, the capacity; greedy rows and
    beam rows."""
    assert compiled._native is not None
    for rows, beam_rows in ((1, [0]), (3, [0, 2]), (7, [1, 2, 3, 4, 5, 6]), (CAPACITY, list(range(10, 30)))):
        args = inputs(translator, rows, beam_rows, seed=rows)
        mine, theirs = compiled(*args), bound(*args)
        assert len(mine) == len(theirs) == 6
        for m, t in zip(mine, theirs, strict=True):
            assert m.dtype == t.dtype and m.shape == t.shape and m.stride() == t.stride()
            assert torch.equal(m, t), rows


def test_the_native_step_names_the_constants_as_the_runner_does(compiled: PackagedRunner) -> None:
    """The container's own names for its constants are the ones ``constant_names`` derives from the
    original names (what torch's binding is handed), and it holds the model's own tensors."""
    assert compiled._native is not None
    names = compiled._native.constants()
    assert constant_names(list(names.values())) == names
    tensors = {**compiled.tensors(), **compiled._scalars}
    held = dict(zip(names.values(), compiled._native._tensors, strict=True))
    assert all(held[fqn] is tensors[fqn] for fqn in names.values())  # not copies


def python_progress_during_steps(runner: PackagedRunner, args: tuple[torch.Tensor, ...], steps: int) -> int:
    """How many of ``steps`` calls of ``runner`` a second Python thread made progress during.

    The switch interval is raised so that the calling thread gives the GIL up only where it
    releases it itself (no forced switch during the test); the second thread sleeps (releasing
    it) and counts each time it wakes and gets it back. A step that holds the GIL lets the
    counter move during no call at all (nothing else between the two readings of the counter
    releases it); one that releases it lets it move whenever the other thread's sleep ends during
    a call."""
    count, stop = [0], threading.Event()

    def counter() -> None:
        while not stop.is_set():
            time.sleep(0.0002)
            count[0] += 1

    interval = sys.getswitchinterval()
    thread = threading.Thread(target=counter)
    sys.setswitchinterval(30.0)
    try:
        thread.start()
        progressed = 0
        for _ in range(steps):
            before = count[0]
            outputs = runner(*args)
            progressed += count[0] != before
            # Freed outside the window: freeing a tensor may release the GIL (under torch's
            # binding, the previous step's outputs freed let the other thread in, now and then).
            del outputs
        return progressed
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)


@torch.inference_mode()
def test_the_native_step_runs_without_the_gil(
    compiled: PackagedRunner, bound: PackagedRunner, translator: Translator
) -> None:
    """Another Python thread runs during the native step's calls, and during none of torch's
    binding's (which holds the GIL: the reason for the native path)."""
    args = inputs(translator, CAPACITY, list(range(CAPACITY)), seed=3)
    assert python_progress_during_steps(bound, args, 40) == 0
    # Each call lasts a fraction of a millisecond: most calls see the other thread, a few suffice.
    assert python_progress_during_steps(compiled, args, 200) >= 5


def decode(
    runner: PackagedRunner, translator: Translator, sources: list[list[int]], steps: int
) -> list[torch.Tensor]:
    """Every output of ``steps`` steps, rows 0 and 1 searched by beam."""
    cache = new_cache(translator)
    join(cache, translator, sources)
    tokens = torch.full((len(sources),), translator.model.cfg.bos_id, dtype=torch.long)
    forced = torch.zeros((2, 2), dtype=torch.long)
    out: list[torch.Tensor] = []
    with torch.inference_mode():
        for _ in range(steps):
            got = runner(tokens, *cache.views(), torch.tensor([0, 1]), forced)
            cache.advance(got[4])
            tokens = got[0]
            out += [got[0], got[1], got[2], got[3], got[5]]
    return out


def test_two_siblings_stepping_at_once_compute_as_each_alone(
    compiled: PackagedRunner, translator: Translator
) -> None:
    """A sibling is another container of the same library, handed the same tensors (not copies),
    nothing compiled; the two stepping in two threads at once compute what each computes alone."""
    packages = set(compile_cache_dir().glob("step-*.pt2"))
    twin = compiled.sibling()
    assert set(compile_cache_dir().glob("step-*.pt2")) == packages
    assert twin.native and twin._native is not None and compiled._native is not None
    assert twin._native._container.value != compiled._native._container.value
    assert twin._native._lib is compiled._native._lib  # one library loaded
    assert all(a is b for a, b in zip(twin._native._tensors, compiled._native._tensors, strict=True))

    work = {
        compiled: source_ids(translator, CAPACITY, seed=31),
        twin: source_ids(translator, CAPACITY - 9, seed=32),
    }
    alone = {runner: decode(runner, translator, sources, 25) for runner, sources in work.items()}

    def run(
        runner: PackagedRunner, start: threading.Barrier, into: dict[PackagedRunner, list[torch.Tensor]]
    ) -> None:
        start.wait()
        into[runner] = decode(runner, translator, work[runner], 25)

    for _ in range(3):
        together: dict[PackagedRunner, list[torch.Tensor]] = {}
        start = threading.Barrier(2)
        threads = [threading.Thread(target=run, args=(runner, start, together)) for runner in work]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for runner in work:
            assert len(together[runner]) == len(alone[runner])
            assert all(torch.equal(a, b) for a, b in zip(together[runner], alone[runner], strict=True))


@pytest.fixture
def fresh_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packages, "_native_warned", False)


@pytest.mark.parametrize("where", ["extract", "library"])
def test_a_failing_native_path_falls_back_to_torchs_binding_and_says_so_once(
    where: str,
    compiled: PackagedRunner,
    translator: Translator,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    fresh_warning: None,
) -> None:
    """An extraction error, or a library without a function of the interface (another torch):
    the step is still the compiled package, through torch's binding, and decodes as the native
    step does; the warning is logged once however many runners fall back."""
    if where == "extract":

        def broken(package: Path) -> Path:
            raise OSError("read-only file system")

        monkeypatch.setattr(packages, "extract", broken)
    else:
        monkeypatch.setitem(native._SIGNATURES, "AOTInductorModelContainerRunFaster", [])
        monkeypatch.setattr(native, "_libraries", {})  # declared again, lacking the function
    sources = source_ids(translator, 5, seed=41)
    with caplog.at_level(logging.WARNING, logger=packages.__name__):
        first, second = runner_of(translator, compile=True), runner_of(translator, compile=True)
    for runner in (first, second):
        assert isinstance(runner, PackagedRunner) and runner.kind == "compiled"
        assert not runner.native and runner._native is None and runner._loader is not None
        got, want = decode(runner, translator, sources, 12), decode(compiled, translator, sources, 12)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    warned = [r for r in caplog.records if "torch's binding" in r.getMessage()]
    assert len(warned) == 1


@pytest.fixture
def counted_unpacks(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Path]]:
    unpacked: list[Path] = []
    unpack = native._unpack

    def counting(package: Path, into: Path) -> None:
        unpacked.append(package)
        time.sleep(0.05)  # long enough for racing callers to find the lock taken
        unpack(package, into)

    monkeypatch.setattr(native, "_unpack", counting)
    yield unpacked


def test_a_second_runner_loads_the_library_unpacked_for_the_first(
    compiled: PackagedRunner, translator: Translator, counted_unpacks: list[Path]
) -> None:
    assert compiled._native is not None and compiled.package is not None
    library = compiled._native.library
    assert library.parent == compiled.package.with_suffix("")  # beside the package
    before = library.stat()
    second = runner_of(translator, compile=True)
    assert isinstance(second, PackagedRunner) and second.native and second._native is not None
    assert second._native.library == library and not counted_unpacks
    after = library.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_callers_racing_to_unpack_a_package_unpack_it_once(
    compiled: PackagedRunner, tmp_path: Path, counted_unpacks: list[Path]
) -> None:
    """Several at once (the lock is a file's: processes and threads alike wait on it): one unpacks,
    under a temporary name renamed whole; the others find its library; nothing else is left."""
    assert compiled.package is not None
    package = Path(shutil.copy(compiled.package, tmp_path / compiled.package.name))
    found: list[Path] = []
    threads = [threading.Thread(target=lambda: found.append(native.extract(package))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(counted_unpacks) == 1 and len(found) == 4 and len(set(found)) == 1
    assert found[0].parent == package.with_suffix("") and found[0].suffix == ".so"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [package.name, package.with_suffix("").name, package.with_suffix(".lock").name]
    )


def test_a_package_the_native_path_does_not_handle_is_refused(
    compiled: PackagedRunner, tmp_path: Path
) -> None:
    """A package holding weights of its own (torch's loader loads them) is not unpacked: the
    runner falls back to torch's binding rather than run without them."""
    import zipfile

    assert compiled.package is not None
    package = Path(shutil.copy(compiled.package, tmp_path / compiled.package.name))
    with zipfile.ZipFile(package, "a") as archive:
        prefix = archive.namelist()[0].split("/")[0]
        archive.writestr(f"{prefix}/data/aotinductor/model/weights.blob", b"\0")
    with pytest.raises(native.NativeUnavailable):
        native.extract(package)
    assert not package.with_suffix("").exists()


def test_a_closed_step_gives_its_handles_back(compiled: PackagedRunner, translator: Translator) -> None:
    """Our handle to each weight is freed with the container. (The library's own reference, taken
    when a weight is handed over user-managed, is not freed by its container, under torch's binding
    as here: torch 2.13's ``MaybeOwningAtenTensorHandle``.)"""
    assert compiled._native is not None
    tensors = {**compiled.tensors(), **compiled._scalars}
    weight = compiled._native._tensors[0]

    def references() -> int:  # to the tensor's C++ object (each handle is one)
        return int(weight._use_count())  # type: ignore[attr-defined]

    uses = references()
    step = native.NativeStep(compiled._native.library, tensors)
    held = references()
    assert held > uses
    step.close()
    assert references() <= held - 1
    step.close()  # twice: nothing more to free
    with pytest.raises(RuntimeError, match="closed"):
        step(*inputs(translator, 1, [0], seed=1))
