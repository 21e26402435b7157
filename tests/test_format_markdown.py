"""Markdown (.md) through app.formats.documents.read with an upper-casing stand-in translator:
only the text inside the source changes (markup, code, URLs, HTML, front matter byte for byte),
links and emphasis keep their words, line breaks keep their prefixes; hostile files are refused
with the right error."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from app.config import Settings
from app.formats.documents import read
from app.formats.limits import DocumentError, Forbidden, TooLarge
from tests.documents.markdown import SAMPLES, check_structure, kept

LIMITS = Settings().document_limits()


def translate(
    text: str | bytes, translator: Callable[[str], str] = str.upper, name: str = "a.md"
) -> tuple[tuple[str, ...], str]:
    data = text.encode() if isinstance(text, str) else text
    split = read(name, data, LIMITS).split("de")
    return split.sentences, split.join([translator(s) for s in split.sentences]).decode("utf-8")


def test_only_the_text_changes_markup_code_and_urls_stay_byte_for_byte() -> None:
    source = (
        "# Die *große* Überschrift #\n\n"
        'Ein **großer** Hund läuft über die [Wiese](http://example.com/wiese "Titel").\n'
        "Dann ruft man `pip install x` auf, AT&amp;T sagt 5\\* Sterne.\n"
    )
    sentences, out = translate(source)
    assert sentences == (
        "Die große Überschrift",
        "Ein großer Hund läuft über die Wiese.",
        "Dann ruft man auf, AT&T sagt 5* Sterne.",
    )
    assert out == (
        "# DIE *GROSSE* ÜBERSCHRIFT #\n\n"
        'EIN **GROSSER** HUND LÄUFT ÜBER DIE [WIESE](http://example.com/wiese "Titel").\n'
        "DANN RUFT MAN `pip install x` AUF, AT&amp;T SAGT 5\\* STERNE.\n"
    )


def test_code_blocks_html_blocks_references_and_front_matter_are_not_translated() -> None:
    source = (
        "---\ntitle: Ein Titel\n---\n\n"
        "```python\nprint('Hallo Welt')\n```\n\n"
        "    eingerückter Code\n\n"
        "<div>\nEin HTML-Block.\n</div>\n\n"
        "Ein [Verweis][ref] und <https://auto.example> und <b>fett</b>.\n\n"
        "[ref]: https://example.com/ref\n"
    )
    sentences, out = translate(source)
    assert sentences == ("Ein Verweis und und fett.",)
    assert out == source.replace("Ein [Verweis]", "EIN [VERWEIS]").replace(
        "und <https://auto.example> und <b>fett</b>.", "UND <https://auto.example> UND <b>FETT</b>."
    )


def test_block_quotes_lists_and_tables_keep_their_prefixes_and_cells() -> None:
    source = (
        "> Ein Zitat mit\n> zwei Zeilen.\n>\n> - Liste im Zitat\n>   mit Fortsetzung.\n\n"
        "1. Erster Punkt\n2. Zweiter ~~falscher~~ Punkt\n\n"
        "| Spalte A | Spalte \\| B |\n|---|:---:|\n| Wert eins | ![Bild](a.png) zwei |\n"
    )
    sentences, out = translate(source)
    assert "Spalte | B" in sentences and "zwei" in sentences
    assert out == (
        "> EIN ZITAT MIT\n> ZWEI ZEILEN.\n>\n> - LISTE IM ZITAT\n>   MIT FORTSETZUNG.\n\n"
        "1. ERSTER PUNKT\n2. ZWEITER ~~FALSCHER~~ PUNKT\n\n"
        "| SPALTE A | SPALTE \\| B |\n|---|:---:|\n| WERT EINS | ![Bild](a.png) ZWEI |\n"
    )


def test_task_list_boxes_are_kept_out_of_the_sentences() -> None:
    sentences, out = translate("- [ ] Erste Aufgabe.\n- [x] Zweite Aufgabe.\n")
    assert sentences == ("Erste Aufgabe.", "Zweite Aufgabe.")
    assert out == "- [ ] ERSTE AUFGABE.\n- [x] ZWEITE AUFGABE.\n"


def test_a_longer_translation_keeps_the_lines_and_the_markup_around_the_words() -> None:
    source = "> Ein **großer** Hund läuft\n> über die [Wiese](u).\n"
    out = translate(source, lambda s: "A very big dog is running across the meadow.")[1]
    assert out.count("\n> ") == 1 and out.startswith("> ")
    assert out.count("**") == 2 and "](u)" in out
    assert kept(out) == kept(source)


def test_a_translated_line_that_would_open_a_block_is_escaped() -> None:
    source = "Eins zwei\ndrei vier.\n"
    out = translate(source, lambda s: "one two - three.")[1]
    assert out == "one two\n\\- three.\n"
    assert kept(out) == kept(source)  # still one paragraph, no list


def test_a_hard_line_break_stays_hard() -> None:
    out = translate("Erste Zeile  \nzweite Zeile.\n", lambda s: "First line, second line.")[1]
    assert out == "First line,  \nsecond line.\n"


def test_byte_order_mark_and_crlf_line_ends_are_kept() -> None:
    out = translate(b"\xef\xbb\xbf# Titel\r\n\r\nText hier.\r\n")[1]
    assert out == "\ufeff# TITEL\r\n\r\nTEXT HIER.\r\n"


def test_a_document_without_text_comes_back_as_it_was() -> None:
    source = "```\ncode\n```\n\n---\n\n![Bild](a.png)\n"
    assert translate(source) == ((), source)


def test_a_collapsed_reference_link_keeps_its_reference_when_its_text_is_translated() -> None:
    source = "Siehe [die Quelle][] und [`code` Text][].\n\n[die Quelle]: /q\n[`code` Text]: /c\n"
    out = translate(source, lambda s: "See the source and code text.")[1]
    assert "][die Quelle]" in out and "][`code` Text]" in out
    assert kept(out) == kept(source)
    assert translate(source)[1] == source.replace("Siehe", "SIEHE").replace(" und", " UND").replace(
        "[die Quelle][]", "[DIE QUELLE][die Quelle]"
    ).replace("` Text][]", "` TEXT][`code` Text]")


def test_markup_inside_words_and_around_code_comes_back_in_place() -> None:
    source = "Die **Ecma**s Norm, [`zlib`](https://zlib.net) und (`a`, `b`)"
    source += " mit <kbd>Strg</kbd>+<kbd>C</kbd> hier.\n"
    assert translate(source, lambda s: s)[1] == source


def test_code_spans_that_meet_in_a_shorter_translation_stay_apart() -> None:
    source = "Mit `a` und `b` und `c` geht es.\n"
    out = translate(source, lambda s: "Works.")[1]
    assert kept(out) == kept(source)


def test_a_line_break_with_no_words_left_for_its_line_is_dropped_not_left_empty() -> None:
    source = "> Eins zwei drei\n> vier fünf sechs\n> sieben acht neun.\n"
    out = translate(source, lambda s: "One two.")[1]
    assert "\n>\n" not in out and "\n> \n" not in out
    assert kept(out) == kept(source)


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_samples_keep_their_structure(name: str) -> None:
    data = SAMPLES[name]()
    sentences, out = translate(data, name=name)
    assert sentences
    check_structure(name, data, out.encode("utf-8"))
    assert sentences[0].upper() in out.replace("*", "")


# --- hostile files -------------------------------------------------------------------------------


def test_a_megabyte_of_text_is_too_large() -> None:
    with pytest.raises(TooLarge, match="too much text"):
        read("a.md", b"Wort " * 200_000, LIMITS)


def test_too_many_elements_are_refused_while_reading() -> None:
    few = dataclasses.replace(LIMITS, max_elements=1_000)
    with pytest.raises(TooLarge, match="elements"):
        read("a.md", b"- a\n" * 100_000, few)
    with pytest.raises(TooLarge, match="elements"):  # inline ones count too
        read("a.md", b"*a* " * 10_000, few)


def test_deeply_nested_quotes_and_lists_are_refused() -> None:
    with pytest.raises(TooLarge, match="nests"):
        read("a.md", b">" * 100_000 + b" tief\n", LIMITS)
    with pytest.raises(TooLarge, match="nests"):
        read(
            "a.md",
            b"".join(b"  " * i + b"- x\n" for i in range(40)),
            dataclasses.replace(LIMITS, max_depth=20),
        )


@pytest.mark.parametrize(
    ("data", "error", "message"),
    [(b"# Titel\n\n\xe4\xfc\n", DocumentError, "not UTF-8"), (b"# Titel\x00\n", Forbidden, "NUL")],
)
def test_unreadable_markdown_is_refused_with_a_reason(data: bytes, error: type, message: str) -> None:
    with pytest.raises(error, match=message) as raised:
        read("a.md", data, LIMITS)
    assert raised.type is error
