"""Command-line translation of a text file: one sentence per line in, one translation per line out.

    python -m model.translate --model DIR [--input FILE] [--output FILE] [--beam-size 5] ...
    python -m model.translate --model MULTILINGUAL_DIR --target en ...   # a multilingual model needs --target

Its defaults are the service's (``DecodeOptions``, int8 where it is measured faster, the compiled step, 64
rows at a time), so a line translates here as the service translates it.

Line *i* of the output is the translation of line *i* of the input, so the output can be paired
with the input (or scored against a reference) by line number; blank lines stay blank. Input is
read and translated in chunks, so a file larger than memory streams through and output appears as
it is produced. Bad input (a missing or broken model directory, a missing input file, bytes that are
not UTF-8) ends with a one-line message on stderr and exit status 2, not a traceback: these are
user errors, not bugs.
"""

from __future__ import annotations

import argparse
import gzip
import os
import sys
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, suppress
from dataclasses import Field, fields
from pathlib import Path
from typing import Any, BinaryIO, get_type_hints

from tqdm import tqdm

from model.checkpoint import ModelDirError, source_prefix
from model.decoding.options import AT_LEAST_ONE, MAX_BEAM_SIZE, DecodeOptions
from model.decoding.terms import MAX_TERMS_PER_SENTENCE, Glossary, TooManyTerms, read_glossary, sentence_terms
from model.decoding.translator import DTYPES, QUANTIZATIONS, Translator

# Lines handed to Translator.translate_batch at a time. Large enough that the translator's
# length-sorting keeps similar lengths together; small enough that memory stays bounded and output
# appears steadily.
CHUNK_LINES = 1024

EXIT_USAGE = 2  # bad arguments or bad input, as argparse uses for usage errors

# DecodeOptions fields with no flag: the output is one translation per line, the best.
NOT_FLAGS = frozenset({"n_best"})


class InputError(Exception):
    """A problem with what the user gave us (paths, files, bytes); reported in one line, exit 2."""


def positive_int(text: str) -> int:
    """argparse type for counts that must be >= 1 (a zero beam or batch would translate nothing)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def decode_fields() -> list[Field[Any]]:
    """The ``DecodeOptions`` fields the CLI takes as flags (``--beam-size`` for beam_size, ...)."""
    return [f for f in fields(DecodeOptions) if f.name not in NOT_FLAGS]


def add_decode_flags(parser: argparse.ArgumentParser) -> None:
    """A flag per decoding option, whose type, default and help come from ``DecodeOptions``, so that
    the CLI decodes as the library and the service do by default and documents it as they do."""
    types = get_type_hints(DecodeOptions)
    for f in decode_fields():
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            type=positive_int if f.name in AT_LEAST_ONE else types[f.name],
            default=f.default,
            help=f.metadata["doc"].replace("%", "%%") + " (default %(default)s)",
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nmt-translate",
        description="Translate text, one sentence per line, with a trained model directory.",
    )
    parser.add_argument(
        "--model", required=True, help="model directory (config.json, model.safetensors, sentencepiece.model)"
    )
    parser.add_argument(
        "--input", help="input file, one sentence per line (.gz is decompressed); default stdin"
    )
    parser.add_argument("--output", help="output file (.gz is compressed); default stdout")
    parser.add_argument(
        "--target",
        metavar="LANG",
        help="language to translate into: needed by a multilingual model, optional for a bilingual one",
    )
    add_decode_flags(parser)
    parser.add_argument(
        "--batch-size", type=positive_int, default=64, help="rows (beams) decoded together (default 64)"
    )
    parser.add_argument(
        "--max-beam-size",
        type=positive_int,
        default=MAX_BEAM_SIZE,
        help="the service's NMT_MAX_BEAM_SIZE, for lines with terms or placeholders to translate as the "
        f"service translates them (their search reads 2x that many candidates; default {MAX_BEAM_SIZE})",
    )
    parser.add_argument(
        "--device", default="auto", help="auto (CUDA if available), cpu, cuda or cuda:N (default auto)"
    )
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default="float32", help="compute dtype (default float32)"
    )
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default="auto",
        help="int8: the linear layers in int8 (CPU, float32); auto: int8 where int8 layers are "
        "measured faster than float32's on this machine, as the service (default auto)",
    )
    parser.add_argument(
        "--no-compile",
        action="store_true",
        help="decode with the eager step instead of the compiled one (compiled once per architecture and "
        "settings, then kept in --compile-cache-dir)",
    )
    parser.add_argument(
        "--compile-cache-dir",
        type=Path,
        default=os.environ.get("NMT_COMPILE_CACHE_DIR") or None,
        help="default: the service's (NMT_COMPILE_CACHE_DIR, else ~/.cache/nmt-service/compiled)",
    )
    parser.add_argument(
        "--glossary",
        type=Path,
        help="terms each translation must use: one per line, source<TAB>target (a line without a "
        "tab: a term kept as it is); matched as the service matches a request's glossary",
    )
    parser.add_argument(
        "--no-protect-placeholders",
        action="store_true",
        help="translate {name}, %%s, URLs, e-mail addresses and numbers as the model likes (by default "
        "they are kept verbatim, as the service keeps them)",
    )
    parser.add_argument(
        "--max-terms",
        type=positive_int,
        default=MAX_TERMS_PER_SENTENCE,
        help=f"terms per line at most (more glossary matches: an error; default {MAX_TERMS_PER_SENTENCE})",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return parser


def open_input(path: str | None) -> BinaryIO:
    """The input as bytes: stdin, a plain file or a gzip file.

    Bytes rather than text so that lines split on b"\\n" only (text mode would also split on a lone
    "\\r" or other Unicode line breaks and desynchronise input and output line numbers), and so that
    invalid UTF-8 can be reported with its line number.
    """
    if path is None or path == "-":
        return sys.stdin.buffer
    try:
        if path.endswith(".gz"):
            return gzip.open(path, "rb")  # type: ignore[return-value]
        return open(path, "rb")  # noqa: SIM115 - closed by the caller
    except OSError as e:
        raise InputError(f"cannot open input {path}: {e.strerror or e}") from e


def open_output(path: str | None) -> BinaryIO:
    """Where translations go, as bytes (always UTF-8, whatever the locale says)."""
    if path is None or path == "-":
        sys.stdout.flush()
        return sys.stdout.buffer
    try:
        if path.endswith(".gz"):
            return gzip.open(path, "wb")  # type: ignore[return-value]
        return open(path, "wb")  # noqa: SIM115 - closed by the caller
    except OSError as e:
        raise InputError(f"cannot open output {path}: {e.strerror or e}") from e


def count_lines(path: str) -> int | None:
    """Lines in ``path``, for the progress bar's total; None when it cannot be counted (no total)."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            n, last = 0, b"\n"
            while block := f.read(1 << 20):
                n += block.count(b"\n")
                last = block[-1:]
            return n + (last != b"\n")  # a last line without newline still counts
    except (OSError, EOFError):
        return None


def read_lines(stream: BinaryIO, name: str) -> Iterator[str]:
    """Decoded input lines without their line ending; raises InputError on bytes that are not UTF-8.

    A UTF-8 byte-order mark at the start of the input is dropped (editors on Windows write one).
    """
    try:
        for number, raw in enumerate(stream, start=1):
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise InputError(
                    f"{name}: line {number} is not valid UTF-8 ({e.reason} at byte {e.start})"
                ) from e
            yield line.rstrip("\n").removesuffix("\r")
    except (OSError, EOFError) as e:  # e.g. a truncated or corrupt .gz file
        raise InputError(f"cannot read {name}: {e}") from e


def chunked(lines: Iterable[str], size: int) -> Iterator[list[str]]:
    chunk: list[str] = []
    for line in lines:
        chunk.append(line)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def one_line(text: str) -> str:
    """A translation never spans lines: that would shift every following line of the output."""
    return " ".join(text.splitlines()) if ("\n" in text or "\r" in text) else text


def translate_lines(
    translator: Translator,
    lines: Iterable[str],
    out: BinaryIO,
    *,
    chunk_lines: int,
    progress: tqdm | None = None,
    target: str | None = None,
    glossary: Glossary | None = None,
    protect: bool = True,
    max_terms: int = MAX_TERMS_PER_SENTENCE,
) -> int:
    """Translate ``lines`` chunk by chunk, writing one line per input line; returns the line count.

    Output is flushed after every chunk so that a reader of a pipe sees results as they come.
    """
    total = 0
    for chunk in chunked(lines, chunk_lines):
        try:  # each line's terms, chosen as the service chooses a sentence's (model.decoding.terms)
            terms = [
                [t.target for t in sentence_terms(line, glossary, protect=protect, limit=max_terms)]
                for line in chunk
            ]
        except TooManyTerms as e:
            raise InputError(f"a line has {e}") from None
        results = translator.translate_batch(chunk, target=target, terms=terms if any(terms) else None)
        out.write(b"".join((one_line(r.hypotheses[0]) + "\n").encode("utf-8") for r in results))
        out.flush()
        total += len(chunk)
        if progress is not None:
            progress.update(len(chunk))
    return total


def fail(message: str) -> int:
    print(f"nmt-translate: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m model.translate`` and ``nmt-translate``; returns the exit status."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2): argparse has printed the message
        return e.code if isinstance(e.code, int) else EXIT_USAGE

    if not Path(args.model).is_dir():
        return fail(f"model directory not found: {args.model}")
    from_file = args.input not in (None, "-")
    if from_file and not Path(args.input).is_file():
        return fail(f"input file not found: {args.input}")
    glossary = None
    if args.glossary is not None:
        try:
            glossary = read_glossary(args.glossary.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as e:
            return fail(f"cannot read the glossary: {e}")

    try:
        options = DecodeOptions(**{f.name: getattr(args, f.name) for f in decode_fields()})
        translator = Translator.load(
            args.model,
            device=args.device,
            dtype=args.dtype,
            quantization=args.quantization,
            options=options,
            capacity=max(args.batch_size, args.beam_size),
            # (within the batch: a smaller --batch-size keeps fewer candidates than the service;
            # the Translator raises it to --beam-size)
            max_beam_size=min(args.max_beam_size, args.batch_size),
            compile=not args.no_compile,
            cache_dir=args.compile_cache_dir,
        )
    except ModelDirError as e:
        return fail(f"cannot load model: {e}")
    except ValueError as e:  # e.g. --device cuda without CUDA
        return fail(str(e))
    try:
        source_prefix(translator.info, args.target)
    except ValueError as e:  # no --target for a multilingual model, or one it does not translate into
        return fail(f"--target: {e}")

    try:
        with ExitStack() as stack:
            source = open_input(args.input)
            if from_file:
                stack.callback(source.close)
            out = open_output(args.output)
            if args.output not in (None, "-"):
                stack.callback(out.close)
            bar = None
            if from_file and not args.no_progress:
                bar = tqdm(total=count_lines(args.input), unit="line", file=sys.stderr, dynamic_ncols=True)
                stack.callback(bar.close)
            translate_lines(
                translator,
                read_lines(source, args.input if from_file else "<stdin>"),
                out,
                # Someone typing at a terminal wants each line back at once, not after 1024 lines.
                chunk_lines=1 if not from_file and sys.stdin.isatty() else CHUNK_LINES,
                progress=bar,
                target=args.target,
                glossary=glossary,
                protect=not args.no_protect_placeholders,
                max_terms=args.max_terms,
            )
    except InputError as e:
        return fail(str(e))
    except BrokenPipeError:
        # The reader went away (e.g. `| head`): not an error worth a traceback. Point stdout at
        # devnull so that the interpreter's final flush does not raise again.
        with suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
