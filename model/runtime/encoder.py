"""The encoder compiled like the step: an AOTInductor package (``model.runtime.package``) of
``Transformer.encode`` followed by the cross-attention projections (``source_kv``), with the batch
size, the padded length and the number of real tokens as symbols: one graph for every batch that
joins.

Eagerly, admitting inputs into the running batch took a fifth of a worker's time under load on
the shipped model (issue 57): a few sentences a join, each of ~190 small operators paying the
dispatcher. Compiled, the elementwise work between the matrix
products (int8's activation quantization, embedding, residual additions) runs as a few fused loops.

The same bits as the eager encoder, so that swapping one for the other changes no translation:

- the padded rows are always packed (``Packing``: the position-wise layers run on the real tokens
  only); every position-wise layer computes each position on its own, so packing changes no bit
  where matrix products do not depend on their rows (int8's integer sums; float32 under
  ``model.reproducible``'s strict mode);
- LayerNorm stays ATen's own kernel (``keep_kernels``: the exported graph calls it through the
  opaque operator ``nmt::layer_norm``): TorchInductor's own reductions sum in another order, and
  moved encoder outputs by ~1e-6, which int8's rounding of the next layer's activations turned
  into 0.05 now and then; attention is ATen's kernel anyway;
- the rest is elementwise arithmetic done in the same order, and the linear layers' oneDNN calls.

The package calls that operator through its C shim (``model.runtime.shims``: a small library
built beside the package, calling the same ATen kernel), not back in Python: so the encoder runs
through the package's C interface without the GIL (``model.runtime.native``), as the step does, and
a decoding thread encodes while the others decode; the decoding threads of a process share one
package, one call at a time. Compiling it takes ~20 s of a core, so the first start has a process
of its own make it (and the shims' library), at a lower priority (``CompiledEncoder``), while the
eager encoder serves: the same bits, so the moment it takes over changes no translation; where it
cannot be made, the eager encoder stays.

The tests compare every output bit with the eager encoder's.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from model.config import ModelConfig
from model.layers import Packing, aligned
from model.runtime import int8mm, lower_priority, shims
from model.runtime.package import SOURCES, Package
from model.runtime.prepack import prepack
from model.transformer import Transformer, strip_dropout

log = logging.getLogger(__name__)


def encode_eagerly(model: Transformer, src: Tensor) -> tuple[Tensor, Tensor]:
    """``StepRunner.encode`` computed by the model's own modules: the cross-attention keys/values
    of ``src``'s rows (B, L, 2, H, S, Dh) and its mask (B, S), True on real tokens."""
    enc = model.encode(src)
    return model.source_kv(enc), enc.src_mask


# ``nmt::layer_norm`` (defined in ``model.runtime.shims``): ``aten.layer_norm`` run by ATen's kernel
# inside a compiled graph.


def _layer_norm(
    input: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    cudnn_enable: bool = True,
) -> Tensor:
    out = torch.ops.aten.layer_norm.default(input, normalized_shape, weight, bias, eps, cudnn_enable)
    return out.contiguous()


shims.LIBRARY.impl("layer_norm", _layer_norm, "CPU")


@torch.library.register_fake("nmt::layer_norm", lib=shims.LIBRARY)
def _(input: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    return input.new_empty(input.shape)


# The ATen operators a compiled encoder leaves to ATen's kernels, and the opaque operators that
# call them (the same arguments, by the same names). Attention needs none: TorchInductor calls
# ATen's own CPU kernel for it (``_scaled_dot_product_flash_attention_for_cpu``).
KEPT = {torch.ops.aten.layer_norm.default: torch.ops.nmt.layer_norm.default}


def keep_kernels(program: torch.export.ExportedProgram) -> int:
    """Make ``program`` call ``KEPT``'s operators through their opaque twins, which TorchInductor
    does not decompose; returns how many calls it changed."""
    changed = 0
    for node in program.graph.nodes:
        if node.op == "call_function" and node.target in KEPT:
            normalized = torch.fx.operator_schemas.normalize_function(
                node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True
            )
            assert normalized is not None, f"cannot read the arguments of {node.target}"
            node.target, node.args, node.kwargs = KEPT[node.target], (), dict(normalized.kwargs)
            changed += 1
    program.graph_module.recompile()
    return changed


class EncodeStep(nn.Module):
    """``forward(src, index)``: the cross-attention keys/values (B, L, 2, H, S, Dh) of ``src``
    (B, S), right-padded, whose real tokens are at the flat positions ``index`` (N,)
    (``Packing.of`` its mask)."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model

    def forward(self, src: Tensor, index: Tensor) -> Tensor:
        packing = Packing(index, src.size(0), src.size(1))
        return self.model.source_kv(self.model.encode(src, packing))


class PackagedEncoder(Package):
    """``EncodeStep`` as a package, for batches of 1 to ``rows`` inputs of up to ``positions``
    tokens (``fits``); called as ``StepRunner.encode``, through its C interface, its LayerNorm
    through the shims' library ``shims`` (``model.runtime.shims.path``), loaded first (see the
    module's docstring)."""

    name = "encoder"
    sources = (*SOURCES, Path(__file__), Path(shims.__file__))

    def __init__(self, model: Transformer, *, rows: int, positions: int, shims: Path) -> None:
        super().__init__(EncodeStep(model).eval(), model)
        self.rows = rows
        self.length = min(aligned(positions), model.cfg.max_positions)
        self.shims = shims

    def fits(self, src: Tensor) -> bool:
        """Whether the graph takes ``src``: its batch and length within the symbols' ranges."""
        return 1 <= src.size(0) <= self.rows and 2 <= src.size(1) <= self.length

    def __call__(self, src: Tensor) -> tuple[Tensor, Tensor]:
        mask = src != self.model.cfg.pad_id
        index = mask.reshape(-1).nonzero().squeeze(1)
        return self.run((src, index))[0], mask

    def about(self) -> dict[str, Any]:
        return {"rows": self.rows, "length": self.length, "shims": shims.digest()}

    def inductor_configs(self) -> dict[str, Any]:
        return shims.inductor_configs()

    def _load(self, path: Path) -> None:
        shims.load(self.shims)  # first: the package's library looks for the shims' functions there
        super()._load(path)

    def export(self) -> torch.export.ExportedProgram:
        """The encoder over 1 to ``rows`` inputs, 2 to ``length`` padded positions and 1 to all of
        them real; the example a batch of three of different lengths."""
        model = self.model
        length = min(32, self.length)
        src = torch.full((min(3, self.rows), length), model.cfg.pad_id, dtype=torch.long, device=model.device)
        for i in range(src.size(0)):  # 5s, then eos: every row a different length
            real = max(2, length - 3 * i)
            src[i, : real - 1], src[i, real - 1] = 5, model.cfg.eos_id
        index = (src != model.cfg.pad_id).reshape(-1).nonzero().squeeze(1)
        dim = torch.export.Dim
        shapes = (
            {0: dim("inputs", min=1, max=self.rows), 1: dim("length", min=2, max=self.length)},
            {0: dim("tokens", min=1, max=self.rows * self.length)},
        )
        # Size-oblivious: a batch of one input is not a special case.
        with torch.fx.experimental._config.patch(backed_size_oblivious=True):  # type: ignore[attr-defined]
            program = torch.export.export(self.module, (src, index), dynamic_shapes=shapes, strict=False)
        keep_kernels(program)
        return program


# Added to the nice value of the process that compiles the encoder (and of its compiler): the
# service decodes with the eager encoder meanwhile.
COMPILE_NICE = 10
COMPILE_TIMEOUT_S = 1800

# The packages being made by this process's compiling processes: another model of the same
# architecture waits for the one under way instead of starting a process of its own (twenty
# models of one architecture started twenty, ~350 MB each, nineteen of them waiting on the lock).
_making: dict[Path, threading.Event] = {}
_making_lock = threading.Lock()


class CompiledEncoder:
    """A model's ``PackagedEncoder``, shared by its runners (``package``: None until it is made and
    loaded, and where it cannot be). Where it is on disk already it is loaded at once; else a
    process of its own compiles it (``python -m model.runtime.encoder``), at a lower priority
    (``COMPILE_NICE``), and the first batch after that loads it.

    A process, not a thread: exporting installs torch's fake-tensor mode, which reached another
    thread's eager encoder (its int8 products came out as fake tensors). The package holds no
    weights, so the compiling process builds the same architecture with weights of its own (the
    package's key, checked there, says whether it is the same graph)."""

    def __init__(self, model: Transformer, *, rows: int, positions: int, cache_dir: Path) -> None:
        self.model = model
        self.package: PackagedEncoder | None = None
        self.ready = threading.Event()  # set once it can be loaded, or given up
        library = shims.path(cache_dir)
        self._encoder = PackagedEncoder(model, rows=rows, positions=positions, shims=library)
        self._path: Path | None = None  # made, not loaded yet
        self._lock = threading.Lock()  # held while the package is loaded
        self._running = threading.Lock()  # held while it runs
        path = self._encoder.path(cache_dir)
        if path.exists() and library.exists():
            self._path = path
            self._take()
            self.ready.set()
        else:
            spec = describe(self._encoder, cache_dir)
            threading.Thread(
                target=self._compile, args=(spec, path), name="compile-encoder", daemon=True
            ).start()

    @property
    def made(self) -> bool:
        """Whether the package is made (loaded, or loaded by the next call)."""
        return self.package is not None or self._path is not None

    def _compile(self, spec: dict[str, Any], path: Path) -> None:
        """Run the compiling process and wait for it (on a thread of ours: no torch here); or, where
        this process is making the same package already, wait for that."""
        with _making_lock:
            under_way = _making.get(path)
            if under_way is None:
                _making[path] = threading.Event()
        if under_way is not None:
            under_way.wait(COMPILE_TIMEOUT_S)
            if path.exists():
                self._path = path
            self.ready.set()
            return
        try:
            self._run_compiler(spec, path)
        finally:
            with _making_lock:
                _making.pop(path).set()

    def _run_compiler(self, spec: dict[str, Any], path: Path) -> None:
        root = str(Path(__file__).resolve().parents[2])  # where ``model`` is importable from
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
        }
        try:
            done = subprocess.run(
                [sys.executable, "-m", "model.runtime.encoder", json.dumps(spec)],
                capture_output=True,
                text=True,
                env=env,
                timeout=COMPILE_TIMEOUT_S,
                check=False,
            )
            if done.returncode == 0 and path.exists():
                self._path = path
            else:
                log.warning(
                    "compiling the encoder failed (exit %d); encoding eagerly (the same results): %s",
                    done.returncode,
                    done.stderr.strip()[-2000:],
                )
        except (OSError, subprocess.SubprocessError) as e:
            log.warning("compiling the encoder failed (%s); encoding eagerly (the same results)", e)
        finally:
            self.ready.set()

    def _take(self) -> None:
        """Load the made package (on the decoding thread that first finds it made)."""
        with self._lock:
            if self.package is not None or self._path is None:
                return
            path, self._path = self._path, None
            try:
                self._encoder.cached = True
                self._encoder._load(path)
                self.package = self._encoder
                log.info("encoder loaded from %s", path)
            except Exception:
                log.exception("loading the encoder failed; encoding eagerly (the same results)")

    def __call__(self, src: Tensor) -> tuple[Tensor, Tensor]:
        """``StepRunner.encode``: the package where it is made and takes ``src``, else the model's
        own modules."""
        if self._path is not None:
            self._take()
        package = self.package
        if package is not None and package.fits(src):
            # One call at a time: the package has one model (a second call would wait in it; here
            # it waits without the GIL, as in the call).
            with self._running:
                return package(src)
        return encode_eagerly(self.model, src)


def describe(encoder: PackagedEncoder, cache_dir: Path) -> dict[str, Any]:
    """What the compiling process needs to build ``encoder``'s graph: the architecture, how its
    linear layers are prepared, the sizes, the thread count and the package's key."""
    model = encoder.model
    kinds = {type(m).__name__ for m in model.modules()}
    return {
        "config": asdict(model.cfg),
        "dtype": str(model.dtype).removeprefix("torch."),
        "linears": "int8" if "Int8Linear" in kinds else "packed" if "PackedLinear" in kinds else "plain",
        "int8_kernel": int8mm.runs_ours(model),
        "dropout": "Dropout" in kinds,
        "rows": encoder.rows,
        "positions": encoder.length,
        "threads": torch.get_num_threads(),
        "cache_dir": str(cache_dir),
        "key": encoder.key(),
    }


def compile_described(spec: dict[str, Any]) -> None:
    """Build the architecture ``spec`` describes (``describe``), with weights of its own, and compile
    its encoder into the cache (unless there already); raises RuntimeError where its key is not the
    one described."""
    torch.set_num_threads(spec["threads"])
    model = Transformer(ModelConfig(**spec["config"])).to(dtype=getattr(torch, spec["dtype"])).eval()
    if not spec["dropout"]:
        strip_dropout(model)
    library = shims.library(Path(spec["cache_dir"]))  # (built here, once; RuntimeError where it cannot be)
    if spec["linears"] == "int8" and spec["int8_kernel"] and not int8mm.ensure(Path(spec["cache_dir"])):
        raise RuntimeError("our int8 kernel, which the caller's layers run, cannot be loaded here")
    if spec["linears"] != "plain":
        prepack(model, int8=spec["linears"] == "int8", keep_float=False)
    encoder = PackagedEncoder(model, rows=spec["rows"], positions=spec["positions"], shims=library)
    if encoder.key() != spec["key"]:
        raise RuntimeError("this process builds another encoder than the one described (its key differs)")
    encoder._compile(encoder.path(Path(spec["cache_dir"])))  # (nothing where another process did)


if __name__ == "__main__":  # the compiling process of ``CompiledEncoder``
    lower_priority(COMPILE_NICE)
    compile_described(json.loads(sys.argv[1]))
