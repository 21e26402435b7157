"""What a document may cost to read, and the three ways reading one can fail.

An upload is bounded in bytes before it is read (``NMT_MAX_FILE_BYTES``), but a small file can
stand for a large document: a .docx is a zip whose parts may inflate a thousandfold, HTML may nest
without end, a text may hold more sentences than anyone translates at once. Each format checks
these limits *while* it reads, before anything builds a tree of what it read, and stops at the
first one crossed; what it still builds runs in a child process with a memory and time limit of
its own (``app.formats.sandbox``), never in the front end.
"""

from __future__ import annotations

from dataclasses import dataclass


class DocumentError(ValueError):
    """The upload cannot be read as the format its name says: a 400, with this message."""

    status = 400


class TooLarge(DocumentError):
    """The document crosses one of its limits (size, count, depth, time, memory): a 413."""

    status = 413


class Forbidden(DocumentError):
    """The document uses something refused whatever its size (an XML DTD or entity declarations,
    NUL characters in text): a 422."""

    status = 422


@dataclass(frozen=True)
class DocumentLimits:
    """The limits every format obeys, as ``Settings.document_limits()`` reads them from the
    ``NMT_MAX_FILE_*`` settings (app/config.py says what each one bounds, and its default)."""

    max_chars: int  # text to translate (a .docx: the text of all its parts)
    max_sentences: int  # sentences to translate
    max_entries: int  # files in a zip package (.docx)
    max_unpacked_bytes: int  # a package's files inflated, all together
    max_entry_bytes: int  # one file of a package, inflated
    max_ratio: int  # inflated / compressed size of one file of a package (beyond RATIO_FLOOR_BYTES)
    max_elements: int  # XML elements of a package; tags of an HTML file
    max_depth: int  # HTML elements open at once
    read_seconds: float  # CPU time to read (or to write) one document, in its child process
    memory_bytes: int  # what that child may allocate beyond what it had when it started

    def check_chars(self, chars: int) -> None:
        if chars > self.max_chars:
            raise TooLarge(f"too much text in the file (at most {self.max_chars} characters)")

    def check_sentences(self, sentences: int) -> None:
        if sentences > self.max_sentences:
            raise TooLarge(f"too many sentences in the file: {sentences} (at most {self.max_sentences})")


RATIO_FLOOR_BYTES = 1024 * 1024
