"""The command-line translator (python -m model.translate / nmt-translate)."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
from pathlib import Path

import pytest

from model import translate
from model.translate import main
from model.translator import Translator

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def lines(sentences: list[str]) -> list[str]:
    """Input lines: sentences of different lengths with blank and whitespace-only lines between."""
    s = sentences
    return [s[0], "", s[1], "   ", s[2], s[3], "", s[4], s[0]]


def expected(translator: Translator, lines: list[str], beam_size: int) -> list[str]:
    return [r.hypotheses[0] for r in translator.translate_batch(lines, beam_size=beam_size)]


def test_file_to_file_in_chunks(
    model_dir: Path,
    translator: Translator,
    lines: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    chunks: list[tuple[int, int]] = []
    translate_batch = Translator.translate_batch

    def spy(self: Translator, texts: list[str], **kwargs: int) -> object:
        chunks.append((len(texts), kwargs["max_batch_size"]))
        return translate_batch(self, texts, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(translate, "CHUNK_LINES", 4)
    monkeypatch.setattr(Translator, "translate_batch", spy)
    src, out = tmp_path / "in.txt", tmp_path / "out.txt"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    argv = ["--model", str(model_dir), "--input", str(src), "--output", str(out), "--device", "cpu"]
    assert main([*argv, "--beam-size", "2", "--batch-size", "2"]) == 0
    monkeypatch.undo()

    got = out.read_text(encoding="utf-8").split("\n")
    assert got[-1] == "" and len(got) - 1 == len(lines)  # one line out per line in, newline-terminated
    assert got[:-1] == expected(translator, lines, beam_size=2)
    assert [i for i, t in enumerate(got[:-1]) if not t] == [1, 3, 6]  # blank in, blank out
    assert all(got[i] for i in (0, 2, 4, 5, 7, 8))
    assert chunks == [(4, 2), (4, 2), (1, 2)]  # streamed in chunks, --batch-size passed through
    err = capsys.readouterr().err
    assert f"{len(lines)}/{len(lines)}" in err  # the progress bar, on stderr


def test_gzip_crlf_and_no_final_newline(
    model_dir: Path, translator: Translator, lines: list[str], tmp_path: Path
) -> None:
    src, out = tmp_path / "in.txt.gz", tmp_path / "out.txt.gz"
    with gzip.open(src, "wb") as f:
        f.write(("\r\n".join(lines)).encode("utf-8"))  # Windows line ends, last line unterminated
    argv = ["--model", str(model_dir), "--input", str(src), "--output", str(out), "--device", "cpu"]
    assert main([*argv, "--beam-size", "1", "--no-progress"]) == 0
    with gzip.open(out, "rt", encoding="utf-8") as f:
        got = f.read().split("\n")
    assert got[:-1] == expected(translator, lines, beam_size=1)


def test_stdout_output(
    model_dir: Path,
    translator: Translator,
    lines: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    src = tmp_path / "in.txt"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert main(["--model", str(model_dir), "--input", str(src), "--device", "cpu", "--beam-size", "3"]) == 0
    assert capsys.readouterr().out.split("\n")[:-1] == expected(translator, lines, beam_size=3)


def test_subprocess_reads_stdin(model_dir: Path, translator: Translator, lines: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "model.translate",
            "--model",
            str(model_dir),
            "--device",
            "cpu",
            "--beam-size",
            "2",
        ],
        input="\n".join(lines) + "\n",
        capture_output=True,
        text=True,
        encoding="utf-8",
        cwd=REPO,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:-1] == expected(translator, lines, beam_size=2)
    assert "%|" not in proc.stderr  # no progress bar when reading stdin


def test_all_blank_input(model_dir: Path, tmp_path: Path) -> None:
    src, out = tmp_path / "in.txt", tmp_path / "out.txt"
    src.write_text("\n \n\n")
    assert (
        main(["--model", str(model_dir), "--input", str(src), "--output", str(out), "--device", "cpu"]) == 0
    )
    assert out.read_text() == "\n\n\n"


def test_empty_input(model_dir: Path, tmp_path: Path) -> None:
    src, out = tmp_path / "in.txt", tmp_path / "out.txt"
    src.write_text("")
    assert (
        main(["--model", str(model_dir), "--input", str(src), "--output", str(out), "--device", "cpu"]) == 0
    )
    assert out.read_text() == ""


# -- errors: one line on stderr, exit status 2, no traceback ---------------------------------------


def assert_clean_error(capsys: pytest.CaptureFixture[str], *needles: str) -> None:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.startswith("nmt-translate: error: ") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err


def test_missing_model_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", str(tmp_path / "no-such-model"), "--device", "cpu"]) == 2
    assert_clean_error(capsys, "no-such-model")


def test_broken_model_dir(model_dir_copy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (model_dir_copy / "model.safetensors").write_bytes(b"garbage" * 100)
    src, out = tmp_path / "in.txt", tmp_path / "out.txt"
    src.write_text("Ein Mann.\n")
    assert (
        main(["--model", str(model_dir_copy), "--input", str(src), "--output", str(out), "--device", "cpu"])
        == 2
    )
    assert_clean_error(capsys, "model.safetensors")
    assert not out.exists()  # nothing is written when the model cannot be loaded


def test_model_dir_without_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", str(tmp_path), "--device", "cpu"]) == 2
    assert_clean_error(capsys, "config.json")


def test_missing_input_file(model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", str(model_dir), "--input", str(tmp_path / "missing.txt"), "--device", "cpu"]) == 2
    assert_clean_error(capsys, "missing.txt")


def test_invalid_utf8_names_the_line(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src, out = tmp_path / "in.txt", tmp_path / "out.txt"
    src.write_bytes("Ein Mann läuft.\n".encode() + b"caf\xe9 latin-1\n" + b"Ein Hund.\n")
    argv = ["--model", str(model_dir), "--input", str(src), "--output", str(out), "--device", "cpu"]
    assert main([*argv, "--no-progress"]) == 2
    assert_clean_error(capsys, "line 2", "UTF-8")


def test_corrupt_gzip_input(model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "in.txt.gz"
    src.write_bytes(b"this is not gzip data\n")
    argv = [
        "--model",
        str(model_dir),
        "--input",
        str(src),
        "--output",
        str(tmp_path / "o"),
        "--device",
        "cpu",
    ]
    assert main([*argv, "--no-progress"]) == 2
    assert_clean_error(capsys, "in.txt.gz")


@pytest.mark.parametrize(
    "args", [["--beam-size", "0"], ["--batch-size", "x"], ["--dtype", "float64"], ["--unknown"]], ids=str
)
def test_bad_arguments(model_dir: Path, args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", str(model_dir), *args]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_cuda_requested_without_cuda(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    assert main(["--model", str(model_dir), "--device", "cuda"]) == 2
    assert_clean_error(capsys, "CUDA")
