"""The training module: loss, schedule, the loop (loss falls, exact resume mid-epoch from prepared
data, checkpoint averaging, export), DDP with two processes, evaluation, and clear errors."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from model.checkpoint import read_info
from model.translator import Translator
from tests.corpora import REPO, TINY, tiny_config, write_corpus
from training import evaluate as evaluate_cli
from training import train as train_cli
from training.checkpoints import average_checkpoints, checkpoint_paths
from training.config import ConfigError, TrainConfig
from training.loss import label_smoothed_nll
from training.setup import inverse_sqrt_schedule
from training.train import TrainResult, train


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def trained(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[TrainResult, Path]:
    out = tmp_path_factory.mktemp("run")
    return train(tiny_config(corpus, epochs=3, max_steps=0), out), out


# -- loss and schedule -----------------------------------------------------------------------------
def test_label_smoothed_loss_matches_torch_cross_entropy() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11)
    target = torch.randint(1, 11, (3, 5))
    target[0, 3:] = 0  # padding is ignored
    for eps in (0.0, 0.1):
        loss, nll = label_smoothed_nll(logits, target, eps, pad_id=0)
        ref = F.cross_entropy(
            logits.view(-1, 11), target.view(-1), ignore_index=0, reduction="sum", label_smoothing=eps
        )
        assert torch.allclose(loss, ref, atol=1e-4)
        plain = F.cross_entropy(logits.view(-1, 11), target.view(-1), ignore_index=0, reduction="sum")
        assert torch.allclose(nll, plain, atol=1e-4)


def test_schedule_warms_up_linearly_then_decays_as_inverse_sqrt() -> None:
    f = inverse_sqrt_schedule(100)
    assert f(0) == pytest.approx(0.01) and f(49) == pytest.approx(0.5)
    assert f(99) == pytest.approx(1.0)
    assert f(399) == pytest.approx(0.5)  # sqrt(100 / 400)


# -- the loop --------------------------------------------------------------------------------------
def test_training_loss_falls_and_logs(trained: tuple[TrainResult, Path]) -> None:
    _, out = trained
    records = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    assert len(losses) >= 4
    assert losses[-1] < losses[0] - 1.0, losses
    valid = [r for r in records if r["kind"] == "valid"]
    assert [r["epoch"] for r in valid] == [1, 2, 3]
    assert valid[-1]["valid_loss"] < valid[0]["valid_loss"]
    assert (out / "training_curve.png").read_bytes()[:4] == b"\x89PNG"


def test_export_averages_the_last_checkpoints_and_loads(trained: tuple[TrainResult, Path]) -> None:
    result, out = trained
    assert result.model_dir == out / "model"
    info = read_info(out / "model")
    assert info.source_lang == "de" and info.target_lang == "en"
    assert info.training["steps"] == result.state.step
    # tiny.toml keeps 3 checkpoints and averages the last 2. The mean is computed here, not by
    # average_checkpoints: a bug there (the wrong divisor, the wrong checkpoints) would otherwise
    # be compared with itself.
    paths = checkpoint_paths(out)
    assert len(paths) == 3 and info.training["averaged_checkpoints"] == [p.name for p in paths[-2:]]
    states = [torch.load(p, weights_only=True, map_location="cpu")["model"] for p in paths]
    exported = load_file(str(out / "model" / "model.safetensors"))
    assert exported.keys() == states[-1].keys()
    for k, v in exported.items():
        # In float64 the mean of two float32 numbers is exact, so its float32 rounding is the one answer.
        mean = torch.stack([s[k].double() for s in states[-2:]]).mean(0).float()
        assert torch.equal(v, mean), k
    assert any(not torch.equal(exported[k], states[-1][k]) for k in exported)  # not the last alone
    translator = Translator.load(out / "model", device="cpu")
    assert translator.translate_batch(["Ein Mann läuft."], beam_size=2)[0].hypotheses[0]


def test_average_checkpoints_is_the_mean_of_each_weight(tmp_path: Path) -> None:
    """Known weights, known means: every tensor of the model state, not only the first."""
    paths = []
    for i, (w, b) in enumerate([([1.0, -2.0], 0.5), ([2.0, 4.0], 1.5), ([6.0, 1.0], 4.0)]):
        paths.append(tmp_path / f"step_{i}.pt")
        torch.save({"model": {"w": torch.tensor(w), "b": torch.tensor([b])}, "step": i}, paths[-1])
    averaged = average_checkpoints(paths)
    assert averaged.keys() == {"w", "b"}
    assert torch.equal(averaged["w"], torch.tensor([3.0, 1.0]))
    assert torch.equal(averaged["b"], torch.tensor([2.0]))
    assert averaged["w"].dtype == torch.float32
    last_two = average_checkpoints(paths[1:])
    assert torch.equal(last_two["w"], torch.tensor([4.0, 2.5]))
    assert torch.equal(last_two["b"], torch.tensor([2.75]))


def test_resume_mid_epoch_from_prepared_data_continues_exactly(corpus: Path, tmp_path: Path) -> None:
    # small pools: the interruption falls inside an epoch, several pools into it
    overrides = {"epochs": 20, "checkpoint_every": 7, "accum_steps": 2, "shuffle_pool": 64}
    straight = train(tiny_config(corpus, max_steps=24, **overrides), tmp_path / "a")
    train(tiny_config(corpus, max_steps=11, **overrides), tmp_path / "b")  # "interrupted" mid-epoch
    (prepared,) = (tmp_path / "b" / "prepared").glob("data-*")
    stamp = (prepared / "manifest.json").stat().st_mtime_ns
    resumed = train(tiny_config(corpus, max_steps=24, **overrides), tmp_path / "b", resume=True)
    assert resumed.state.step == straight.state.step == 24
    assert resumed.state.epoch == straight.state.epoch
    assert straight.state.batch_in_epoch > 0  # it ended mid-epoch too
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    log = (tmp_path / "b" / "train_log.jsonl").read_text().splitlines()
    keys = [(rec["kind"], rec["step"]) for rec in map(json.loads, log)]
    assert len(keys) == len(set(keys))  # the log holds no duplicate lines from the interrupted run
    # the resumed run read the same prepared arrays: not prepared again
    assert [p.name for p in (tmp_path / "b" / "prepared").glob("data-*")] == [prepared.name]
    assert (prepared / "manifest.json").stat().st_mtime_ns == stamp


def test_resume_refuses_another_vocabulary(corpus: Path, tmp_path: Path, spm_model: Path) -> None:
    train(tiny_config(corpus, max_steps=3), tmp_path)
    cfg = tiny_config(corpus, max_steps=6)
    cfg.data.spm_model = str(spm_model)  # not the one the checkpoints were trained with
    with pytest.raises(ConfigError, match="trained with another vocabulary"):
        train(cfg, tmp_path, resume=True)


def run_ddp(data_dir: Path, out: Path, timeout: float = 300) -> tuple[int, str]:
    """tests/ddp_worker.py in two processes under torchrun: (exit status, stderr)."""
    # PYTHONPATH: the workers import this checkout's code, not whichever one the venv has installed
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += [str(REPO / "tests" / "ddp_worker.py"), str(TINY), str(data_dir), str(out)]
    # A session of its own, so that on a hang the workers die with the launcher.
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        _, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, stderr


def test_ddp_two_processes_end_with_identical_weights(corpus: Path, tmp_path: Path) -> None:
    code, stderr = run_ddp(corpus, tmp_path)
    assert code == 0, stderr[-3000:]
    w0, w1 = load_file(str(tmp_path / "rank0.safetensors")), load_file(str(tmp_path / "rank1.safetensors"))
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    assert read_info(tmp_path / "model").training["world_size"] == 2
    assert len(list((tmp_path / "prepared").glob("data-*"))) == 1  # prepared once, read by both ranks
    torch.manual_seed(TrainConfig.load(TINY).train.seed)  # the weights moved away from the shared init
    assert any(
        not torch.equal(w0[k], v)
        for k, v in Translator.load(tmp_path / "model", device="cpu").model.state_dict().items()
    )


def test_ddp_a_failed_preparation_stops_every_process(tmp_path: Path) -> None:
    # the main process prepares while the other waits on a group without a practical timeout: its
    # failure must reach the other process, not leave it waiting
    code, stderr = run_ddp(tmp_path / "no-such-data", tmp_path / "out", timeout=120)
    assert code != 0
    assert "train.de[.gz]: file not found" in stderr and "the main process failed" in stderr, stderr[-3000:]


# -- command lines ---------------------------------------------------------------------------------
def test_evaluate_cli_prints_bleu_and_chrf_with_signatures(
    trained: tuple[TrainResult, Path], corpus: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, out = trained
    args = ["--model", str(out / "model"), "--src", str(corpus / "val.de"), "--ref", str(corpus / "val.en")]
    assert evaluate_cli.main([*args, "--beam-size", "2", "--json"]) == 0
    scores = json.loads(capsys.readouterr().out)
    assert 0.0 <= scores["bleu"] <= 100.0 and scores["chrf"] > 0.0
    assert "tok:13a" in scores["bleu_signature"] and "nc:6" in scores["chrf_signature"]
    assert scores["sentences"] == 30


def test_evaluate_cli_rejects_misaligned_files(
    trained: tuple[TrainResult, Path], corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, out = trained
    ref = tmp_path / "short.en"
    ref.write_text("a man\n")
    assert (
        evaluate_cli.main(["--model", str(out / "model"), "--src", str(corpus / "val.de"), "--ref", str(ref)])
        == 2
    )
    assert "30 source lines but 1 reference lines" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("unknown_key", "unknown key(s): learning_rate"),
        ("bad_toml", "not valid TOML"),
        ("bad_type", "[train] epochs: expected int"),
        ("missing_config", "config file not found"),
        ("missing_data", "train.de[.gz]: file not found"),
        ("misaligned", "files are not parallel"),
    ],
)
def test_train_cli_bad_input_gives_a_clear_error(
    case: str, message: str, corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "c.toml"
    text = TINY.read_text()
    data_dir = corpus
    if case == "unknown_key":
        text = text.replace("[train]", "[train]\nlearning_rate = 1.0")
    elif case == "bad_toml":
        text += "\n[train\n"
    elif case == "bad_type":
        text = text.replace("epochs = 1", 'epochs = "one"')
    elif case == "missing_config":
        config = tmp_path / "nope.toml"
    elif case == "missing_data":
        data_dir = tmp_path / "empty"
        data_dir.mkdir()
    elif case == "misaligned":
        (tmp_path / "bad").mkdir()
        data_dir = write_corpus(tmp_path / "bad", n_train=20)
        (data_dir / "train.en").write_text("only one line\n")
    if case != "missing_config":
        config.write_text(text)
    code = train_cli.main(
        ["--config", str(config), "--data-dir", str(data_dir), "--out", str(tmp_path / "out")]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert message in err, err
    assert "Traceback" not in err


def test_multi30k_config_is_valid() -> None:
    cfg = TrainConfig.load(REPO / "training" / "configs" / "multi30k_de_en.toml")
    assert (cfg.data.source_lang, cfg.data.target_lang) == ("de", "en")
    assert cfg.model.tie_output and math.isclose(cfg.train.label_smoothing, 0.1)
