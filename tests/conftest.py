"""Shared fixtures: a tiny SentencePiece model, tiny random Transformers and a tiny model directory.

Everything is generated here (synthetic sentences, random weights), so the tests need no dataset,
no download and no GPU, and run in seconds on a laptop CPU.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from model.checkpoint import ModelInfo, save_model_dir
from model.config import ModelConfig
from model.tokenizer import Tokenizer
from model.transformer import Transformer
from model.translator import Translator


def compile_cache_dir() -> Path:
    """Where the tests keep compiled decoding steps (``NMT_COMPILE_CACHE_DIR``, set for the session
    by ``pytest_configure``): each model and setting is compiled once per run, whichever test and
    process (test servers inherit the variable) needs it first."""
    return Path(os.environ["NMT_COMPILE_CACHE_DIR"])


def needs_cpu_package() -> None:
    """Skip a test of the CPU's compiled step where it is not made: under a torch other than the
    one it was tested with (``model.runtime.runners.PACKAGED_TORCH``; a GPU machine's own torch).
    CI installs that torch, so there it never skips."""
    from model.runtime.runners import PACKAGED_TORCH, packaged_runs_under

    if not packaged_runs_under(torch.__version__):
        pytest.skip(f"the CPU package is made under torch {PACKAGED_TORCH} only, not {torch.__version__}")


def under_ci() -> bool:
    """Whether CI runs the tests: ``CI`` set and not "0"/"false" (.ci/run exports CI=1, as CI services
    do). CI provides every system tool and dataset the tests use, so there a missing one fails;
    elsewhere the test that needs it is skipped, or says in its id what it runs on instead."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def pytest_configure(config: pytest.Config) -> None:
    if "NMT_COMPILE_CACHE_DIR" not in os.environ:
        os.environ["NMT_COMPILE_CACHE_DIR"] = tempfile.mkdtemp(prefix="nmt-compiled-")
    # Services started by the tests encode eagerly: compiling each test model's encoder would take
    # ~15 s of a core a model, beside the tests. The compiled encoder gives the eager one's bits
    # (tests/test_compiled_encoder.py, which compiles it, and the server test that serves with it).
    os.environ.setdefault("NMT_COMPILE_ENCODER", "false")


# The models here are tiny: thread start-up and synchronisation cost more than the arithmetic, and
# on a shared 2-core CI runner several threads per op make every decoding step 10-30x slower.
torch.set_num_threads(1)

_DE = (
    "ein mann eine frau zwei kinder hund katze spielt läuft sitzt steht auf dem der die das im park "
    "straße wasser ball rot blau grün großen kleinen hält trägt schaut vor einem gebäude mit hut"
)
_EN = (
    "a man woman two children dog cat plays runs sits stands on the in park street water ball red "
    "blue green big small holds wears looks at front of building with hat"
)


def synthetic_sentences(n: int, seed: int = 0) -> list[str]:
    """``n`` short German- and English-looking sentences (random word salad is enough for SentencePiece)."""
    rng = random.Random(seed)
    vocabularies = _DE.split(), _EN.split()
    out = []
    for i in range(n):
        words = vocabularies[i % 2]
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(2, 12)))
        out.append(sentence[0].upper() + sentence[1:] + rng.choice([".", "", "!"]))
    return out


# Sentences of clearly different token lengths, for batching / padding tests.
SENTENCES = [
    "Ein Mann spielt.",
    "Zwei kleinen Kinder sitzen auf dem roten Ball vor einem großen Gebäude im Park mit Hut.",
    "Eine Katze",
    "Der Hund läuft im Wasser und schaut auf die Straße.",
    "Ein",
]


@pytest.fixture
def jobs(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every sentence (``Sentence``) the scheduler is given during the test, as the workers get it."""
    from app.serving.frontend.scheduler import Scheduler

    given: list[Any] = []
    submit = Scheduler.submit

    def spy(self: Scheduler, *args: Any, **kwargs: Any) -> Any:
        request = submit(self, *args, **kwargs)
        given.extend(state.message for state in request.sentences)
        return request

    monkeypatch.setattr(Scheduler, "submit", spy)
    return given


@pytest.fixture
def sentences() -> list[str]:
    """``SENTENCES``: inputs of clearly different token lengths, for batching and padding tests."""
    return list(SENTENCES)


@pytest.fixture(scope="session")
def spm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A joint unigram SentencePiece model trained on 400 synthetic sentences (well under a second)."""
    prefix = tmp_path_factory.mktemp("spm") / "spm"
    return Tokenizer.train(synthetic_sentences(400), prefix, vocab_size=120)


@pytest.fixture(scope="session")
def tokenizer(spm_model: Path) -> Tokenizer:
    return Tokenizer(spm_model)


def tiny_config(**overrides: object) -> ModelConfig:
    """A Transformer small enough to decode hundreds of steps per second on one CPU core."""
    base: dict[str, object] = {
        "vocab_size": 64,
        "d_model": 32,
        "n_heads": 4,
        "encoder_layers": 2,
        "decoder_layers": 2,
        "d_ff": 64,
        "dropout": 0.1,  # non-zero so that a test forgetting eval() would see random outputs
        "max_positions": 128,
    }
    base.update(overrides)
    return ModelConfig(**base)  # type: ignore[arg-type]


def random_model(
    seed: int = 0, *, sharpen: float = 1.0, eos_boost: float = 1.0, **overrides: object
) -> Transformer:
    """A random-weight Transformer (``tiny_config(**overrides)``) in eval mode.

    ``sharpen`` scales the output projection so next-token distributions are peaked rather than
    near-uniform: the argmax then has wide margins, so that batched and unbatched decoding (whose
    float rounding differs by ~1e-6) are very unlikely to meet a near-tie and pick different tokens.
    ``eos_boost`` scales eos's row of it so that some outputs end before their length limit.
    """
    torch.manual_seed(seed)
    model = Transformer(tiny_config(**overrides))
    proj = model.out_proj.weight if model.out_proj is not None else model.embed.weight
    with torch.no_grad():
        proj.mul_(sharpen)
        proj[model.cfg.eos_id].mul_(eos_boost)
    return model.eval()


@pytest.fixture
def make_model() -> Callable[..., Transformer]:
    """Factory fixture: ``make_model(seed=0, pre_norm=True, ...)`` builds a tiny random Transformer."""
    return random_model


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory, spm_model: Path, tokenizer: Tokenizer) -> Path:
    """A complete model directory with random weights (read-only for tests: copy it to modify it)."""
    # Untied output projection, sharpened, eos boosted: with these weights (seed 1) outputs are
    # non-degenerate and some end with eos while others run to their length limit.
    model = random_model(
        seed=1,
        sharpen=2.0,
        eos_boost=1.5,
        vocab_size=tokenizer.vocab_size,
        pre_norm=True,
        share_embeddings=False,
        tie_output=False,
    )
    info = ModelInfo(
        config=model.cfg, source_lang="de", target_lang="en", training={"note": "random weights"}
    )
    return save_model_dir(tmp_path_factory.mktemp("model") / "tiny-de-en", model, info, spm_model)


@pytest.fixture
def model_dir_copy(model_dir: Path, tmp_path: Path) -> Path:
    """A private copy of ``model_dir`` that a test may damage."""
    return Path(shutil.copytree(model_dir, tmp_path / "model"))


@pytest.fixture(scope="session")
def translator(model_dir: Path) -> Translator:
    return Translator.load(model_dir, device="cpu")


@pytest.fixture(scope="session")
def marian_dirs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Any], tuple[Path, Path]]:
    """``marian_dirs(MarianOptions(...))``: (a small transformers MarianMTModel directory trained
    here, tests/marian_models.py; the model directory ``model.convert.marian`` makes of it), made
    once per session for each set of options: the converter's tests and the serving tests share
    them (each takes seconds of training)."""
    from model.convert.marian import convert
    from tests.marian_models import make_marian_dir

    root = tmp_path_factory.mktemp("marian")
    made: dict[Any, tuple[Path, Path]] = {}

    def get(options: Any) -> tuple[Path, Path]:
        if options not in made:
            name = f"opus-mt-{len(made)}"
            hf = make_marian_dir(root / name, options, cache=root / "spm")
            made[options] = hf, convert(hf, root / f"{name}-ours", command="test")
        return made[options]

    return get


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One real Redis for the session (tests/redis_server.py); each test that uses it clears it."""
    from tests.redis_server import running_redis

    with running_redis(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[Any]:
    """One real PostgreSQL for the session (tests/postgres_server.py), in a directory of its own
    under /tmp (pytest's are private to root, which the ``postgres`` user could not enter); each
    test that uses it starts from an empty database (``tests.postgres_server.reset``)."""
    from tests.postgres_server import running_postgres

    directory = Path(tempfile.mkdtemp(prefix="nmt-postgres-"))
    try:
        with running_postgres(directory) as server:
            yield server
    finally:
        shutil.rmtree(directory, ignore_errors=True)
