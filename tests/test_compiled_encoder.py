"""The compiled encoder (``model.runtime.encoder``): every output bit the eager encoder's, in int8
and float32, post- and pre-LN, batches packed or not; LayerNorm left to ATen's kernel; made in the
background while the eager encoder serves, loaded at once the next time; translations unchanged."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import compile_cache_dir, needs_cpu_package, random_model, synthetic_sentences
from torch import nn

from model.decoding.batch import pad_batch
from model.runtime import encoder as encoder_module
from model.runtime import int8mm, shims
from model.runtime.encoder import CompiledEncoder, PackagedEncoder, encode_eagerly, keep_kernels
from model.runtime.prepack import prepack
from model.runtime.runners import PackagedRunner
from model.transformer import PACK_PADDING, Transformer, strip_dropout
from model.translator import Translator

ROWS, LENGTH = 8, 64  # the packages' batch and padded length here


@pytest.fixture(autouse=True, scope="module")
def _int8_kernel_loaded() -> None:
    """Our int8 kernel loaded before any model is prepared, as a served int8 model has it
    (``Translator.load``): every int8 layer here runs it, whichever test comes first."""
    int8mm.ensure(compile_cache_dir())


def served(*, int8: bool, pre_norm: bool) -> Transformer:
    """A tiny model prepared as a served one (no dropout modules, linear layers prepared)."""
    model = strip_dropout(random_model(seed=3, pre_norm=pre_norm, vocab_size=96))
    assert prepack(model, int8=int8, keep_float=False)
    return model


def batches(model: Transformer, seed: int) -> list[torch.Tensor]:
    """Padded batches of 1 to ROWS sources of 1 to 60 tokens: some mostly padding (the eager
    encoder packs them), some hardly padded (it does not), one of the longest sources."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.cfg
    out = []
    for rows in (1, 2, 3, 5, 8, 8, 4, 7):
        lengths = torch.randint(1, 60, (rows,), generator=g).tolist()
        if rows == 4:  # all of one aligned length (with eos): no padding
            lengths = [47] * rows
        if rows == 7:
            lengths[0] = 63  # with eos: the longest padded length
        ids = [torch.randint(4, cfg.vocab_size, (n,), generator=g).tolist() + [cfg.eos_id] for n in lengths]
        out.append(pad_batch(ids, cfg.pad_id, model.device))
    return out


@pytest.mark.parametrize(
    ("int8", "pre_norm"), [(True, False), (False, True)], ids=["int8-post-LN", "float32-pre-LN"]
)
def test_the_compiled_encoder_gives_every_bit_the_eager_encoder_gives(int8: bool, pre_norm: bool) -> None:
    needs_cpu_package()
    model = served(int8=int8, pre_norm=pre_norm)  # (not inference tensors: export takes none)
    encoder = PackagedEncoder(model, rows=ROWS, positions=LENGTH, shims=shims.library(compile_cache_dir()))
    encoder.prepare(compile_cache_dir())
    assert encoder.native  # through its C interface, without the GIL: its LayerNorm a C shim
    packed = unpacked = 0
    with torch.inference_mode():
        compared = [(src, encoder(src), encode_eagerly(model, src)) for src in batches(model, seed=int(int8))]
    for src, (kv, got_mask), (want, want_mask) in compared:
        assert encoder.fits(src)
        mask = src != model.cfg.pad_id
        if int(mask.sum()) <= (1 - PACK_PADDING) * mask.numel():
            packed += 1
        else:
            unpacked += 1
        assert torch.equal(got_mask, want_mask)
        real = mask[:, None, None, None, :, None]  # (padding's keys/values are masked out anyway)
        assert kv.shape == want.shape
        assert torch.equal(torch.where(real, kv, 0), torch.where(real, want, 0))
    assert packed and unpacked  # both of the eager encoder's ways were compared


def test_layer_norm_is_left_to_atens_kernel_in_the_exported_encoder() -> None:
    model = random_model(seed=3, pre_norm=True, vocab_size=96)
    program = PackagedEncoder(model, rows=ROWS, positions=LENGTH, shims=Path("unused")).export()
    targets = [n.target for n in program.graph.nodes if n.op == "call_function"]
    # Each encoder layer's two, and the encoder's final one (pre-LN); the decoder's are not run.
    norms = [m for m in model.encoder.modules() if isinstance(m, nn.LayerNorm)] + [model.encoder_norm]
    assert len(norms) == 2 * model.cfg.encoder_layers + 1
    assert targets.count(torch.ops.nmt.layer_norm.default) == len(norms)
    assert torch.ops.aten.layer_norm.default not in targets
    assert keep_kernels(program) == 0  # nothing left to change


def wait(encoder: CompiledEncoder) -> None:
    assert encoder.ready.wait(300), "the encoder was not made in 300 s"


def test_the_encoder_is_made_in_the_background_and_loaded_at_once_the_next_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    needs_cpu_package()
    compilers: list[list[str]] = []
    run = subprocess.run

    def counted(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        compilers.append(command)
        return run(command, **kwargs)

    monkeypatch.setattr(encoder_module.subprocess, "run", counted)
    model = served(int8=True, pre_norm=True)
    started = time.perf_counter()
    first = CompiledEncoder(model, rows=ROWS, positions=LENGTH, cache_dir=tmp_path)
    made_in = time.perf_counter() - started
    # Another model of the same architecture, meanwhile: it waits for the same package.
    other = CompiledEncoder(served(int8=True, pre_norm=True), rows=ROWS, positions=LENGTH, cache_dir=tmp_path)
    src = batches(model, seed=5)[2]
    with torch.inference_mode():
        while_compiling = first(src)  # the eager encoder meanwhile
    assert made_in < 1.0  # returned at once: compiling takes seconds
    assert first.package is None
    wait(first)
    wait(other)
    assert first.made and other.made
    assert len(list(tmp_path.glob("encoder-*.pt2"))) == 1
    assert len(compilers) == 1  # one compiling process for the two
    with torch.inference_mode():
        made = first(src)  # loads it
    assert first.package is not None
    second = CompiledEncoder(model, rows=ROWS, positions=LENGTH, cache_dir=tmp_path)
    assert second.ready.is_set() and second.package is not None  # loaded at once: no process
    with torch.inference_mode():
        for got in (made, second(src)):
            assert torch.equal(got[1], while_compiling[1])
            real = got[1][:, None, None, None, :, None]
            assert torch.equal(torch.where(real, got[0], 0), torch.where(real, while_compiling[0], 0))


def test_a_batch_the_package_does_not_take_is_encoded_eagerly() -> None:
    needs_cpu_package()
    model = served(int8=True, pre_norm=False)  # (test_the_compiled_encoder_gives_every_bit's package)
    encoder = CompiledEncoder(model, rows=ROWS, positions=LENGTH, cache_dir=compile_cache_dir())
    wait(encoder)
    assert encoder.package is not None
    eos = model.cfg.eos_id
    too_long = [[5] * LENGTH + [eos]]
    too_many = [[6, eos]] * (ROWS + 1)
    with torch.inference_mode():
        for ids in (too_long, too_many):
            src = pad_batch(ids, model.cfg.pad_id, model.device)
            assert not encoder.package.fits(src)
            kv, mask = encoder(src)
            want, want_mask = encode_eagerly(model, src)
            assert torch.equal(mask, want_mask) and torch.equal(kv, want)


def test_translations_with_the_compiled_encoder_are_the_eager_encoders(model_dir: Path) -> None:
    """The library's and the service's way (``Translator.load(compile_encoder=True)``, as
    ``NMT_COMPILE_ENCODER``): greedy and beam 3, against the compiled step with the eager encoder."""
    needs_cpu_package()

    def load(compile_encoder: bool) -> Translator:
        return Translator.load(
            model_dir,
            device="cpu",
            compile=True,
            cache_dir=compile_cache_dir(),
            compile_encoder=compile_encoder,
        )

    with_package, eager = load(True), load(False)
    runner = with_package.runner
    assert isinstance(runner, PackagedRunner) and runner.encoder is not None
    wait(runner.encoder)
    assert runner.encoder.made
    assert isinstance(eager.runner, PackagedRunner) and eager.runner.encoder is None
    twin = with_package.sibling()  # another thread's runner: the same package
    assert isinstance(twin.runner, PackagedRunner) and twin.runner.encoder is runner.encoder
    texts = synthetic_sentences(24, seed=4)
    for beam in (1, 3):
        want = [r.hypotheses for r in eager.translate_batch(texts, beam_size=beam)]
        assert [r.hypotheses for r in with_package.translate_batch(texts, beam_size=beam)] == want
        assert [r.hypotheses for r in twin.translate_batch(texts, beam_size=beam)] == want
    assert runner.encoder.package is not None  # (loaded by the first batch)


def test_two_decoding_threads_encode_through_one_package_at_once() -> None:
    """The runners of a process's threads share the package; calls from two threads at once all
    finish (they deadlocked on torch's binding) with the bits each gets alone."""
    needs_cpu_package()
    model = served(int8=True, pre_norm=False)  # (test_the_compiled_encoder_gives_every_bit's package)
    encoder = CompiledEncoder(model, rows=ROWS, positions=LENGTH, cache_dir=compile_cache_dir())
    wait(encoder)
    sources = batches(model, seed=7)
    with torch.inference_mode():
        alone = [encoder(src)[0] for src in sources]
    assert encoder.package is not None
    got: dict[int, list[torch.Tensor]] = {0: [], 1: []}

    def encode(thread: int) -> None:
        with torch.inference_mode():
            for _ in range(20):
                got[thread].extend(encoder(src)[0] for src in sources)

    threads = [threading.Thread(target=encode, args=(i,), daemon=True) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "the threads did not finish in 120 s"
    for thread in (0, 1):
        assert len(got[thread]) == 20 * len(sources)
        assert all(torch.equal(a, b) for a, b in zip(got[thread], alone * 20, strict=True))


def test_a_worker_running_the_compiled_encoder_imports_no_compiler() -> None:
    """Loading and running the package imports neither TorchInductor nor TorchDynamo (with sympy,
    86 MiB of a worker's memory when it did), in a process of its own (this one compiles)."""
    needs_cpu_package()
    script = f"""
import sys, torch
from pathlib import Path
torch.set_num_threads(1)
from model.decoding.batch import pad_batch
from model.runtime.encoder import CompiledEncoder
from model.runtime.prepack import prepack
from model.transformer import strip_dropout
from tests.conftest import random_model
model = strip_dropout(random_model(seed=3, pre_norm=False, vocab_size=96))
prepack(model, int8=True, keep_float=False)
cache = Path({str(compile_cache_dir())!r})
encoder = CompiledEncoder(model, rows={ROWS}, positions={LENGTH}, cache_dir=cache)
assert encoder.ready.wait(300)
with torch.inference_mode():
    encoder(pad_batch([[5, 6, 7, 3], [8, 3]], 0, model.device))
assert encoder.package is not None
print(sorted(m for m in ("torch._inductor", "torch._dynamo", "sympy") if m in sys.modules))
"""
    root = Path(__file__).parent.parent
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=600, check=False
    )
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr


def test_where_the_shims_library_cannot_be_built_the_eager_encoder_stays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    needs_cpu_package()
    broken = tmp_path / "shims.cpp"
    broken.write_text("this is not C++\n")
    with monkeypatch.context() as m:
        m.setattr(shims, "SOURCES", (broken, *shims.SOURCES[1:]))
        with pytest.raises(RuntimeError, match="building shims.cpp failed"):
            shims.library(tmp_path / "lib")
    assert not any((tmp_path / "lib").glob("*.so"))  # nothing half-built left to load
    # The compiling process cannot build it either (its lock is not a file here): no package.
    model = served(int8=True, pre_norm=False)
    shims.path(tmp_path).with_suffix(".lock").mkdir()
    encoder = CompiledEncoder(model, rows=ROWS, positions=LENGTH, cache_dir=tmp_path)
    wait(encoder)
    assert not encoder.made and not list(tmp_path.glob("encoder-*.pt2"))
    assert "IsADirectoryError" in caplog.text  # (the compiling process's reason, logged)
    src = batches(model, seed=6)[3]
    with torch.inference_mode():
        kv, mask = encoder(src)
        want, want_mask = encode_eagerly(model, src)
    assert torch.equal(mask, want_mask) and torch.equal(kv, want)


def test_shims_named_like_a_function_of_torchs_own_are_not_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A later torch with a shim of its own under one of our names: which one a package would call
    would not be ours to say, so ours are not loaded (the encoder then stays eager)."""
    declaration = "AOTITorchError aoti_torch_cpu__int_mm_out(AtenTensorHandle out, AtenTensorHandle a)"
    monkeypatch.setitem(shims.DECLARATIONS, "aten::_int_mm", declaration)
    with pytest.raises(RuntimeError, match="aoti_torch_cpu__int_mm_out"):
        shims.load(Path("never-loaded.so"))
