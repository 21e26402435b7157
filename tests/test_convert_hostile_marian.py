"""The Marian (transformers) converter refuses crafted directories by name, before allocating what
they only declare (tests/test_convert_hostile.py: the CTranslate2 and Argos converters).

A MarianMTModel directory (config.json, model.safetensors or pytorch_model.bin, vocab.json, the
SentencePiece models) is written here with random weights, then changed in one place: config.json
sizes past their bounds or the weights, tensors of other shapes, a compressed torch.save archive, a
shard outside the directory. The valid one converts; each changed one raises ``ConversionError``
whose message names the problem, and leaves no output.
"""

from __future__ import annotations

import io
import json
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch.torch_version import TorchVersion

from model.convert import marian
from model.convert.bounds import MAX_VOCABULARY
from model.convert.errors import ConversionError

D, HEADS, FF = 8, 2, 16  # the tiny model's width, heads and feed-forward width

MARIAN_VOCAB = ["</s>", "<unk>", "a", "b", "c", "d", "e", "<pad>"]
MARIAN_CONFIG = {
    "model_type": "marian", "d_model": D, "encoder_layers": 1, "decoder_layers": 1,
    "encoder_attention_heads": HEADS, "decoder_attention_heads": HEADS, "encoder_ffn_dim": FF,
    "decoder_ffn_dim": FF, "activation_function": "swish", "max_position_embeddings": 16,
    "pad_token_id": 7, "eos_token_id": 0, "decoder_start_token_id": 7, "scale_embedding": True,
    "vocab_size": len(MARIAN_VOCAB),
}  # fmt: skip


def marian_weights() -> dict[str, torch.Tensor]:
    """A MarianMTModel's state dict (1+1 layers, width 8, tied embeddings) with random values."""
    g = torch.Generator().manual_seed(0)
    w = {"model.shared.weight": torch.randn(len(MARIAN_VOCAB), D, generator=g)}
    w["final_logits_bias"] = torch.zeros(1, len(MARIAN_VOCAB))
    for side in ("encoder", "decoder"):
        modules = {
            "self_attn.q_proj": D,
            "self_attn.k_proj": D,
            "self_attn.v_proj": D,
            "self_attn.out_proj": D,
        }
        if side == "decoder":
            modules |= {f"encoder_attn.{p}_proj": D for p in ("q", "k", "v", "out")}
        for name, rows in {**modules, "fc1": FF}.items():
            w[f"model.{side}.layers.0.{name}.weight"] = torch.randn(rows, D, generator=g)
            w[f"model.{side}.layers.0.{name}.bias"] = torch.randn(rows, generator=g)
        w[f"model.{side}.layers.0.fc2.weight"] = torch.randn(D, FF, generator=g)
        w[f"model.{side}.layers.0.fc2.bias"] = torch.randn(D, generator=g)
        norms = ["self_attn_layer_norm", "final_layer_norm"] + (
            ["encoder_attn_layer_norm"] if side == "decoder" else []
        )
        for norm in norms:
            w[f"model.{side}.layers.0.{norm}.weight"] = torch.ones(D)
            w[f"model.{side}.layers.0.{norm}.bias"] = torch.zeros(D)
    return w


def marian_dir(
    root: Path,
    spm_model: Path,
    *,
    config: dict[str, object] | None = None,
    weights: dict[str, torch.Tensor] | None = None,
) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({**MARIAN_CONFIG, **(config or {})}))
    save_file(marian_weights() if weights is None else weights, str(root / "model.safetensors"))
    (root / "vocab.json").write_text(json.dumps({p: i for i, p in enumerate(MARIAN_VOCAB)}))
    for name in ("source.spm", "target.spm"):
        shutil.copyfile(spm_model, root / name)
    return root


def _with(name: str, shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    return {**marian_weights(), name: torch.ones(shape)}


def _stored_members_compressed(root: Path) -> None:
    """pytorch_model.bin instead of safetensors, its members deflated (torch.save stores them)."""
    buffer = io.BytesIO()
    torch.save(marian_weights(), buffer)
    with (
        zipfile.ZipFile(buffer) as saved,
        zipfile.ZipFile(root / "pytorch_model.bin", "w", zipfile.ZIP_DEFLATED) as z,
    ):
        for info in saved.infolist():
            z.writestr(info.filename, saved.read(info.filename))
    (root / "model.safetensors").unlink()


MARIAN_CASES: dict[str, tuple[dict[str, object], Callable[[Path], None] | None, str]] = {
    # (config.json changes or weights, a change to the directory): what the message names
    "max_position_embeddings 10^9": (
        {"config": {"max_position_embeddings": 10**9}}, None,
        "max_position_embeddings 1000000000 is not a whole number from 1 to 16384",
    ),
    "d_model past the embeddings": (
        {"config": {"d_model": 4096}}, None, r"has shape \(8, 8\), config.json's d_model is 4096",
    ),
    "heads 0": (
        {"config": {"encoder_attention_heads": 0, "decoder_attention_heads": 0}}, None,
        "encoder_attention_heads 0 is not a whole number",
    ),
    "heads 3": (
        {"config": {"encoder_attention_heads": 3, "decoder_attention_heads": 3}}, None,
        "3 attention heads do not divide d_model 8",
    ),
    "a million layers": (
        {"config": {"encoder_layers": 10**6}}, None, "encoder_layers 1000000 is not a whole number",
    ),
    "layers as a string": (
        {"config": {"decoder_layers": "2"}}, None, "decoder_layers '2' is not a whole number",
    ),
    "k_proj of another width": (
        {"weights": _with("model.encoder.layers.0.self_attn.k_proj.weight", (D, D + 1))}, None,
        r"k_proj.weight: shape \(8, 9\), config.json implies \(8, 8\)",
    ),
    "fc2 of another width": (
        {"weights": _with("model.decoder.layers.0.fc2.weight", (D, FF + 1))}, None,
        r"fc2.weight: shape \(8, 17\), config.json implies \(8, 16\)",
    ),
    "final_logits_bias of another length": (
        {"weights": _with("final_logits_bias", (1, 13))}, None, r"final_logits_bias has shape \(1, 13\)",
    ),
    "a 1-D embedding": ({"weights": _with("model.shared.weight", (64,))}, None, r"has shape \(64,\)"),
    "a position table of another size": (
        {"weights": _with("model.encoder.embed_positions.weight", (16, D + 1))}, None,
        r"embed_positions.weight is \(16, 9\), expected \(16, 8\)",
    ),
    "a deflated pytorch_model.bin": (
        {}, _stored_members_compressed, "pytorch_model.bin: member .* is compressed",
    ),
    "a shard outside the directory": (
        {}, lambda root: (root / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"model.shared.weight": "../elsewhere.safetensors"}})
        ),
        "weight_map is not a map of names to files",
    ),
    "config.json nested past the recursion limit": (
        {}, lambda root: (root / "config.json").write_text("[" * 100_000), "config.json: not readable JSON",
    ),
    "a vocabulary past the bound": (
        {}, lambda root: (root / "vocab.json").write_bytes(b"," * MAX_VOCABULARY),
        f"more than {MAX_VOCABULARY} pieces",
    ),
}  # fmt: skip


def test_the_crafted_marian_directories_start_from_one_that_converts(spm_model: Path, tmp_path: Path) -> None:
    out = marian.convert(
        marian_dir(tmp_path / "valid", spm_model), tmp_path / "out", source="de", target="en"
    )
    assert json.loads((out / "config.json").read_text())["model"]["d_model"] == D


@pytest.mark.parametrize("case", MARIAN_CASES)
def test_crafted_marian_directories_are_refused_by_name(spm_model: Path, tmp_path: Path, case: str) -> None:
    options, change, message = MARIAN_CASES[case]
    root = marian_dir(tmp_path / "crafted", spm_model, **options)  # type: ignore[arg-type]
    if change is not None:
        change(root)
    with pytest.raises(ConversionError, match=message):
        marian.convert(root, tmp_path / "out", source="de", target="en")
    assert not (tmp_path / "out").exists()


def test_a_torch_older_than_2_6_does_not_unpickle_weights(
    spm_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CVE-2025-32434: before torch 2.6, a crafted pickle runs code through ``weights_only=True``."""
    root = marian_dir(tmp_path / "bin", spm_model)
    torch.save(marian_weights(), root / "pytorch_model.bin")
    (root / "model.safetensors").unlink()
    monkeypatch.setattr(torch, "__version__", TorchVersion("2.5.1+cpu"))
    with pytest.raises(ConversionError, match=r"torch 2.5.1\+cpu .*CVE-2025-32434"):
        marian.convert(root, tmp_path / "out", source="de", target="en")
    monkeypatch.undo()  # the installed torch (>= 2.6, as pyproject.toml asks) reads the same file
    assert marian.convert(root, tmp_path / "out", source="de", target="en").is_dir()
