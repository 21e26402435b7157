"""Import a model made by another toolkit as a model directory the service serves.

    python -m model.convert marian HF_DIR OUT_DIR [--source de --target en]   # OPUS-MT (transformers)
    python -m model.convert argos PACKAGE.argosmodel OUT_DIR                  # LibreTranslate's Argos

The output is a model directory like the shipped ones (config.json, model.safetensors, tokenizer
files and a model card README.md naming origin, licence and this command). A failed conversion
says why and leaves nothing in OUT_DIR.
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys
from pathlib import Path

from model.convert.errors import ConversionError
from model.directory import ModelDirError


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m model.convert", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="kind", required=True)
    marian = sub.add_parser("marian", help="a Hugging Face MarianMTModel directory (OPUS-MT)")
    marian.add_argument("src", type=Path, help="directory with config.json, weights, source.spm, ...")
    argos = sub.add_parser("argos", help="an Argos Translate package (.argosmodel)")
    argos.add_argument("src", type=Path, help="the .argosmodel file (a zip) or its unpacked directory")
    for p in (marian, argos):
        p.add_argument("out", type=Path, help="the model directory to write")
        p.add_argument("--source", help="source language code (default: from the model's metadata)")
        p.add_argument("--target", help="target language code (default: from the model's metadata)")
        p.add_argument("--force", action="store_true", help="replace an existing OUT_DIR")
    args = ap.parse_args(argv)
    command = shlex.join(["python", "-m", "model.convert", *argv])
    try:
        converter = importlib.import_module(f"model.convert.{args.kind}")  # torch only when needed
        out = converter.convert(
            args.src, args.out, source=args.source, target=args.target, force=args.force, command=command
        )
    except (ConversionError, ModelDirError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
