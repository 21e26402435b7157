"""A worker's model table: every served model, loaded when a sentence first needs it, the least
recently used idle one evicted when the loaded models' weights would exceed the worker's budget
(``NMT_WORKER_MODEL_MEMORY_MB``; 0: no budget). A worker loads its own models
(``app.serving.frontend.placement.homes``): the first before it is ready, the others after, in the
background; any other model when a sentence needs it.

Any worker serves any model, so the workers are one per core whatever the number of models
(they were one per core *per model*: 20 models on 2 cores were 40 processes, each with its own
torch runtime). A worker's memory is then the torch runtime once, plus the weights of the models it
holds, plus the running batches' caches.

In a worker, models are opened on a thread of their own (``app.serving.worker.loader``): the other
models' running batches go on stepping meanwhile, and the table takes the opened model between two
steps (``begin``, then ``collect``). Without a loader (tests, benchmarks, the library's callers)
``load`` opens it on the calling thread. What a model's weights take is measured once it is loaded
(packed and int8 copies included); before its first load, the size of its weights file stands for
it.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from app.config import Settings
from app.monitoring.metrics import Metrics
from app.serving.protocol import ModelDescription, ModelSpec
from app.serving.worker.loader import Loader
from model.decoding.constraints import beam_for
from model.decoding.translator import Translator

log = logging.getLogger("uvicorn.error").getChild("worker")

WEIGHTS_FILE = "model.safetensors"
# A model that could not be loaded is not tried again for this long: its sentences fail at once with
# the reason (a corrupt 300 MB file read again for every request would cost the other models).
FAILED_RETRY_S = 30.0

# Translated once before a worker reports ready: the first request should not pay for lazy
# initialisation (allocator, kernels, thread pools).
WARMUP_SENTENCES = ["Hallo Welt."]


@dataclass(eq=False)
class LoadedModel:
    name: str
    translator: Translator
    bytes: int  # what its tensors take in this process (``weight_bytes``)
    description: ModelDescription


def weight_bytes(module: torch.nn.Module) -> int:
    """The bytes of every tensor ``module`` holds (parameters, buffers and tensors kept as plain
    attributes, as packed weights are), each storage counted once: tied weights share one."""
    seen: set[int] = set()
    total = 0
    for sub in module.modules():
        tensors = [*sub.parameters(recurse=False), *sub.buffers(recurse=False)]
        tensors += [v for v in vars(sub).values() if isinstance(v, torch.Tensor)]
        for tensor in tensors:
            try:
                storage = tensor.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
            except (RuntimeError, NotImplementedError):  # opaque (oneDNN packed) tensors
                key, size = id(tensor), tensor.numel() * tensor.element_size()
            if key not in seen:
                seen.add(key)
                total += size
    return total


Opener = Callable[[ModelSpec], Translator]


class ModelTable:
    """The models this worker serves, by name, and those it holds (least recently used first)."""

    def __init__(
        self,
        specs: Sequence[ModelSpec],
        opener: Opener,
        *,
        budget_bytes: int = 0,
        metrics: Metrics | None = None,
        loader: Loader | None = None,
    ) -> None:
        if not specs:
            raise ValueError("a worker needs at least one model")
        self.specs = {spec.name: spec for spec in specs}
        self.opener = opener
        self.budget = budget_bytes  # 0: none
        self.metrics = metrics
        self.loaded: OrderedDict[str, LoadedModel] = OrderedDict()
        self.changes = 0  # loads and evictions so far (the worker tells the front end after each)
        self._sizes: dict[str, int] = {}  # measured when loaded once
        self.loader = loader  # None: models are opened on the calling thread
        self._asked: dict[str, float] = {}  # models a sentence waits for: since when
        self._failed: dict[str, tuple[float, BaseException]] = {}  # loads that failed: when, why

    @classmethod
    def single(cls, translator: Translator, name: str = "") -> ModelTable:
        """A table of one model, loaded already (tests, benchmarks, the library's callers)."""
        table = cls([ModelSpec(name, Path())], lambda spec: translator)
        table.load(name)
        return table

    @property
    def names(self) -> list[str]:
        return list(self.specs)

    @property
    def loaded_bytes(self) -> int:
        return sum(m.bytes for m in self.loaded.values())

    def estimate(self, name: str) -> int:
        """What ``name``'s weights will take once loaded: as measured, or its weights file's size."""
        if name in self._sizes:
            return self._sizes[name]
        try:
            return (self.specs[name].path / WEIGHTS_FILE).stat().st_size
        except OSError:
            return 0

    def get(self, name: str) -> LoadedModel | None:
        """``name`` if held, now the most recently used."""
        model = self.loaded.get(name)
        if model is not None:
            self.loaded.move_to_end(name)
        return model

    def load(self, name: str, busy: Collection[str] = ()) -> LoadedModel:
        """Hold ``name``, opening it on this thread if needed; first, the least recently used
        models not in ``busy`` are evicted while its weights would not fit in the budget beside
        theirs. (When the busy ones alone leave no room, it is loaded all the same, over the budget
        until they are idle: ``trim``.) Raises what loading raised."""
        held = self.get(name)
        if held is not None:
            return held
        self._check_failed(name)
        self._make_room(name, busy)
        started = time.monotonic()
        try:
            # Outside inference mode, which the worker's loop runs in: weights made under it are
            # inference tensors, and exporting the step to compile it fails on those.
            with torch.inference_mode(False):
                translator = self.opener(self.specs[name])
        except Exception as e:
            log.exception("cannot load model %s", name)  # once per try (``FAILED_RETRY_S``)
            self._failed[name] = (time.monotonic(), e)
            raise
        return self._install(name, translator, time.monotonic() - started)

    def _check_failed(self, name: str) -> None:
        """Raise why ``name`` could not be loaded, if it failed less than ``FAILED_RETRY_S`` ago."""
        failed = self._failed.get(name)
        if failed is not None and time.monotonic() - failed[0] < FAILED_RETRY_S:
            raise failed[1]

    def begin(
        self, name: str, busy: Collection[str] = (), urgent: bool = True, *, waited: bool = True
    ) -> LoadedModel | None:
        """``name`` if held; else its load begun on the loader (room made for it as ``load``
        does) and None: ``collect`` takes it once opened. ``urgent``: opened at once, before the
        loads queued ahead of need; ``waited``: a sentence waits for it (its wait is recorded).
        Without a loader, ``load``."""
        held = self.get(name)
        if held is not None or self.loader is None:
            return held or self.load(name, busy)
        self._check_failed(name)
        if urgent and waited:
            self._asked.setdefault(name, time.monotonic())
        if not self.loader.loading(name):
            self._make_room(name, busy)
        self.loader.want(self.specs[name], urgent)
        return None

    def loading(self, name: str) -> bool:
        return self.loader is not None and self.loader.loading(name)

    def collect(self) -> list[tuple[str, BaseException]]:
        """Hold the models the loader opened since the last call; those it could not open, with
        the reason (their waiting sentences fail with it)."""
        if self.loader is None:
            return []
        failed = []
        for opened in self.loader.done():
            asked = self._asked.pop(opened.name, None)
            if isinstance(opened.result, BaseException):
                self._failed[opened.name] = (time.monotonic(), opened.result)
                failed.append((opened.name, opened.result))
                continue
            self._install(opened.name, opened.result, opened.seconds)
            if asked is not None and self.metrics is not None:
                self.metrics.of_model(opened.name).model_load_wait.observe(time.monotonic() - asked)
        return failed

    def _make_room(self, name: str, busy: Collection[str]) -> None:
        """Evict the least recently used idle models while ``name``'s weights (and those of the
        loads under way) would not fit in the budget beside the models held."""
        if name not in self.specs:
            raise KeyError(f"no model {name!r} in this worker (models: {', '.join(self.specs)})")
        if not self.budget:
            return
        pending = [n for n in self.loader.pending if n != name] if self.loader is not None else []
        need = self.estimate(name) + sum(self.estimate(n) for n in pending)
        for other in [n for n in self.loaded if n not in busy]:
            if self.loaded_bytes + need <= self.budget:
                break
            self.evict(other)

    def _install(self, name: str, translator: Translator, seconds: float) -> LoadedModel:
        size = self._sizes[name] = weight_bytes(translator.model)
        runner = translator.runner
        description = ModelDescription(
            device=str(translator.device),
            dtype=str(translator.dtype).removeprefix("torch."),
            quantization=translator.quantization,
            decoding=runner.kind,
            compile_seconds=round(runner.compile_seconds, 3),
            load_seconds=round(seconds, 3),
            weight_bytes=size,
        )
        model = self.loaded[name] = LoadedModel(name, translator, size, description)
        self.changes += 1
        if self.metrics is not None:
            bound = self.metrics.of_model(name)
            bound.model_load.set(seconds)
            bound.model_loads.inc()
        if self.budget and self.loaded_bytes > self.budget:
            log.warning(
                "%s loaded over the budget: %d MB held, %d MB allowed (the others are busy)",
                name,
                self.loaded_bytes >> 20,
                self.budget >> 20,
            )
        return model

    def evict(self, name: str) -> None:
        if self.loaded.pop(name, None) is None:
            return
        self.changes += 1
        if self.metrics is not None:
            self.metrics.of_model(name).model_evictions.inc()
        log.info("evicted %s (least recently used)", name)

    def trim(self, busy: Collection[str]) -> None:
        """Evict idle models, least recently used first, while over the budget."""
        if not self.budget:
            return
        for name in [n for n in self.loaded if n not in busy]:
            if self.loaded_bytes <= self.budget:
                return
            self.evict(name)

    def load_at_start(self, own: Sequence[str] = ()) -> list[LoadedModel]:
        """The models loaded before the worker reports ready: the first of ``own`` (of every model
        without) that loads; the others of ``own`` that fit in the budget (all without one), in
        order, are opened then too without a loader, and with one are queued behind any model a
        sentence waits for (loaded ahead of need, while the worker serves). A model that does not
        load is left out (its sentences fail with the reason); when none of ``own`` loads, the
        first other model that does is loaded instead; raises when no model loads."""
        own = list(own or self.specs)
        loaded: list[LoadedModel] = []
        queued = 0  # the bytes of the models queued on the loader
        errors: list[str] = []
        # Its own models; then, only while none of them has loaded, the others in turn (so that
        # the worker describes what it runs).
        for name in own + [n for n in self.specs if n not in own]:
            if loaded and name not in own:
                break
            need = self.estimate(name)
            if loaded and self.budget and self.loaded_bytes + queued + need > self.budget:
                continue
            if loaded and self.loader is not None:
                self.loader.want(self.specs[name], urgent=False)
                queued += need
                continue
            try:
                loaded.append(self.load(name))
            except Exception as e:  # the others may still load: this one fails on demand (logged)
                errors.append(f"{name}: {type(e).__name__}: {e}")
        if not loaded:
            raise RuntimeError("no model could be loaded: " + "; ".join(errors))
        return loaded


def open_translator(
    settings: Settings, model_dir: Path, like: Translator | None = None, *, release_gil: bool = False
) -> Translator:
    """The model in ``model_dir`` as a worker runs it with ``settings``, its decoding step made
    (compiled or loaded from the cache where ``NMT_COMPILE``, on CPU and CUDA alike; eager where
    compiling fails) and, where ``NMT_WARMUP``, warmed up. ``like``: a Translator of that model
    that another worker of the process holds, whose weights this one shares
    (``app.serving.worker.shared``). ``release_gil``: the compiled step runs without the GIL, for a
    process of several workers (``Translator.release_gil``)."""
    translator = like.sibling() if like is not None else _load(settings, model_dir, release_gil)
    translator.runner  # noqa: B018 - made now, before the worker reports ready
    if settings.warmup:
        warm_up(translator)
    return translator


def _load(settings: Settings, model_dir: Path, release_gil: bool) -> Translator:
    return Translator.load(
        model_dir,
        device=settings.device,
        dtype=settings.dtype,
        quantization=settings.quantization,
        options=settings.decode_options(),
        # Room for the largest batch, or for one constrained input's beams (``beam_for``).
        capacity=max(
            settings.max_batch_size, beam_for(settings.max_beam_size, settings.max_terms_per_sentence)
        ),
        max_beam_size=settings.max_beam_size,
        compile=settings.compile,
        cache_dir=settings.compile_cache_dir,
        release_gil=release_gil,
        compile_encoder=settings.compile_encoder,
    )


def model_table(
    settings: Settings,
    models: Sequence[ModelSpec],
    metrics: Metrics | None,
    wake: Callable[[], None] | None = None,
    opener: Opener | None = None,
) -> ModelTable:
    """The worker's table; with ``wake`` (the inbox's), models are opened on a loader thread that
    calls it after each load. ``opener``: how a model is opened (the process's ``SharedModels``),
    by default on weights of its own."""
    if opener is None:

        def opener(spec: ModelSpec) -> Translator:
            return open_translator(settings, spec.path)

    return ModelTable(
        models,
        opener,
        budget_bytes=settings.worker_model_memory_mb << 20,
        metrics=metrics,
        loader=None if wake is None else Loader(opener, wake),
    )


def warm_up(translator: Translator) -> None:
    """Translate ``WARMUP_SENTENCES`` once, on the decoding step and cache size the worker uses."""
    target = translator.info.directions[0][1]
    translator.generate(translator.source_ids(WARMUP_SENTENCES, target=target), beam_size=1)
