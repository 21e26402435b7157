"""The command-line translator (python -m model.translate / nmt-translate)."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from model.checkpoint import ModelInfo, save_model_dir
from model.decoding import cli as translate
from model.tokenizer import Tokenizer
from model.translate import main
from model.translator import Translator
from tests.conftest import random_model
from tests.test_server import running_server

REPO = Path(__file__).resolve().parents[1]


# What the tests' ``translator`` fixture runs (the CLI's defaults are the service's: int8 on CPU,
# the compiled step).
FLOAT32_EAGER = ("--quantization", "none", "--no-compile")


def argv(
    model: Path, *extra: str, src: Path | None = None, out: Path | None = None, float32_eager: bool = True
) -> list[str]:
    """The CLI's arguments for ``model`` on the CPU (the ``translator`` fixture's float32 eager step
    unless not ``float32_eager``), reading ``src`` and writing ``out`` where given, then ``extra``."""
    args = ["--model", str(model)]
    if src is not None:
        args += ["--input", str(src)]
    if out is not None:
        args += ["--output", str(out)]
    return [*args, "--device", "cpu", *(FLOAT32_EAGER if float32_eager else ()), *extra]


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
        chunks.append((len(texts), self.capacity))
        return translate_batch(self, texts, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(translate, "CHUNK_LINES", 4)
    monkeypatch.setattr(Translator, "translate_batch", spy)
    src, out = tmp_path / "in.txt", tmp_path / "out.txt"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert main(argv(model_dir, "--beam-size", "2", "--batch-size", "3", src=src, out=out)) == 0
    monkeypatch.undo()

    got = out.read_text(encoding="utf-8").split("\n")
    assert got[-1] == "" and len(got) - 1 == len(lines)  # one line out per line in, newline-terminated
    assert got[:-1] == expected(translator, lines, beam_size=2)
    assert [i for i, t in enumerate(got[:-1]) if not t] == [1, 3, 6]  # blank in, blank out
    assert all(got[i] for i in (0, 2, 4, 5, 7, 8))
    assert chunks == [(4, 3), (4, 3), (1, 3)]  # streamed in chunks, --batch-size passed through
    err = capsys.readouterr().err
    assert f"{len(lines)}/{len(lines)}" in err  # the progress bar, on stderr


def test_gzip_crlf_and_no_final_newline(
    model_dir: Path, translator: Translator, lines: list[str], tmp_path: Path
) -> None:
    src, out = tmp_path / "in.txt.gz", tmp_path / "out.txt.gz"
    with gzip.open(src, "wb") as f:
        f.write(("\r\n".join(lines)).encode("utf-8"))  # Windows line ends, last line unterminated
    assert main(argv(model_dir, "--beam-size", "1", "--no-progress", src=src, out=out)) == 0
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
    assert main(argv(model_dir, "--beam-size", "3", src=src)) == 0
    assert capsys.readouterr().out.split("\n")[:-1] == expected(translator, lines, beam_size=3)


def test_subprocess_reads_stdin(model_dir: Path, translator: Translator, lines: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "model.translate", *argv(model_dir, "--beam-size", "2")],
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
    assert main(argv(model_dir, src=src, out=out)) == 0
    assert out.read_text() == "\n\n\n"


def test_empty_input(model_dir: Path, tmp_path: Path) -> None:
    src, out = tmp_path / "in.txt", tmp_path / "out.txt"
    src.write_text("")
    assert main(argv(model_dir, src=src, out=out)) == 0
    assert out.read_text() == ""


# -- errors: one line on stderr, exit status 2, no traceback ---------------------------------------


def assert_clean_error(capsys: pytest.CaptureFixture[str], *needles: str) -> None:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.startswith("nmt-translate: error: ") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err


def test_missing_model_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv(tmp_path / "no-such-model")) == 2
    assert_clean_error(capsys, "no-such-model")


def test_broken_model_dir(model_dir_copy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (model_dir_copy / "model.safetensors").write_bytes(b"garbage" * 100)
    src, out = tmp_path / "in.txt", tmp_path / "out.txt"
    src.write_text("Ein Mann.\n")
    assert main(argv(model_dir_copy, src=src, out=out)) == 2
    assert_clean_error(capsys, "model.safetensors")
    assert not out.exists()  # nothing is written when the model cannot be loaded


def test_model_dir_without_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv(tmp_path)) == 2
    assert_clean_error(capsys, "config.json")


def test_missing_input_file(model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv(model_dir, src=tmp_path / "missing.txt")) == 2
    assert_clean_error(capsys, "missing.txt")


def test_invalid_utf8_names_the_line(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src, out = tmp_path / "in.txt", tmp_path / "out.txt"
    src.write_bytes("Ein Mann läuft.\n".encode() + b"caf\xe9 latin-1\n" + b"Ein Hund.\n")
    assert main(argv(model_dir, "--no-progress", src=src, out=out)) == 2
    assert_clean_error(capsys, "line 2", "UTF-8")


def test_corrupt_gzip_input(model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "in.txt.gz"
    src.write_bytes(b"this is not gzip data\n")
    assert main(argv(model_dir, "--no-progress", src=src, out=tmp_path / "o", float32_eager=False)) == 2
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


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory: pytest.TempPathFactory, spm_model: Path, tokenizer: Tokenizer) -> Path:
    """A model with room for 512 positions: longer than the decoding's input limit (250 tokens)."""
    model = random_model(seed=4, sharpen=2.0, vocab_size=tokenizer.vocab_size, max_positions=512)
    info = ModelInfo(config=model.cfg, source_lang="de", target_lang="en")
    return save_model_dir(tmp_path_factory.mktemp("long") / "long-de-en", model, info, spm_model)


def test_the_cli_and_the_service_translate_alike_long_inputs_included(
    long_model_dir: Path, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    """The same lines through ``python -m model.translate`` and the HTTP service, both with their
    defaults (DecodeOptions): the same translations, a line of ~400 tokens included (cut at 250
    source tokens by both; one sentence, so that the service does not split it), and lines with
    placeholders (kept by both by default) and a glossary term (the same glossary given to both)."""
    words = ["Hund", "Katze", "Haus", "Baum", "Wasser", "Straße", "Mann", "Frau", "Kind", "Ball"]
    long_line = " ".join(words[i % len(words)] for i in range(300))
    assert len(tokenizer.encode([long_line])[0]) > 300
    lines = ["Ein Hund läuft im Park", long_line, "Zwei Kinder spielen", long_line[: len(long_line) // 3]]
    lines.append("Ein Hund mit {name} läuft 42 Mal")
    src = tmp_path / "in.txt"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    glossary = tmp_path / "glossary.tsv"
    glossary.write_text("Park\tgarden\n", encoding="utf-8")
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "model.translate",
            *argv(long_model_dir, "--beam-size", "2", "--no-progress", "--glossary", str(glossary), src=src),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        check=True,
    ).stdout.split("\n")[:-1]
    env = {
        "NMT_MODEL_DIR": str(long_model_dir),
        "NMT_DEFAULT_BEAM_SIZE": "2",
        "NMT_QUANTIZATION": "none",
        "NMT_COMPILE": "false",
    }
    with running_server(tmp_path / "uvicorn.log", **env) as server:
        response = httpx.post(
            f"{server.url}/translate",
            json={
                "q": lines,
                "source": "de",
                "target": "en",
                "glossary": [{"source": "Park", "target": "garden"}],
            },
            timeout=120,
        )
    assert response.status_code == 200, response.text
    assert response.json()["translatedText"] == cli
    assert "garden" in cli[0] and "{name}" in cli[4] and "42" in cli[4]
    assert len(set(cli)) >= 3  # the test means something: the lines translate differently
