"""Two-column tables that users upload: glossaries as DeepL accepts them (CSV or TSV) and
translation memories as TSV.

DeepL's rules, which we follow so that a file made for DeepL loads here unchanged: UTF-8 (a byte
order mark is allowed), one ``source,target`` (CSV, RFC 4180 quoting) or ``source<TAB>target``
(TSV, no quoting) per line, optionally with two more columns naming the languages, which the
glossary's own languages supersede; no control characters in a term. Blank lines are skipped, and
a term's surrounding whitespace is dropped rather than refused (spreadsheets add it). Every error
names the line, so that a 5,000-line file can be fixed without guessing.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

Format = Literal["csv", "tsv"]
FORMATS: tuple[Format, ...] = ("csv", "tsv")

# C0 and C1 control characters: invisible, and a term holding one would never match the text it
# was meant for. Tab and newline cannot occur inside a field except quoted in CSV.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


class TableError(ValueError):
    """A table (or an entry) that cannot be used; the message says where and why.

    ``too_large``: over one of the limits (HTTP 413); otherwise malformed (HTTP 422)."""

    def __init__(self, message: str, *, too_large: bool = False) -> None:
        super().__init__(message)
        self.too_large = too_large


@dataclass(frozen=True)
class Row:
    line: int  # 1-based, in the file: where an error about this row points
    source: str
    target: str


def decode(data: bytes) -> str:
    """UTF-8, with or without a byte order mark; an invalid byte is named by its line."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise TableError(f"line {line}: not valid UTF-8 (byte {e.start} of the file)") from None


def check_term(value: str, *, where: str, what: str, max_chars: int) -> str:
    """``value`` without its surrounding whitespace, or ``TableError`` (``where``: "line 3")."""
    term = value.strip()
    if not term:
        raise TableError(f"{where}: the {what} is empty")
    if _CONTROL.search(term):
        raise TableError(f"{where}: the {what} holds a control character")
    if len(term) > max_chars:
        raise TableError(
            f"{where}: the {what} is {len(term)} characters long, more than {max_chars}", too_large=True
        )
    return term


def _csv_records(text: str) -> Iterator[tuple[int, list[str]]]:
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    start = 1
    try:
        for fields in reader:
            yield start, fields
            start = reader.line_num + 1  # a quoted field may span lines: the next record starts after
    except csv.Error as e:
        raise TableError(f"line {reader.line_num}: not valid CSV ({e})") from None


def _tsv_records(text: str) -> Iterator[tuple[int, list[str]]]:
    # Not str.splitlines: it also splits on form feeds, U+2028 and other characters that are no
    # line break in a TSV file, which would shift every later line number. Nor all the lines at
    # once (text.split): a 16 MiB file of short or blank lines would be millions of strings held
    # together, ~20 times its size; one line at a time, what is kept is the rows (``max_rows``).
    start, number = 0, 1
    while (end := text.find("\n", start)) >= 0:
        yield number, text[start:end].removesuffix("\r").split("\t")
        start, number = end + 1, number + 1
    yield number, text[start:].removesuffix("\r").split("\t")


def read_rows(data: bytes, fmt: Format, *, max_bytes: int, max_rows: int, max_chars: int) -> list[Row]:
    """The rows of a CSV or TSV table, each term checked (``TableError`` naming the line)."""
    if fmt not in FORMATS:
        raise TableError(f"unknown format {fmt!r}: csv or tsv")
    if len(data) > max_bytes:
        raise TableError(f"the table is larger than {max_bytes} bytes", too_large=True)
    records = _csv_records(decode(data)) if fmt == "csv" else _tsv_records(decode(data))
    separator = "a comma" if fmt == "csv" else "a tab"
    rows: list[Row] = []
    for line, fields in records:
        if all(not field.strip() for field in fields):
            continue
        if len(fields) not in (2, 4):
            raise TableError(
                f"line {line}: {len(fields)} field(s); expected source and target separated by {separator}"
            )
        where = f"line {line}"
        source = check_term(fields[0], where=where, what="source", max_chars=max_chars)
        target = check_term(fields[1], where=where, what="target", max_chars=max_chars)
        rows.append(Row(line, source, target))
        if len(rows) > max_rows:
            raise TableError(f"line {line}: more than {max_rows} entries", too_large=True)
    return rows
