"""Subtitle samples (.srt, .vtt) and the check that a translation kept every cue's number,
identifier, timing and settings, every non-cue block, and the cue's shape (its line count)."""

from __future__ import annotations

from collections.abc import Callable

SENTENCES = (
    "Der Hund läuft über die Wiese.",
    "Wir treffen uns morgen um acht Uhr am Bahnhof.",
    "Das Wetter ist heute sehr schön.",
    "Ich habe das Buch gestern gelesen.",
)


def timing(i: int, comma: bool) -> str:
    sep = "," if comma else "."
    return f"00:00:{2 * i:02d}{sep}000 --> 00:00:{2 * i + 1:02d}{sep}500"


def srt_sample() -> bytes:
    cues = []
    for i, sentence in enumerate(SENTENCES):
        words = sentence.split()
        half = len(words) // 2
        text = f"{' '.join(words[:half])}\n<i>{' '.join(words[half:])}</i>" if i % 2 else sentence
        cues.append(f"{i + 1}\n{timing(i, True)}\n{text}\n")
    cues.append(
        f"{len(SENTENCES) + 1}\n{timing(len(SENTENCES), True)}\n- Hallo, Anna.\n- Guten Tag, Peter.\n"
    )
    return "\n".join(cues).encode()


def vtt_sample() -> bytes:
    parts = [
        "WEBVTT - Beispiel\n",
        "NOTE Diese Notiz bleibt,\nwie sie ist.\n",
        "STYLE\n::cue(.gelb) { color: yellow }\n",
    ]
    for i, sentence in enumerate(SENTENCES):
        ident = f"cue-{i}\n" if i % 2 else ""
        parts.append(
            f"{ident}{timing(i, False)} align:start line:0\n<v Anna>{sentence} <c.gelb>Ja &amp; nein.</c>\n"
        )
    return "\n".join(parts).encode("utf-8")


def srt_bom_crlf_sample() -> bytes:
    return b"\xef\xbb\xbf" + srt_sample().replace(b"\n", b"\r\n")


SAMPLES: dict[str, Callable[[], bytes]] = {
    "film.srt": srt_sample,
    "film-windows.srt": srt_bom_crlf_sample,
    "film.vtt": vtt_sample,
}


def blocks(data: bytes) -> list[tuple[list[str], list[str]]]:
    """Each blank-line separated block as (its lines up to and with the timing line, the text
    lines after it); a block without timing is all 'head'."""
    text = data.decode("utf-8").replace("\r\n", "\n")
    out = []
    for block in text.split("\n\n"):
        lines = [line for line in block.split("\n") if line.strip()]
        if not lines:
            continue
        timing = next((i for i, line in enumerate(lines[:2]) if "-->" in line), None)
        if timing is None or lines[0].startswith(("NOTE", "STYLE", "REGION", "WEBVTT")):
            out.append((lines, []))
        else:
            out.append((lines[: timing + 1], lines[timing + 1 :]))
    return out


def check_structure(filename: str, original: bytes, translated: bytes) -> None:
    assert translated.startswith(b"\xef\xbb\xbf") == original.startswith(b"\xef\xbb\xbf"), "BOM kept"
    assert (b"\r\n" in translated) == (b"\r\n" in original), "line ends kept"
    source, target = blocks(original), blocks(translated)
    assert len(source) == len(target), "same number of cues and blocks"
    for (head, text), (new_head, new_text) in zip(source, target, strict=True):
        assert new_head == head, "cue numbers, identifiers, timings and settings, NOTE/STYLE blocks kept"
        if text:
            assert 1 <= len(new_text) <= max(len(text), 2), f"cue of {len(text)} lines became {len(new_text)}"
