"""Import an Argos Translate package (LibreTranslate's models) as a model directory.

    python -m model.convert argos translate-de_en-1_0.argosmodel OUT_DIR [--source de --target en]

A package is a zip whose one top-level directory holds metadata.json (from_code, to_code, ...),
model/ (a CTranslate2 ``TransformerSpec`` model: model.bin, config.json, vocabularies),
sentencepiece.model (both sides), maybe README.md (credits, licence) and stanza/ (a sentence
splitter; not used: the service splits sentences itself). The CTranslate2 model is read by our own
code (``model.convert.ct2_model``) and renamed to our weights (``model.convert.ct2_transformer``).

A ``target_prefix`` in metadata.json (a piece argos-translate forces at the start of every output,
through CTranslate2's ``translate_batch(..., target_prefix=...)``; a multilingual model's
target-language token) becomes the model directory's ``output_prefix`` (its id in the target
vocabulary), which decoding forces as CTranslate2 does (``model.decoding.prefix``) and the
tokenizer never shows, as argos-translate strips it. A piece the vocabulary lacks is refused.

A package may come from anywhere: before anything is unpacked, its members are counted
(``MAX_ARCHIVE_MEMBERS``) and their declared sizes summed, at most ``UNPACK_RATIO`` times the
package plus ``UNPACK_SLACK`` (Python's zipfile never writes more than a member declares), and
names that would land outside the scratch directory are refused; ``model.convert.ct2_model``
bounds what the unpacked model declares in turn.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from model.convert.bounds import MAX_ARCHIVE_MEMBERS
from model.convert.ct2_model import read_model
from model.convert.ct2_transformer import Imported, from_ct2
from model.convert.errors import ConversionError
from model.directory import (
    CONFIG_FILE,
    MODEL_CARD,
    SHARED_VOCAB,
    SOURCE_VOCAB,
    SPM_FILE,
    TARGET_VOCAB,
    WEIGHTS_FILE,
    ModelDirError,
    ModelInfo,
    read_info_and_tokenizer,
)

METADATA = "metadata.json"
# What a package may unpack to: model weights compress little (a real package unpacks to ~1.1-1.5
# times its size), text a few times; a zip bomb declares hundreds or thousands of times its size.
UNPACK_RATIO = 20
UNPACK_SLACK = 64 << 20


def convert(
    src: Path,
    out: Path,
    *,
    source: str | None = None,
    target: str | None = None,
    force: bool = False,
    command: str = "",
) -> Path:
    """Write the Argos package ``src`` (an .argosmodel zip, or its unpacked directory) as the model
    directory ``out``; ``source``/``target`` override metadata.json's language codes.

    Raises ``ConversionError`` naming the file and the problem (nothing is left in ``out``), and
    ``FileExistsError`` for a non-empty ``out`` without ``force``.
    """
    src, out = Path(src), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise FileExistsError(f"{out} exists and is not empty (use --force to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    # Built beside OUT and renamed into place when complete: a failure leaves nothing half-written.
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        with tempfile.TemporaryDirectory(prefix="argos-") as unpacked:
            package = _package_dir(src, Path(unpacked))
            _write(package, src, staging, source=source, target=target, command=command)
        try:  # the directory must read back as one the service serves
            read_info_and_tokenizer(staging)
        except ModelDirError as e:
            raise ConversionError(f"{src}: the converted model does not read back ({e})") from e
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _package_dir(src: Path, scratch: Path) -> Path:
    """The directory holding metadata.json: ``src`` itself, its one subdirectory, or the zip's
    one top-level directory unpacked into ``scratch``."""
    if src.is_dir():
        root = src
    elif not src.is_file():
        raise ConversionError(f"{src}: no such file or directory")
    elif not zipfile.is_zipfile(src):
        raise ConversionError(f"{src}: not a zip file (an .argosmodel package is one)")
    else:
        try:
            with zipfile.ZipFile(src) as z:
                _check_members(src, z.infolist())
                z.extractall(scratch)
        except (zipfile.BadZipFile, OSError, EOFError) as e:
            raise ConversionError(f"{src}: unreadable zip ({e})") from e
        root = scratch
    if (root / METADATA).is_file():
        return root
    subdirs = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(("__MACOSX", "."))]
    if len(subdirs) == 1 and (subdirs[0] / METADATA).is_file():
        return subdirs[0]
    raise ConversionError(
        f"{src}: no {METADATA} (in it or in its one top-level directory): not an Argos package"
    )


def _check_members(src: Path, members: list[zipfile.ZipInfo]) -> None:
    """Refuse a zip with too many members, one that would land outside the scratch directory, or
    declared sizes past what a package of this size unpacks to (all before anything is written)."""
    if len(members) > MAX_ARCHIVE_MEMBERS:
        raise ConversionError(f"{src}: {len(members)} members (at most {MAX_ARCHIVE_MEMBERS})")
    for m in members:
        if m.filename.startswith(("/", "\\")) or ".." in Path(m.filename).parts:
            raise ConversionError(f"{src}: member {m.filename!r} points outside the package")
    declared, limit = sum(m.file_size for m in members), UNPACK_RATIO * src.stat().st_size + UNPACK_SLACK
    if declared > limit:
        raise ConversionError(
            f"{src}: its members unpack to {declared} bytes, more than {UNPACK_RATIO} times the package "
            f"plus {UNPACK_SLACK >> 20} MiB ({limit}): not a model package (a zip bomb?)"
        )


def _metadata(package: Path, src: Path) -> dict[str, Any]:
    try:
        meta = json.loads((package / METADATA).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ConversionError(f"{src}: {METADATA} is unreadable ({e})") from e
    if not isinstance(meta, dict):
        raise ConversionError(f"{src}: {METADATA} is not a JSON object")
    prefix = meta.get("target_prefix")
    if prefix is not None and not isinstance(prefix, str):
        raise ConversionError(f"{src}: {METADATA} has target_prefix {prefix!r}: not a piece (a string)")
    return meta


def _output_prefix(meta: dict[str, Any], imported: Imported, src: Path) -> list[int]:
    """metadata.json's ``target_prefix`` (one piece, as argos-translate passes it to CTranslate2)
    as target ids; none when it is absent or empty (argos-translate then forces nothing)."""
    piece = meta.get("target_prefix") or ""
    if not piece:
        return []
    vocabulary = imported.target_vocabulary
    if piece not in vocabulary:
        raise ConversionError(
            f"{src}: {METADATA} has target_prefix {piece!r}, which is not a piece of the model's target "
            "vocabulary"
        )
    return [vocabulary.index(piece)]


def _write(
    package: Path, src: Path, out: Path, *, source: str | None, target: str | None, command: str
) -> None:
    meta = _metadata(package, src)
    source = source or meta.get("from_code")
    target = target or meta.get("to_code")
    if not source or not target:
        raise ConversionError(f"{src}: {METADATA} has no from_code/to_code (give --source and --target)")
    if not (package / "model").is_dir():
        raise ConversionError(f"{src}: no model/ directory (the CTranslate2 model)")
    spm = package / SPM_FILE
    if not spm.is_file():
        raise ConversionError(
            f"{src}: no {SPM_FILE} (packages tokenized otherwise, e.g. BPE, are not supported)"
        )
    try:
        imported = from_ct2(read_model(package / "model"))
    except ConversionError as e:
        if package.is_relative_to(src):
            raise
        # Name the file inside the zip, not in the scratch directory it was unpacked to.
        raise ConversionError(str(e).replace(f"{package.parent}/", f"{src}:")) from e

    readme = package / "README.md"
    licence = str(meta.get("license") or meta.get("licence") or "")
    if not licence:
        licence = (
            "see the package's README below" if readme.is_file() else "unknown (the package states none)"
        )
    name = f"{meta.get('from_name', source)} → {meta.get('to_name', target)}"
    origin = f"Argos Translate package {src.name} (package_version {meta.get('package_version', '?')})"
    training = {"origin": origin, "licence": licence, "command": command}
    info = ModelInfo(
        imported.config, source, target, training, output_prefix=_output_prefix(meta, imported, src)
    )
    try:
        info.check()
    except ValueError as e:  # a prefix that is a special (eos, ...): decoding cannot force it
        raise ConversionError(f"{src}: {METADATA}'s target_prefix: {e}") from e

    save_file(
        {k: v.contiguous() for k, v in imported.state.items()},
        str(out / WEIGHTS_FILE),
        metadata={"format": "pt"},
    )
    shutil.copyfile(spm, out / SPM_FILE)
    _write_vocabularies(out, imported)
    (out / CONFIG_FILE).write_text(json.dumps(info.to_json(), indent=2) + "\n")
    card = [
        f"# {name} ({source}-{target}), imported from Argos Translate",
        "",
        f"- Origin: {origin}",
        f"- Licence: {licence}",
        f"- Made by: `{command or 'model.convert.argos.convert'}`",
        f"- Architecture: {_summary(imported)}",
    ]
    if info.output_prefix:
        card.append(
            f"- Every translation starts with the piece {meta['target_prefix']!r} (forced, not shown)"
        )
    if readme.is_file():
        card += [
            "",
            "## The package's README",
            "",
            readme.read_text(encoding="utf-8", errors="replace").strip(),
        ]
    (out / MODEL_CARD).write_text("\n".join(card) + "\n", encoding="utf-8")


def _write_vocabularies(out: Path, imported: Imported) -> None:
    def dump(name: str, pieces: list[str]) -> None:
        (out / name).write_text(json.dumps(pieces, ensure_ascii=False) + "\n", encoding="utf-8")

    if imported.shared_vocabulary:
        dump(SHARED_VOCAB, imported.target_vocabulary)
    else:
        dump(SOURCE_VOCAB, imported.source_vocabulary)
        dump(TARGET_VOCAB, imported.target_vocabulary)


def _summary(imported: Imported) -> str:
    c = imported.config
    return (
        f"Transformer {c.encoder_layers}+{c.decoder_layers} layers, d_model {c.d_model}, {c.n_heads} heads, "
        f"ffn {c.d_ff} ({c.activation}), {'pre' if c.pre_norm else 'post'}-norm, vocabulary {c.vocab_size}"
    )
