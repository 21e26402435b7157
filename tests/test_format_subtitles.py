"""Subtitles (.srt, .vtt) through app.formats.documents.read with an upper-casing stand-in
translator: every line that is not cue text comes back byte for byte, cue text is translated with
its tags, wrapped to the cue's shape; hostile files are refused with the right error."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from app.config import Settings
from app.formats.documents import read
from app.formats.limits import DocumentError, Forbidden, TooLarge
from tests.documents.subtitles import SAMPLES, check_structure

LIMITS = Settings().document_limits()


def translate(
    name: str, data: bytes, translator: Callable[[str], str] = str.upper
) -> tuple[tuple[str, ...], bytes]:
    split = read(name, data, LIMITS).split("de")
    return split.sentences, split.join([translator(s) for s in split.sentences])


SRT = """1
00:00:01,000 --> 00:00:02,500
Der <i>große</i> Hund
läuft schnell.

2
00:00:03,000  -->  00:00:04,000   X1:100 X2:200
- Hallo.
- Guten Tag, <b>Herr</b> Müller.

17
00:00:05,000 --> 00:00:06,000
{\\an8}Oben steht ein Text.
"""


def test_srt_keeps_numbers_and_timings_byte_for_byte_and_translates_the_text_with_its_tags() -> None:
    sentences, out = translate("film.srt", SRT.encode())
    assert sentences == (
        "Der große Hund läuft schnell.",
        "- Hallo.",
        "- Guten Tag, Herr Müller.",
        "Oben steht ein Text.",
    )
    assert out.decode() == (
        "1\n00:00:01,000 --> 00:00:02,500\nDER <i>GROSSE</i> HUND\nLÄUFT SCHNELL.\n\n"
        "2\n00:00:03,000  -->  00:00:04,000   X1:100 X2:200\n- HALLO.\n- GUTEN TAG, <b>HERR</b> MÜLLER.\n\n"
        "17\n00:00:05,000 --> 00:00:06,000\n{\\an8}OBEN STEHT EIN TEXT.\n"
    )


VTT = """WEBVTT - Ein Film

REGION
id:fred width:40% lines:3

STYLE
::cue(.gelb) { color: yellow }

NOTE Diese Notiz
bleibt, wie sie ist.

intro
00:01.000 --> 00:04.000 align:start line:0 region:fred
<v Roger Bingham>Wir sind im Wald &amp; es ist <c.gelb>sehr</c> schön.

00:05.000 --> 00:06.000
<i>Kurz</i> &lt;3
"""


def test_vtt_keeps_header_note_style_region_identifiers_and_cue_settings() -> None:
    sentences, out = translate("film.vtt", VTT.encode())
    assert sentences == ("Wir sind im Wald & es ist sehr schön.", "Kurz <3")
    head = VTT.split("<v Roger")[0]
    assert out.decode() == (
        head + "<v Roger Bingham>WIR SIND IM WALD &amp; ES IST <c.gelb>SEHR</c> SCHÖN.\n\n"
        "00:05.000 --> 00:06.000\n<i>KURZ</i> &lt;3\n"
    )


def test_byte_order_mark_and_crlf_line_ends_are_kept() -> None:
    data = b"\xef\xbb\xbf" + SRT.replace("\n", "\r\n").encode()
    out = translate("film.srt", data)[1]
    assert out.startswith(b"\xef\xbb\xbf1\r\n00:00:01,000 --> 00:00:02,500\r\nDER <i>GROSSE</i> HUND\r\n")
    assert b"\n" not in out.replace(b"\r\n", b"")


def test_a_long_translation_of_a_one_line_cue_becomes_two_balanced_lines_within_42_characters() -> None:
    data = b"1\n00:00:01,000 --> 00:00:02,000\nEin kurzer Satz.\n"
    long = "This is a much longer translation that surely needs two lines to be shown."
    out = translate("a.srt", data, lambda s: long)[1].decode()
    lines = out.split("\n")[2:4]
    assert " ".join(lines) == long
    assert all(len(line) <= 42 for line in lines) and abs(len(lines[0]) - len(lines[1])) < 10


def test_a_two_line_cue_stays_two_lines_and_tags_follow_the_words_across_the_break() -> None:
    data = b"1\n00:00:01,000 --> 00:00:02,000\nIch habe das\n<i>Buch gestern gelesen.</i>\n"
    out = translate("a.srt", data, lambda s: "I read the book yesterday, it was very good.")[1].decode()
    text = out.split("\n")[2:-1]
    assert len(text) == 2
    assert (
        " ".join(text).replace("<i>", "").replace("</i>", "")
        == "I read the book yesterday, it was very good."
    )
    assert " ".join(text).count("<i>") == 1 and text[-1].endswith("</i>")


def test_each_cue_is_translated_on_its_own_even_when_a_sentence_runs_across_cues() -> None:
    data = (
        b"1\n00:00:01,000 --> 00:00:02,000\nWenn wir morgen\n\n"
        b"2\n00:00:02,000 --> 00:00:03,000\nfahren, regnet es.\n"
    )
    sentences, out = translate("a.srt", data)
    assert sentences == ("Wenn wir morgen", "fahren, regnet es.")
    assert out.decode().split("\n")[2] == "WENN WIR MORGEN"


def test_blocks_without_timings_and_empty_cues_are_kept_as_they_are() -> None:
    data = (
        b"1\n00:00:01,000 --> 00:00:02,000\n\nirgendein Text ohne Zeit\n\n"
        b"2\n00:00:02,000 --> 00:00:03,000\nJa.\n\n\n"
    )
    sentences, out = translate("a.srt", data)
    assert sentences == ("Ja.",)
    assert out == data.replace(b"Ja.", b"JA.")


def test_cues_without_blank_lines_between_them_keep_their_numbers_and_timings() -> None:
    data = (
        b"1\n00:00:01,000 --> 00:00:02,000\nErster Text.\n2\n00:00:02,000 --> 00:00:03,000\nZweiter Text.\n"
    )
    sentences, out = translate("a.srt", data)
    assert sentences == ("Erster Text.", "Zweiter Text.")
    assert out == data.replace(b"Erster Text", b"ERSTER TEXT").replace(b"Zweiter Text", b"ZWEITER TEXT")


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_samples_keep_their_structure(name: str) -> None:
    data = SAMPLES[name]()
    sentences, out = translate(name, data)
    assert sentences
    check_structure(name, data, out)
    assert out.decode("utf-8-sig").count(sentences[0].upper()) >= 1


# --- hostile files -------------------------------------------------------------------------------


def test_a_one_megabyte_cue_is_too_large() -> None:
    data = b"1\n00:00:01,000 --> 00:00:02,000\n" + b"Wort " * 200_000 + b"\n"
    with pytest.raises(TooLarge, match="too much text"):
        read("a.srt", data, LIMITS)


def test_a_hundred_thousand_cues_are_too_many() -> None:
    data = b"".join(b"%d\n00:00:01,000 --> 00:00:02,000\n\n" % i for i in range(100_000))
    with pytest.raises(TooLarge, match="too many subtitle cues"):
        read("a.srt", data, dataclasses.replace(LIMITS, max_elements=50_000))
    with pytest.raises(TooLarge):  # with text, the default limits stop it too
        read(
            "a.vtt",
            b"WEBVTT\n\n" + b"00:01.000 --> 00:02.000\nJa\n\n" * 60_000,
            LIMITS,
        )


@pytest.mark.parametrize(
    ("name", "data", "error", "message"),
    [
        ("a.srt", b"1\n00:00:01,000 --> 00:00:02,000\n\xe4\xfc\n", DocumentError, "not UTF-8"),
        ("a.srt", b"1\n00:00:01,000 --> 00:00:02,000\nJa\x00\n", Forbidden, "NUL"),
        ("a.vtt", b"00:01.000 --> 00:02.000\nJa\n", DocumentError, "WEBVTT"),
        ("a.srt", b"Nur ein Text, keine Untertitel.\n", DocumentError, "no cue"),
    ],
)
def test_unreadable_subtitles_are_refused_with_a_reason(
    name: str, data: bytes, error: type, message: str
) -> None:
    with pytest.raises(error, match=message) as raised:
        read(name, data, LIMITS)
    assert raised.type is error
