"""Getting ready to train: the processes and their devices (one per device under torchrun; gloo on
CPU, NCCL on GPU), the prepared corpus every process reads, the model training starts from (new
weights, or those of an existing model directory to fine-tune: ``--init``, ``training.finetune``),
the optimiser's schedule, a resumed run's state, and mixed precision.

``training.train`` calls these before its loop; the loop, the log and the export are its own.
"""

from __future__ import annotations

import math
import os
import random
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as torch_dist
from torch import nn

from model.checkpoint import ModelInfo, load_model, read_info
from model.transformer import Transformer
from training.checkpoints import TrainState, checkpoint_paths, load_checkpoint, set_rng_state
from training.config import ConfigError, TrainConfig
from training.data import DataError, PreparedCorpus
from training.finetune import apply_init
from training.prepare import prepared_corpus, sha256_file

T = TypeVar("T")


# -- processes and devices -------------------------------------------------------------------------
@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    patient: Any = None  # a gloo group without a practical timeout, to wait for data preparation

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            torch_dist.barrier()

    def on_main(self, fn: Callable[[], T]) -> T:
        """``fn()`` run by the main process only, its result (or its error) given to every process.
        The others wait as long as it takes (preparing a large corpus takes longer than the
        process group's default timeout)."""
        if self.world == 1:
            return fn()
        box: list[Any] = [None]
        if self.main:
            try:
                box[0] = ("ok", fn())
            except Exception as e:
                torch_dist.broadcast_object_list(
                    [("error", f"{type(e).__name__}: {e}")], src=0, group=self.patient
                )
                raise
        torch_dist.broadcast_object_list(box, src=0, group=self.patient)
        if box[0][0] == "error":
            raise DataError(f"the main process failed: {box[0][1]}")
        return box[0][1]  # type: ignore[no-any-return]


def setup_distributed(device: str) -> Dist:
    """One process per device under torchrun (it sets WORLD_SIZE/RANK/LOCAL_RANK); else a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    # One GPU per process on this machine: torchrun says how many processes it started here.
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "cuda" and gpus < local_world:
        raise ConfigError(
            f"train.device is 'cuda' but {gpus} GPU(s) are visible for {local_world} process(es) on "
            "this machine (one GPU per process: torchrun --nproc_per_node at most the GPU count)"
        )
    use_cuda = device == "cuda" or (device == "auto" and gpus >= local_world)
    if device == "auto" and 0 < gpus < local_world and local == 0:
        print(f"{local_world} processes per machine but {gpus} GPU(s): training on the CPU", file=sys.stderr)
    dev = torch.device(f"cuda:{local}") if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    patient = None
    if world > 1:
        if not torch_dist.is_initialized():
            torch_dist.init_process_group("nccl" if use_cuda else "gloo")
        patient = torch_dist.new_group(backend="gloo", timeout=timedelta(days=7))
    return Dist(rank, world, dev, patient)


# -- data ------------------------------------------------------------------------------------------
def open_corpus(
    cfg: TrainConfig,
    out: Path,
    dist: Dist,
    *,
    resume: bool,
    log: Callable[[str], None],
    init: Path | None = None,
) -> PreparedCorpus:
    """The prepared corpus for ``cfg``: found in the cache, or prepared by the main process while
    the others wait. A resumed run keeps its own vocabulary (``out``/sentencepiece.model), unless
    the config names one (``data.spm_model``): the checkpoint then tells whether it is the same.
    Fine-tuning (``init``) tokenizes with the initial model's tokenizer."""
    vocab = out / "sentencepiece.model"
    if init is not None:
        path = dist.on_main(lambda: prepared_corpus(cfg.data, out, init=init, log=log))
        return _open_prepared(path, dist)
    resumed = bool(resume and vocab.is_file() and checkpoint_paths(out) and not cfg.data.spm_model)
    resume_vocab = vocab if resumed else None
    path = dist.on_main(lambda: prepared_corpus(cfg.data, out, vocab=resume_vocab, log=log))
    corpus = _open_prepared(path, dist)
    if dist.main and (not vocab.is_file() or sha256_file(vocab) != corpus.vocab_sha256):
        shutil.copyfile(corpus.spm_path, vocab)  # the run's vocabulary, beside its checkpoints
    dist.barrier()
    return corpus


def _open_prepared(path: Path, dist: Dist) -> PreparedCorpus:
    try:
        corpus = PreparedCorpus(path)
    except DataError as e:
        if dist.world == 1:
            raise
        raise DataError(
            f"{e}: process {dist.rank} cannot read what the main process prepared; with several "
            "machines the output (or prepared) directory must be on storage every machine sees"
        ) from e
    return corpus


# -- optimisation ----------------------------------------------------------------------------------
def inverse_sqrt_schedule(warmup: int) -> Callable[[int], float]:
    """Linear warmup to the peak, then decay with 1/sqrt(step) (the paper's schedule, peak-normalised)."""

    def factor(step: int) -> float:
        step += 1
        return min(step / warmup, math.sqrt(warmup / step))

    return factor


# -- the model training starts from ----------------------------------------------------------------
def read_init(cfg: TrainConfig, init: Path | None) -> ModelInfo | None:
    """The record of the model to fine-tune (None without ``--init``), its architecture and
    languages applied to ``cfg`` (``training.finetune.apply_init``): read before anything else,
    since the corpus and the model both depend on them."""
    init_info = read_info(init) if init is not None else None
    if init is not None and init_info is not None:
        apply_init(cfg, init_info, str(init))
    return init_info


def initial_model(
    cfg: TrainConfig,
    corpus: PreparedCorpus,
    dist: Dist,
    init: Path | None,
    init_info: ModelInfo | None,
    log: Callable[[str], None],
) -> tuple[Transformer, ModelInfo]:
    """The model on this process's device, in training mode, with the record its export will carry:
    ``init``'s weights (fine-tuning), else new ones sized by the corpus's vocabulary. Seeds the RNGs."""
    p = cfg.train
    if init is not None and init_info is not None:
        model = load_model(init, ModelInfo(cfg.model, init_info.source_lang, init_info.target_lang))
        model.train()
        # The model's own directions and target tokens, whichever of them the data covers.
        info = ModelInfo(
            cfg.model,
            init_info.source_lang,
            init_info.target_lang,
            multilingual_directions=init_info.multilingual_directions,
            target_prefix=init_info.target_prefix,
        )
    else:
        cfg.model.vocab_size = corpus.tokenizer.vocab_size  # the vocabulary decides the embedding size
        torch.manual_seed(p.seed)  # the same initial weights in every process...
        model = Transformer(cfg.model)
        info = corpus.info(cfg.model)
    torch.manual_seed(p.seed + 1000 * (dist.rank + 1))  # ...but different dropout masks
    random.seed(p.seed + dist.rank)
    model.to(dist.device)
    n_params = sum(t.numel() for t in model.parameters())
    log(f"model: {n_params / 1e6:.2f}M parameters on {dist.device} x{dist.world}")
    return model, info


# -- resuming --------------------------------------------------------------------------------------
def restore(
    path: Path,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler,
    corpus: PreparedCorpus,
    dist: Dist,
    log: Callable[[str], None],
) -> TrainState:
    """Load the checkpoint ``path`` into the model, the optimiser and the schedule; its training
    state. A checkpoint of another vocabulary is refused: its weights would index other pieces."""
    blob = load_checkpoint(path)
    if blob.get("vocab_sha256", corpus.vocab_sha256) != corpus.vocab_sha256:
        raise ConfigError(
            f"{path} was trained with another vocabulary than {corpus.tokenizer_files[0]}: "
            + (
                f"resume with the --init it was started with ({blob['init']})"
                if blob.get("init")
                else "resume with the run's own sentencepiece.model (or start a new run)"
            )
        )
    model.load_state_dict(blob["model"])
    opt.load_state_dict(blob["optimizer"])
    sched.load_state_dict(blob["scheduler"])
    state = TrainState(**blob["state"])
    if len(blob["rng"]) == dist.world:
        set_rng_state(blob["rng"][dist.rank], dist.device)
    else:
        log(f"checkpoint was written by {len(blob['rng'])} process(es): RNG streams start afresh")
    log(f"resumed from {path} (step {state.step}, epoch {state.epoch + 1})")
    return state


# -- mixed precision -------------------------------------------------------------------------------
def mixed_precision(amp: str, device: torch.device) -> tuple[torch.dtype | None, torch.amp.GradScaler]:
    """The autocast dtype for ``train.amp`` (None: float32) and the gradient scaler (active for
    fp16 only: bf16 has float32's range). ``auto``: bf16 on CUDA, none elsewhere."""
    amp = amp if amp != "auto" else ("bf16" if device.type == "cuda" else "none")
    if amp != "none" and device.type != "cuda":
        raise ConfigError(f"train.amp = {amp!r} needs CUDA; use 'none' or 'auto' on CPU")
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp)
    return amp_dtype, torch.amp.GradScaler("cuda", enabled=amp == "fp16")
