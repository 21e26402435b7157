"""The CTranslate2 and Argos converters refuse crafted files by name, before allocating what the
files only declare (tests/test_convert_hostile_marian.py: the Marian converter).

Each hostile input is made here from a small valid one, changed in one place: a CTranslate2
``model.bin`` written byte by byte by ``write_model_bin`` (the layout ``model.convert.ct2_model``
documents, written independently of its reader), or an Argos package (a zip) holding one. The
valid one converts (so that each refusal is the change's); each changed one raises
``ConversionError`` whose message names the problem. The case the issue found (an int8 [1, N]
weight with an [N, 1] scale: a 320 KB file that broadcast to 16 GiB) runs in a child process under
an address-space limit, its peak memory and time measured.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from model.convert import argos
from model.convert.bounds import MAX_ARCHIVE_MEMBERS, MAX_VOCABULARY
from model.convert.ct2_model import read_model
from model.convert.ct2_transformer import from_ct2
from model.convert.errors import ConversionError

REPO = Path(__file__).resolve().parents[1]
D, HEADS, FF = 8, 2, 16  # the tiny models' width, heads and feed-forward width
VOCAB = ["<blank>", "<unk>", "<s>", "</s>", "a", "b", "c", "d"]
# CTranslate2's DataType ids (include/ctranslate2/types.h) of the dtypes written here.
DTYPE_IDS = {torch.float32: 0, torch.int8: 1, torch.int16: 2, torch.int32: 3}

# -- CTranslate2 model.bin, written byte by byte ----------------------------------------------------


def _string(text: str) -> bytes:
    raw = text.encode() + b"\0"  # the length counts the trailing NUL
    return struct.pack("<H", len(raw)) + raw


def record(name: str, shape: list[int], dtype_id: int, data: bytes, *, num_bytes: int | None = None) -> bytes:
    """One variable as binary version 6 stores it; ``num_bytes`` may lie about ``data``."""
    head = _string(name) + struct.pack("<B", len(shape)) + struct.pack(f"<{len(shape)}I", *shape)
    return head + struct.pack("<BI", dtype_id, len(data) if num_bytes is None else num_bytes) + data


def write_model_bin(
    path: Path, variables: dict[str, torch.Tensor], *, extra: bytes = b"", count: int | None = None
) -> None:
    """``variables`` (then the raw records ``extra``) as a version 6 TransformerSpec; ``count``
    overrides the number of variables the header declares."""
    records = [
        record(n, list(t.shape), DTYPE_IDS[t.dtype], t.contiguous().numpy().tobytes())
        for n, t in variables.items()
    ]
    declared = len(records) + (1 if extra else 0) if count is None else count
    header = (
        struct.pack("<I", 6) + _string("TransformerSpec") + struct.pack("<I", 7) + struct.pack("<I", declared)
    )
    path.write_bytes(header + b"".join(records) + extra + struct.pack("<I", 0))  # no aliases


def tiny_variables() -> dict[str, torch.Tensor]:
    """A post-norm 1+1-layer TransformerSpec (width 8, 2 heads, ffn 16, 8 tokens), float32 weights."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    v: dict[str, torch.Tensor] = {}
    for stack in ("encoder", "decoder"):
        v[f"{stack}/num_heads"] = torch.tensor(HEADS, dtype=torch.int16)
        v[f"{stack}/pre_norm"] = torch.tensor(0, dtype=torch.int8)
        v[f"{stack}/activation"] = torch.tensor(0, dtype=torch.int8)
        v[f"{stack}/scale_embeddings"] = torch.tensor(1, dtype=torch.int8)
        linears = [("self_attention/linear_0", 3 * D, D), ("self_attention/linear_1", D, D)]
        if stack == "decoder":
            linears += [
                ("attention/linear_0", D, D),
                ("attention/linear_1", 2 * D, D),
                ("attention/linear_2", D, D),
            ]
        linears += [("ffn/linear_0", FF, D), ("ffn/linear_1", D, FF)]
        for scope, rows, cols in linears:
            v[f"{stack}/layer_0/{scope}/weight"] = rand(rows, cols)
            v[f"{stack}/layer_0/{scope}/bias"] = rand(rows)
        for norm in ["self_attention", "ffn"] + (["attention"] if stack == "decoder" else []):
            v[f"{stack}/layer_0/{norm}/layer_norm/gamma"] = torch.ones(D)
            v[f"{stack}/layer_0/{norm}/layer_norm/beta"] = torch.zeros(D)
    v["encoder/embeddings_0/weight"] = rand(len(VOCAB), D)
    v["decoder/embeddings/weight"] = rand(len(VOCAB), D)
    v["decoder/projection/weight"] = rand(len(VOCAB), D)
    v["decoder/projection/bias"] = rand(len(VOCAB))
    return v


def ct2_dir(
    root: Path,
    variables: dict[str, torch.Tensor],
    *,
    vocabulary: bytes | None = None,
    vocabulary_file: str = "shared_vocabulary.json",
    **bin_options: object,
) -> Path:
    """A CTranslate2 model directory: model.bin, config.json, ``vocabulary_file`` (``vocabulary``)."""
    root.mkdir(parents=True, exist_ok=True)
    write_model_bin(root / "model.bin", variables, **bin_options)  # type: ignore[arg-type]
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "decoder_start_token": "<s>"}
    (root / "config.json").write_text(json.dumps(config))
    (root / vocabulary_file).write_bytes(vocabulary or json.dumps(VOCAB).encode())
    return root


def _int8(rows: int, cols: int) -> torch.Tensor:
    return torch.ones(rows, cols, dtype=torch.int8)


def _scalar(
    name: str, value: float, dtype: torch.dtype = torch.float32
) -> Callable[[dict[str, torch.Tensor]], None]:
    def change(v: dict[str, torch.Tensor]) -> None:
        v[f"encoder/{name}"] = v[f"decoder/{name}"] = torch.tensor(value, dtype=dtype)

    return change


N = 1 << 16  # the file: an int8 [1, N] weight (64 KiB) and an [N, 1] scale (256 KiB)
BROADCAST_SCALE = {
    "decoder/projection/weight": _int8(1, N),
    "decoder/projection/weight_scale": torch.ones(N, 1),
}

CT2_CASES: dict[str, tuple[Callable[[dict[str, torch.Tensor]], None], str]] = {
    # change: what the message names
    "2-D scale": (lambda v: v.update(BROADCAST_SCALE), r"projection/weight_scale has shape \[65536, 1\]"),
    "scale of another length": (
        lambda v: v.update(
            {"decoder/projection/weight": _int8(8, 8), "decoder/projection/weight_scale": torch.ones(7)}
        ),
        r"weight_scale has shape \[7\].*one per row",
    ),
    "zero scale": (
        lambda v: v.update(
            {"decoder/projection/weight": _int8(8, 8), "decoder/projection/weight_scale": torch.zeros(8)}
        ),
        "weight_scale has a zero or non-finite value",
    ),
    "n_heads 0": (_scalar("num_heads", 0, torch.int16), "num_heads 0.0 does not split the width 8"),
    "n_heads 3": (_scalar("num_heads", 3, torch.int16), "num_heads 3.0 does not split the width 8"),
    "n_heads nan": (_scalar("num_heads", float("nan")), "num_heads is nan"),
    "n_heads a vector": (
        lambda v: v.update({"encoder/num_heads": torch.ones(5, dtype=torch.int16)}),
        r"num_heads has shape \[5\], not one value",
    ),
    "activation 2.5": (_scalar("activation", 2.5), "the activation id 2.5 is not supported"),
    "over-long layer index": (
        lambda v: v.update({f"encoder/layer_{'9' * 5000}/ffn/linear_0/weight": torch.ones(FF, D)}),
        r"encoder layer index 999999999999\.\.\. \(5000 digits\)",
    ),
    "layer index past the bound": (
        lambda v: v.update({"decoder/layer_300/ffn/linear_0/weight": torch.ones(FF, D)}),
        r"decoder layer index 300 \(at most 256 layers\)",
    ),
    "layer index with a leading zero": (
        lambda v: v.update({"decoder/layer_00/ffn/linear_0/weight": torch.ones(FF, D)}),
        "decoder layer index 00",
    ),
    "qkv of the wrong width": (
        lambda v: v.update({"encoder/layer_0/self_attention/linear_0/weight": torch.ones(3 * D, D + 1)}),
        r"self_attention/linear_0/weight has shape \[24, 9\], the model needs \[24, 8\]",
    ),
    "ffn of another width in layer 0 of the decoder": (
        lambda v: v.update({"decoder/layer_0/ffn/linear_1/weight": torch.ones(D, FF + 1)}),
        r"decoder/layer_0/ffn/linear_1/weight has shape \[8, 17\], the model needs \[8, 16\]",
    ),
    "bias of the wrong length": (
        lambda v: v.update({"decoder/layer_0/attention/linear_1/bias": torch.ones(2 * D + 1)}),
        r"attention/linear_1/bias has shape \[17\], the model needs \[16\]",
    ),
    "norm of the wrong length": (
        lambda v: v.update({"encoder/layer_0/ffn/layer_norm/gamma": torch.ones(2 * D)}),
        r"ffn/layer_norm/gamma has shape \[16\], the model needs \[8\]",
    ),
    "embeddings of another width": (
        lambda v: v.update({"encoder/embeddings_0/weight": torch.ones(len(VOCAB), D + 1)}),
        r"the encoder embeddings have shape \[8, 9\], the model needs \[tokens, 8\]",
    ),
    "projection for another vocabulary": (
        lambda v: v.update({"decoder/projection/weight": torch.ones(len(VOCAB) + 1, D)}),
        r"projection/weight has shape \[9, 8\], the model needs \[8, 8\]",
    ),
    "position table of another width": (
        lambda v: v.update(
            {f"{s}/position_encodings/encodings": torch.ones(16, D + 2) for s in ("encoder", "decoder")}
        ),
        r"position_encodings/encodings has shape \[16, 10\], the model needs \[positions, 8\]",
    ),
}


@pytest.mark.parametrize("case", CT2_CASES)
def test_crafted_ctranslate2_models_are_refused_by_name(tmp_path: Path, case: str) -> None:
    valid = ct2_dir(tmp_path / "valid", tiny_variables())
    assert from_ct2(read_model(valid)).config.d_model == D  # the unchanged model converts
    change, message = CT2_CASES[case]
    variables = tiny_variables()
    change(variables)
    with pytest.raises(ConversionError, match=message):
        from_ct2(read_model(ct2_dir(tmp_path / "crafted", variables)))


RAW_CASES: dict[str, tuple[dict[str, object], str]] = {
    # write_model_bin options: what the message names
    "more variables than the file holds": (
        {"count": 0xFFFFFFFF},
        "the number of variables is 4294967295, more than",
    ),
    "a size past the end of the file": (
        {"extra": record("big", [40000, 40000], 1, b"", num_bytes=1_600_000_000)},
        r"truncated: the data of big needs 1600000000 bytes",
    ),
    "a size that is not the shape's": (
        {"extra": record("lying", [4, 4], 0, b"\0" * 16, num_bytes=16)},
        r"lying: shape \[4, 4\] of torch.float32 needs 64 bytes, the file says 16",
    ),
    "rank 200": ({"extra": record("deep", [1] * 200, 0, b"\0" * 4)}, "deep has rank 200"),
    "a variable twice": (
        {"extra": record("decoder/projection/bias", [8], 0, b"\0" * 32)},
        "variable decoder/projection/bias appears twice",
    ),
    "an empty matrix declaring any width": (
        {"extra": record("wide", [0, 4_000_000_000], 0, b"")},
        r"wide has an empty dimension \(shape \[0, 4000000000\]\)",
    ),
}


@pytest.mark.parametrize("case", RAW_CASES)
def test_counts_and_sizes_a_model_bin_declares_are_bounded(tmp_path: Path, case: str) -> None:
    options, message = RAW_CASES[case]
    with pytest.raises(ConversionError, match=message):
        read_model(ct2_dir(tmp_path, tiny_variables(), **options))


@pytest.mark.parametrize(
    ("file", "vocabulary", "message"),
    [
        ("shared_vocabulary.json", b"," * MAX_VOCABULARY, f"more than {MAX_VOCABULARY} tokens"),
        ("shared_vocabulary.txt", b"\n" * MAX_VOCABULARY, f"more than {MAX_VOCABULARY} tokens"),
        ("shared_vocabulary.txt", b"\r" * MAX_VOCABULARY, f"more than {MAX_VOCABULARY} tokens"),
        ("shared_vocabulary.json", b"[" * 100_000, "unreadable vocabulary"),  # past the recursion limit
        (
            "shared_vocabulary.json",
            json.dumps(VOCAB[:-1]).encode(),
            "7 tokens, but .*model.bin has 8 embedding",
        ),
        ("shared_vocabulary.txt", "\r\n".join(VOCAB).encode(), None),  # line ends as text mode reads them
    ],
    ids=["too many tokens", "too many lines", "too many old Mac lines", "nested", "one token short", "CRLF"],
)
def test_vocabularies_are_bounded_and_must_match_the_embeddings(
    tmp_path: Path, file: str, vocabulary: bytes, message: str | None
) -> None:
    model = ct2_dir(tmp_path, tiny_variables(), vocabulary=vocabulary, vocabulary_file=file)
    if message is None:
        assert from_ct2(read_model(model)).target_vocabulary == VOCAB
        return
    with pytest.raises(ConversionError, match=message):
        from_ct2(read_model(model))


# The child measures itself: its address space capped 512 MiB above what importing torch took (an
# allocation past it fails at once, rather than the machine swapping), the peak RSS it adds.
CHILD = """
import json, resource, sys, time
from model.convert.ct2_model import read_model
from model.convert.errors import ConversionError

def status(key):
    lines = open("/proc/self/status").read().splitlines()
    return 1024 * int(next(line.split()[1] for line in lines if line.startswith(key + ":")))

limit = status("VmSize") + (512 << 20)
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
peak, start = status("VmHWM"), time.perf_counter()
try:
    read_model(sys.argv[1])
    outcome = "read"
except ConversionError as e:
    outcome = f"ConversionError: {e}"
seconds, growth = time.perf_counter() - start, status("VmHWM") - peak
print(json.dumps({"outcome": outcome, "seconds": seconds, "growth": growth}))
"""


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="measures /proc/self/status (Linux)")
def test_a_2d_scale_is_refused_quickly_in_bounded_memory(tmp_path: Path) -> None:
    """The issue's file: 320 KiB that the old reader broadcast into a 65536 x 65536 float32 tensor."""
    variables = tiny_variables()
    variables.update(BROADCAST_SCALE)
    model = ct2_dir(tmp_path, variables)
    assert (model / "model.bin").stat().st_size < 400 << 10
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(model)], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert (
        result["outcome"].startswith("ConversionError")
        and "weight_scale has shape [65536, 1]" in result["outcome"]
    )
    assert result["growth"] < 64 << 20, result  # the file is 320 KiB; broadcasting it takes 16 GiB
    assert result["seconds"] < 10, result  # milliseconds alone; loose for a loaded 2-core machine


# -- Argos packages -----------------------------------------------------------------------------------


def package(path: Path, model: Path | None = None, members: dict[str, bytes] | None = None) -> Path:
    """An .argosmodel: metadata.json, the CTranslate2 ``model`` under model/, ``members`` besides."""
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("pkg/metadata.json", json.dumps({"from_code": "de", "to_code": "en"}))
        z.writestr("pkg/sentencepiece.model", b"not read: the model is refused first")
        for file in sorted(model.iterdir()) if model else []:
            z.write(file, f"pkg/model/{file.name}")
        for name, data in (members or {}).items():
            z.writestr(name, data)
    return path


def _declare_size(zip_path: Path, member: str, size: int) -> None:
    """Make the central directory declare ``size`` bytes for ``member`` (what a zip bomb does)."""
    data = bytearray(zip_path.read_bytes())
    entry = data.index(b"PK\x01\x02")  # a central directory entry: its name at 46, sizes at 20 and 24
    while data[entry + 46 : entry + 46 + len(member)] != member.encode():
        entry = data.index(b"PK\x01\x02", entry + 4)
    data[entry + 24 : entry + 28] = struct.pack("<I", size)  # the uncompressed size
    zip_path.write_bytes(bytes(data))


def test_an_argos_package_that_declares_more_than_it_can_unpack_to_is_refused(tmp_path: Path) -> None:
    bomb = package(tmp_path / "bomb.argosmodel", members={"pkg/README.md": b"x" * 10})
    _declare_size(bomb, "pkg/README.md", 0xFFFFFFF0)  # (0xFFFFFFFF would mean "see the zip64 field")
    with pytest.raises(ConversionError, match=r"members unpack to \d{10} bytes.*zip bomb"):
        argos.convert(bomb, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_argos_package_with_too_many_members_is_refused(tmp_path: Path) -> None:
    many = package(
        tmp_path / "many.argosmodel", members={f"pkg/{i}": b"" for i in range(MAX_ARCHIVE_MEMBERS)}
    )
    with pytest.raises(ConversionError, match=f"{MAX_ARCHIVE_MEMBERS + 2} members"):
        argos.convert(many, tmp_path / "out")


def test_an_argos_package_holding_a_crafted_model_is_refused_by_name(tmp_path: Path) -> None:
    variables = tiny_variables()
    variables.update(BROADCAST_SCALE)
    crafted = package(tmp_path / "crafted.argosmodel", ct2_dir(tmp_path / "ct2", variables))
    with pytest.raises(ConversionError, match=r"crafted.argosmodel:.*model.bin.*weight_scale has shape"):
        argos.convert(crafted, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_aliases_share_their_variables_float_tensor_instead_of_a_copy_each(tmp_path: Path) -> None:
    """A few bytes per alias must not cost a weight's float copy each (200 aliases of a 1 MiB
    float weight asked for 200 MiB; 10^6 of them, in an 18 MiB file, for a terabyte)."""
    variables = tiny_variables()
    variables["decoder/extra/weight"] = torch.ones(256, 1024, dtype=torch.int8)
    variables["decoder/extra/weight_scale"] = torch.ones(256)
    root = ct2_dir(tmp_path / "model", variables)
    count = 200
    aliases = struct.pack("<I", count) + b"".join(
        _string(f"alias/{i}") + _string("decoder/extra/weight") for i in range(count)
    )
    binary = root / "model.bin"
    binary.write_bytes(binary.read_bytes()[:-4] + aliases)  # (its last 4 bytes: no aliases)
    model = read_model(root)
    weight = model.variables["decoder/extra/weight"]
    assert weight.dtype == torch.float32
    assert all(model.variables[f"alias/{i}"].data_ptr() == weight.data_ptr() for i in range(count))
