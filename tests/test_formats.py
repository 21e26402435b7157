"""HTML and documents as sentences and back (app.formats), with stand-in translators whose output
is known: markup kept, text translated, sentences split across inline tags, untranslated elements
left alone."""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from html.parser import HTMLParser

import docx
import pytest

from app.config import Settings
from app.formats.documents import read
from app.formats.html import HtmlDocument
from app.formats.inline import Block, Mark
from app.formats.limits import DocumentError
from app.translation.segments import sentence_spans

Translate = Callable[[str], str]
LIMITS = Settings().document_limits()  # the defaults


def upper(sentence: str) -> str:
    """A translator that keeps every word in place: marks must come back exactly where they were."""
    return sentence.upper()


def translate_html(markup: str, translate: Translate = upper) -> tuple[tuple[str, ...], str]:
    layout = HtmlDocument.parse(markup).split("de")
    return layout.sentences, layout.join([translate(s) for s in layout.sentences])


class Tags(HTMLParser):
    """The markup of a document as (kind, tag, attributes) in order, text left out."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, str, list[tuple[str, str | None]]]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(("start", tag, attrs))

    def handle_endtag(self, tag: str) -> None:
        self.tags.append(("end", tag, []))

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def tags(markup: str) -> list[tuple[str, str, list[tuple[str, str | None]]]]:
    parser = Tags()
    parser.feed(markup)
    return parser.tags


# --- sentences across inline tags ---------------------------------------------------------------


def test_a_sentence_with_nested_inline_markup_is_translated_whole() -> None:
    markup = (
        '<p>Ein <b>großer <i>roter</i> Hund</b> läuft. Die <a href="/k?a=1&amp;b=2">Katze</a> schläft.</p>'
    )
    sentences, out = translate_html(markup)
    assert sentences == ("Ein großer roter Hund läuft.", "Die Katze schläft.")
    assert out == (
        '<p>EIN <b>GROSSER <i>ROTER</i> HUND</b> LÄUFT. DIE <a href="/k?a=1&amp;b=2">KATZE</a> SCHLÄFT.</p>'
    )


def test_inline_tags_follow_the_words_when_the_translation_changes_length() -> None:
    """Proportional placement: a tag around the 2nd of 3 words goes around the 2nd of 3 target
    words; every tag stays, nested as before, and no element is left empty."""
    markup = "<p>Ein <em>großer</em> Hund.</p>"
    out = translate_html(markup, lambda s: "A big dog.")[1]
    assert out == "<p>A <em>big</em> dog.</p>"
    longer = translate_html(
        "<p><b>Ein <i>großer</i> Hund</b> läuft.</p>", lambda s: "A very big dog is running."
    )[1]
    assert tags(longer) == tags("<p><b>Ein <i>großer</i> Hund</b> läuft.</p>")
    assert "<i></i>" not in longer and "<b></b>" not in longer
    shorter = translate_html("<p>Ein <b>sehr</b> <i>großer</i> Hund.</p>", lambda s: "Big.")[1]
    assert tags(shorter) == tags("<p>Ein <b>sehr</b> <i>großer</i> Hund.</p>")


def test_punctuation_stays_outside_inline_tags() -> None:
    out = translate_html("<p>Er las &#8222;<i>Faust</i>&#8220;.</p>", lambda s: "He read „Faust“.")[1]
    assert out == "<p>He read &#8222;<i>Faust</i>&#8220;.</p>"
    assert translate_html("<p>Er <b>las</b>.</p>", lambda s: "He read.")[1] == "<p>He <b>read</b>.</p>"


def test_tags_between_sentences_stay_between_them() -> None:
    markup = "<p><b>Erster Satz.</b> <i>Zweiter Satz.</i></p>"
    sentences, out = translate_html(markup, lambda s: {"Erster Satz.": "One.", "Zweiter Satz.": "Two."}[s])
    assert sentences == ("Erster Satz.", "Zweiter Satz.")
    assert out == "<p><b>One.</b> <i>Two.</i></p>"


def test_block_tags_separate_sentences() -> None:
    sentences, out = translate_html("<ul><li>Ein Hund</li><li>Eine Katze</li></ul><p>Ja<br>nein</p>")
    assert sentences == ("Ein Hund", "Eine Katze", "Ja", "nein")
    assert out == "<ul><li>EIN HUND</li><li>EINE KATZE</li></ul><p>JA<br>NEIN</p>"


# --- what is kept as it is -----------------------------------------------------------------------


def test_script_style_code_and_translate_no_are_not_translated() -> None:
    markup = (
        "<!DOCTYPE html><html><head><title>Titel</title><style>p > b { color: red }</style>"
        '<script>if (a < b) { s = "</p> Hallo"; }</script></head><body>'
        "<pre><code>def hallo(): pass</code></pre>"
        '<div translate="no">Nicht übersetzen</div><span class="x notranslate">Name</span>'
        "<!-- ein Kommentar --><p>Rufen Sie <code>hallo()</code> auf.</p></body></html>"
    )
    sentences, out = translate_html(markup)
    assert sentences == ("Titel", "Rufen Sie auf.")
    assert "<style>p > b { color: red }</style>" in out
    assert '<script>if (a < b) { s = "</p> Hallo"; }</script>' in out
    assert "<pre><code>def hallo(): pass</code></pre>" in out
    assert '<div translate="no">Nicht übersetzen</div>' in out
    assert '<span class="x notranslate">Name</span>' in out
    assert "<!-- ein Kommentar -->" in out
    assert "<p>RUFEN SIE <code>hallo()</code> AUF.</p>" in out
    assert out.startswith("<!DOCTYPE html><html><head><title>TITEL</title>")


def test_attributes_and_entities_are_kept() -> None:
    markup = (
        "<p title='Ein &quot;Titel&quot;' data-x=1>"
        "AT&amp;T kauft &lt;Dinge&gt; f&uuml;r 5&nbsp;&euro; &copy;</p>"
    )
    sentences, out = translate_html(markup, lambda s: s)
    assert sentences == ("AT&T kauft <Dinge> für 5 € ©",)  # the model reads characters
    assert out.startswith("<p title='Ein &quot;Titel&quot;' data-x=1>")
    assert "AT&amp;T kauft &lt;Dinge&gt; f&uuml;r" in out and "&euro; &copy;</p>" in out


def test_text_without_markup_and_blank_documents() -> None:
    assert translate_html("Ein Hund. Eine Katze.") == (("Ein Hund.", "Eine Katze."), "EIN HUND. EINE KATZE.")
    assert translate_html("<p>  </p>\n<br>") == ((), "<p>  </p>\n<br>")
    assert translate_html("") == ((), "")


def test_a_document_without_changes_comes_back_as_it_was() -> None:
    markup = (
        '<div class="a">\n  <p>Ein <b>Hund</b> läuft.</p>\n  <p>Zwei <a href="#x">Katzen</a>!</p>\n</div>\n'
    )
    layout = HtmlDocument.parse(markup).split("de")
    assert layout.join(layout.sentences) == markup


@pytest.mark.parametrize(
    "markup", ["<", "<p", "</", "<!", "<![CDATA[", "<?", "&", "&#", "&#x;", "<a <b>", "<p>x</q>"]
)
def test_broken_markup_gives_an_answer(markup: str) -> None:
    layout = HtmlDocument.parse(markup).split("de")
    layout.join([s for s in layout.sentences])  # no exception, whatever the tokenizer made of it


# --- the placement itself --------------------------------------------------------------------------


def test_marks_keep_their_order_and_stay_within_the_translation() -> None:
    text = "Ein großer roter Hund läuft schnell."
    marks = tuple(Mark(o, side) for o, side in [(4, "before"), (10, "after"), (11, "before"), (16, "after")])
    split = Block(text, marks).split("de")
    for translation in ["A dog.", "A big red dog runs very fast indeed.", "Dog", ""]:
        out, offsets = split.place([translation])
        assert out == translation
        assert offsets == sorted(offsets) and all(0 <= o <= len(out) for o in offsets)


def test_sentence_spans_point_into_the_text() -> None:
    text = "  Ein Mann, z. B. Dr. Müller,\n läuft.   Der Hund bellt!  "
    spans = sentence_spans(text, "de")
    assert [text[s:e] for s, e in spans] == ["Ein Mann, z. B. Dr. Müller,\n läuft.", "Der Hund bellt!"]


# --- files ---------------------------------------------------------------------------------------


def translate_file(name: str, data: bytes, translate: Translate = upper) -> tuple[Sequence[str], bytes]:
    layout = read(name, data, LIMITS).split("de")
    return layout.sentences, layout.join([translate(s) for s in layout.sentences])


def test_text_file_keeps_its_layout_and_byte_order_mark() -> None:
    data = "\ufeffEin Hund.  Eine Katze.\n\n  Zwei Kinder.\n".encode()
    sentences, out = translate_file("a.txt", data)
    assert sentences == ("Ein Hund.", "Eine Katze.", "Zwei Kinder.")
    assert out == "\ufeffEIN HUND. EINE KATZE.\n\n  ZWEI KINDER.\n".encode()


def test_html_file() -> None:
    assert translate_file("a.HTM", b"<p>Ein <b>Hund</b>.</p>")[1] == b"<p>EIN <b>HUND</b>.</p>"


def make_docx() -> bytes:
    document = docx.Document()
    paragraph = document.add_paragraph("Ein ")
    paragraph.add_run("großer").bold = True
    paragraph.add_run(" Hund läuft. Die Katze schläft.")
    document.add_paragraph("")
    table = document.add_table(rows=1, cols=2)
    table.cell(0, 0).text = "Zelle eins."
    table.cell(0, 1).add_table(rows=1, cols=1).cell(0, 0).text = "Innen."
    document.sections[0].header.paragraphs[0].text = "Kopfzeile."
    document.sections[0].footer.paragraphs[0].text = "Fußzeile."
    out = io.BytesIO()
    document.save(out)
    return out.getvalue()


def test_docx_keeps_runs_tables_headers_and_footers() -> None:
    sentences, out = translate_file("brief.docx", make_docx())
    assert sentences == (
        "Ein großer Hund läuft.",
        "Die Katze schläft.",
        "Zelle eins.",
        "Innen.",
        "Kopfzeile.",
        "Fußzeile.",
    )
    document = docx.Document(io.BytesIO(out))
    runs = [(run.text, run.bold) for run in document.paragraphs[0].runs]
    assert runs == [("EIN ", None), ("GROSSER", True), (" HUND LÄUFT. DIE KATZE SCHLÄFT.", None)]
    cell = document.tables[0].cell(0, 0)
    assert cell.text == "ZELLE EINS."
    assert document.tables[0].cell(0, 1).tables[0].cell(0, 0).text == "INNEN."
    assert document.sections[0].header.paragraphs[0].text == "KOPFZEILE."
    assert document.sections[0].footer.paragraphs[0].text == "FUSSZEILE."


@pytest.mark.parametrize(
    ("name", "data", "message"),
    [
        ("a.docx", b"not a zip", "not a .docx document"),
        ("a.docx", make_docx()[:200], "not a .docx document"),
        ("a.txt", b"caf\xe9", "not UTF-8"),
        ("a.html", b"\xff\xfe<p>", "not UTF-8"),
    ],
)
def test_unreadable_files_are_refused_with_a_reason(name: str, data: bytes, message: str) -> None:
    with pytest.raises(DocumentError, match=message):
        read(name, data, LIMITS)
