"""Train a Transformer on parallel text and export a model directory.

    python -m training.train --config training/configs/multi30k_de_en.toml [--data-dir D] [--out D] [--resume]
    python -m training.train --init MODEL_DIR --data-dir D [--config C] [--out D] [--resume]   # fine-tune
    torchrun --nproc_per_node N -m training.train --config ...      # data parallel (gloo on CPU, NCCL on GPU)

The raw parallel files are prepared into token arrays on disk on first use (training.prepare;
cached, reused by later runs and by --resume). Output directory: sentencepiece.model,
train_log.jsonl, training_curve.png, checkpoints/step_*.pt (training state: model, optimizer,
scheduler, step, data position, RNG), prepared/ (the cached prepared data, unless data.prepared_dir
says elsewhere), and model/ (the exported model directory, weights averaged over the last
checkpoints).

``--init MODEL_DIR`` fine-tunes that model instead (``training.finetune``): its architecture,
weights, tokenizer and special ids; the log's first validation (step 0) scores it as it was. The
output then has no sentencepiece.model of its own: the model's tokenizer files are copied into the
prepared corpus (tokenizer/) and into model/.

Getting ready to train (processes and devices, the prepared corpus, the model it starts from,
resuming, mixed precision) is ``training.setup``'s; the loop, the log and the export are here.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from model.checkpoint import ModelDirError, ModelInfo, save_model_dir
from model.transformer import Transformer
from training.checkpoints import (
    TrainState,
    average_checkpoints,
    checkpoint_paths,
    rng_state,
    save_checkpoint,
)
from training.config import ConfigError, TrainConfig, from_command_line
from training.data import Batch, DataError, PreparedCorpus, iterate
from training.evaluate import validate
from training.finetune import DEFAULT_CONFIG, attribution
from training.loss import label_smoothed_nll
from training.plot import plot_curve
from training.sampling import EpochPlan
from training.setup import (
    Dist,
    initial_model,
    inverse_sqrt_schedule,
    mixed_precision,
    open_corpus,
    read_init,
    restore,
    setup_distributed,
)


# -- the loop --------------------------------------------------------------------------------------
@dataclass
class TrainResult:
    model: Transformer  # this process's final weights (not averaged)
    model_dir: Path | None  # the exported model directory (main process only)
    state: TrainState
    valid: dict[str, float]


def train(
    cfg: TrainConfig, out: str | Path, *, resume: bool = False, init: str | Path | None = None
) -> TrainResult:
    """Train ``cfg`` into ``out``; ``init``: fine-tune that model directory (``training.finetune``)."""
    out = Path(out)
    p = cfg.train
    init = Path(init) if init is not None else None
    init_info = read_init(cfg, init)
    dist = setup_distributed(p.device)
    device = dist.device

    def log(msg: str) -> None:
        if dist.main:
            tqdm.write(msg, file=sys.stderr)

    if dist.main:
        out.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    corpus = open_corpus(cfg, out, dist, resume=resume, log=log, init=init)
    model, info = initial_model(cfg, corpus, dist, init, init_info, log)

    opt = torch.optim.Adam(
        model.parameters(), lr=p.lr, betas=p.adam_betas, eps=p.adam_eps, weight_decay=p.weight_decay
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, inverse_sqrt_schedule(p.warmup_steps))
    state = TrainState()
    ckpts = checkpoint_paths(out)
    if resume and ckpts:
        state = restore(ckpts[-1], model, opt, sched, corpus, dist, log)
    elif resume:
        log(f"--resume: no checkpoint in {out / 'checkpoints'}, starting from {init or 'scratch'}")
    log_path = out / "train_log.jsonl"
    if dist.main:
        _truncate_log(log_path, state.step)  # drop lines an interrupted run wrote after its last checkpoint
        if init is not None and state.step == 0:  # the initial model as it is: what fine-tuning improves on
            initial = validate(model, corpus, info, cfg.train, device)
            _append_log(log_path, {"kind": "valid", "step": 0, "epoch": 0, **initial})
            log(_describe_valid(0, 0, initial).replace("epoch 0", f"initial model {init}", 1))

    ddp = DistributedDataParallel(model) if dist.world > 1 else None
    net: nn.Module = ddp if ddp is not None else model
    amp_dtype, scaler = mixed_precision(p.amp, device)

    def plan(epoch: int) -> EpochPlan:
        """This process's batches of ``epoch`` (every process plans the same, and takes its share)."""
        sizes = [d.sizes for d in corpus.train]
        return EpochPlan(
            sizes,
            max_tokens=p.max_tokens,
            pool=p.shuffle_pool,
            seed=p.seed,
            epoch=epoch,
            temperature=cfg.data.sampling_temperature,
            rank=dist.rank,
            world=dist.world,
        )

    epoch_plan = plan(state.epoch)
    steps_per_epoch = len(epoch_plan)  # this epoch's; with several directions others differ a little
    total_steps = p.max_steps or p.epochs * math.ceil(steps_per_epoch / p.accum_steps)
    bar = tqdm(
        total=total_steps, initial=state.step, disable=not dist.main, mininterval=1.0, dynamic_ncols=True
    )
    valid: dict[str, Any] = {}
    last_ckpt_step = state.step if ckpts and resume else -1

    def checkpoint() -> None:
        nonlocal last_ckpt_step
        rng = [rng_state(device)]
        if dist.world > 1:  # every process's RNG, so that each resumes exactly where it was
            gathered: list[Any] = [None] * dist.world
            torch_dist.all_gather_object(gathered, rng[0])
            rng = gathered
        if dist.main:
            save_checkpoint(
                out, model, opt, sched, state, rng, p.keep_checkpoints, corpus.vocab_sha256, init=init
            )
        last_ckpt_step = state.step
        dist.barrier()

    window = {"loss": 0.0, "nll": 0.0, "tokens": 0, "time": time.perf_counter()}
    net.train()
    while state.epoch < p.epochs and not (p.max_steps and state.step >= p.max_steps):
        if epoch_plan.epoch != state.epoch:
            epoch_plan = plan(state.epoch)
        n_batches = len(epoch_plan)
        batches = iterate(corpus.train, epoch_plan, start=state.batch_in_epoch)
        while state.batch_in_epoch < n_batches:
            if p.max_steps and state.step >= p.max_steps:
                break
            t0 = time.perf_counter()
            group = list(itertools.islice(batches, p.accum_steps))
            loss, nll, ntok = _optimizer_step(
                net, ddp, opt, sched, scaler, group, p, amp_dtype, device, cfg.model.pad_id
            )
            state.train_time_s += time.perf_counter() - t0
            state.batch_in_epoch += len(group)
            state.step += 1
            window["loss"], window["nll"] = window["loss"] + loss, window["nll"] + nll
            window["tokens"] += ntok
            bar.update(1)
            if state.step % p.log_every == 0:
                rec = _log_window(window, state, float(sched.get_last_lr()[0]))
                bar.set_postfix(
                    loss=f"{rec['loss']:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}", lr=f"{rec['lr']:.2e}"
                )
                if dist.main:
                    _append_log(log_path, rec)
            if state.step % p.checkpoint_every == 0:
                checkpoint()
        if state.batch_in_epoch >= n_batches:  # the epoch is complete: validate, then move on
            if dist.main:
                valid = validate(model, corpus, info, cfg.train, device)
                _append_log(
                    log_path, {"kind": "valid", "step": state.step, "epoch": state.epoch + 1, **valid}
                )
                log(_describe_valid(state.epoch + 1, state.step, valid))
            state.epoch += 1
            state.batch_in_epoch = 0
            window["time"] = time.perf_counter()  # tokens/s measures training, not validation
            if p.epoch_checkpoints and last_ckpt_step != state.step:
                checkpoint()
            dist.barrier()
    bar.close()
    if last_ckpt_step != state.step:
        checkpoint()
    model_dir = None
    if dist.main:
        model_dir = _export(out, model, corpus, cfg, info, state, valid, dist, log, init, init_info)
        if log_path.exists():
            plot_curve(log_path, out / "training_curve.png")
    dist.barrier()
    return TrainResult(model=model, model_dir=model_dir, state=state, valid=valid)


def _optimizer_step(
    net: nn.Module,
    ddp: DistributedDataParallel | None,
    opt: torch.optim.Optimizer,
    sched: Any,
    scaler: torch.amp.GradScaler,
    batches: list[Batch],
    p: Any,
    amp_dtype: torch.dtype | None,
    device: torch.device,
    pad_id: int,
) -> tuple[float, float, int]:
    """Accumulate gradients over ``batches``, then one clipped Adam step. Returns summed loss, NLL, tokens."""
    ntok = sum(b.n_tokens for b in batches)
    loss_sum, nll_sum = 0.0, 0.0
    for i, batch in enumerate(batches):
        batch = batch.to(device)
        # Gradients are all-reduced only on the last batch of the group (DDP no_sync on the others).
        sync = nullcontext() if ddp is None or i == len(batches) - 1 else ddp.no_sync()
        autocast = torch.autocast("cuda", dtype=amp_dtype) if amp_dtype is not None else nullcontext()
        with sync, autocast:
            logits = net(batch.src, batch.tgt_in)
            loss, nll = label_smoothed_nll(logits, batch.tgt_out, p.label_smoothing, pad_id)
        scaler.scale(loss / ntok).backward()  # mean over the group's tokens
        loss_sum, nll_sum = loss_sum + float(loss.detach()), nll_sum + float(nll.detach())
    if p.clip_norm > 0:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(net.parameters(), p.clip_norm)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    sched.step()
    return loss_sum, nll_sum, ntok


def _log_window(window: dict[str, float], state: TrainState, lr: float) -> dict[str, Any]:
    now = time.perf_counter()
    tokens = max(int(window["tokens"]), 1)
    rec = {
        "kind": "train",
        "step": state.step,
        "epoch": state.epoch + 1,
        "loss": window["loss"] / tokens,
        "nll": window["nll"] / tokens,
        "ppl": math.exp(min(window["nll"] / tokens, 50.0)),
        "lr": lr,
        "tokens_per_s": window["tokens"] / max(now - window["time"], 1e-9),
    }
    window.update(loss=0.0, nll=0.0, tokens=0, time=now)
    return rec


def _describe_valid(epoch: int, step: int, valid: dict[str, Any]) -> str:
    text = f"epoch {epoch}: step {step} valid loss {valid['valid_loss']:.3f} BLEU {valid['valid_bleu']:.2f}"
    for name, scores in valid.get("directions", {}).items():
        text += f"\n  {name}: loss {scores['valid_loss']:.3f} BLEU {scores['valid_bleu']:.2f}"
        text += f" chrF {scores['valid_chrf']:.2f}"
    return text


def _append_log(path: Path, rec: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(rec) + "\n")


def _truncate_log(path: Path, step: int) -> None:
    if path.exists():
        keep = [ln for ln in path.read_text().splitlines() if ln and json.loads(ln)["step"] <= step]
        path.write_text("".join(ln + "\n" for ln in keep))


def _export(
    out: Path,
    model: Transformer,
    corpus: PreparedCorpus,
    cfg: TrainConfig,
    info: ModelInfo,
    state: TrainState,
    valid: dict[str, Any],
    dist: Dist,
    log: Callable[[str], None],
    init: Path | None = None,
    init_info: ModelInfo | None = None,
) -> Path:
    """Average the last checkpoints' weights into a copy of the model and write the model directory
    (fine-tuning: with the initial model's tokenizer files, and its record under "init")."""
    paths = checkpoint_paths(out)[-cfg.train.average_last :]
    export = Transformer(cfg.model)
    export.load_state_dict(average_checkpoints(paths))
    info.training = {
        "steps": state.step,
        "epochs": state.epoch,
        "train_pairs": corpus.train_pairs,
        "train_time_s": round(state.train_time_s, 1),
        "device": str(dist.device),
        "world_size": dist.world,
        "averaged_checkpoints": [p.name for p in paths],
        "data_dir": str(cfg.data.dir),
        "prepared_data": str(corpus.root),
        "last_valid": valid,
        "config": {"data": asdict(cfg.data), "train": asdict(cfg.train)},
    }
    dtype = torch.float16 if cfg.train.export_dtype == "float16" else torch.float32
    if info.is_multilingual:
        info.training["train_pairs_per_direction"] = {d.name: len(d) for d in corpus.train}
    if init is not None and init_info is not None:
        record = attribution(init, init_info)
        # Who made the weights this one starts from, and under which licence, at the top level too.
        info.training.update({k: record[k] for k in ("origin", "licence") if k in record})
        info.training["init"] = record
    path = save_model_dir(out / "model", export, info, corpus.tokenizer_source, dtype=dtype)
    log(f"exported {path} (average of {len(paths)} checkpoint(s))")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", help="TOML file with [data], [model] and [train] tables")
    ap.add_argument(
        "--init",
        help="fine-tune this model directory (its architecture, weights and tokenizer); "
        "--config defaults to training/configs/finetune.toml",
    )
    ap.add_argument("--data-dir", help="directory of {split}.{lang}[.gz] files (overrides data.dir)")
    ap.add_argument("--out", help="output directory (default: runs/<config name>)")
    ap.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    ap.add_argument(
        "--prepared-dir",
        help="where prepared data is cached, or a prepared corpus (overrides data.prepared_dir)",
    )
    args = ap.parse_args(argv)
    if args.config is None and args.init is None:
        ap.error("--config is required (or --init MODEL_DIR, to fine-tune)")
    if args.config is None and args.data_dir is None:
        ap.error("--init without --config: --data-dir says where the fine-tuning data is")
    config = args.config or str(DEFAULT_CONFIG)
    out_default = args.out or (f"runs/finetune-{Path(args.init).name}" if args.config is None else None)
    try:
        cfg, out = from_command_line(
            config, data_dir=args.data_dir, prepared_dir=args.prepared_dir, out=out_default
        )
        train(cfg, out, resume=args.resume, init=args.init)
    except (ConfigError, DataError, ModelDirError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if torch_dist.is_initialized():
            torch_dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
