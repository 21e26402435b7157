"""XLIFF 1.2 and 2.x (app.formats.xliff) through ``read`` -> ``split`` -> ``join`` with the
upper-case stand-in translator: targets filled, inline codes kept with their ids, units that hold
a person's translation or say translate="no" left alone, the output valid against the OASIS
schemas; and the hostile files: DTDs and entities, too many elements or characters, not XML, not
XLIFF."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
from lxml import etree

from app.config import Settings
from app.formats.documents import MEDIA_TYPES, SUPPORTED, read
from app.formats.limits import DocumentError, Forbidden, TooLarge
from tests.documents.xliff import NS2, NS12, SAMPLES, check_structure, schema

LIMITS = Settings().document_limits()  # the defaults


def translated(name: str, data: bytes, translate: Callable[[str], str] = str.upper) -> bytes:
    split = read(name, data, LIMITS).split("en")
    return split.join([translate(s) for s in split.sentences])


def xliff_12(body: str, declaration: str = '<?xml version="1.0" encoding="UTF-8"?>\n') -> bytes:
    return (
        f'{declaration}<xliff version="1.2" xmlns="{NS12}">\n'
        ' <file original="a.txt" source-language="en" target-language="de" datatype="plaintext">\n'
        f"  <body>\n{body}\n  </body>\n </file>\n</xliff>\n"
    ).encode()


def xliff_2(units: str, file_attributes: str = "") -> bytes:
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f'<xliff version="2.0" xmlns="{NS2}" srcLang="en" trgLang="de">\n'
        f' <file id="f1"{file_attributes}>\n{units}\n </file>\n</xliff>\n'
    ).encode()


def units_12(data: bytes) -> dict[str, etree._Element]:
    root = etree.fromstring(data)
    return {u.get("id"): u for u in root.iter(f"{{{NS12}}}trans-unit")}


def target_12(data: bytes, unit: str) -> str:
    target = units_12(data)[unit].find(f"{{{NS12}}}target")
    assert target is not None
    return inner(target)


def segments_2(data: bytes) -> dict[str, etree._Element]:
    root = etree.fromstring(data)
    return {s.get("id"): s for s in root.iter(f"{{{NS2}}}segment")}


def inner(element: etree._Element | None) -> str:
    assert element is not None
    text = etree.tostring(element, with_tail=False, encoding="unicode")
    return text.split(">", 1)[1].rsplit("</", 1)[0]


def valid(data: bytes, namespace: str) -> None:
    xsd = schema(namespace)
    assert xsd.validate(etree.fromstring(data).getroottree()), xsd.error_log


# --- the format in the registry ---------------------------------------------------------------------


def test_xlf_and_xliff_are_supported_as_application_xliff_xml() -> None:
    assert ".xlf" in SUPPORTED and ".xliff" in SUPPORTED
    assert MEDIA_TYPES[".xlf"] == MEDIA_TYPES[".xliff"] == "application/xliff+xml"


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_each_sample_keeps_its_structure_and_is_valid_against_its_schema(name: str) -> None:
    data = SAMPLES[name]()
    check_structure(name, data, translated(name, data))
    # A translation of another length moves the codes, never loses or reorders them.
    check_structure(name, data, translated(name, data, lambda s: f"Ein {s.lower()} und mehr"))


# --- XLIFF 1.2 --------------------------------------------------------------------------------------


def test_12_target_is_made_after_the_source_with_the_translation_and_marked_as_mt() -> None:
    data = xliff_12('<trans-unit id="1"><source>Open the file.</source><note>Menu</note></trans-unit>')
    out = translated("a.xlf", data)
    unit = units_12(out)["1"]
    assert [etree.QName(c).localname for c in unit] == ["source", "target", "note"]
    target = unit.find(f"{{{NS12}}}target")
    assert target is not None and target.text == "OPEN THE FILE."
    assert target.get("state") == "needs-review-translation"
    assert target.get("state-qualifier") == "mt-suggestion"
    valid(out, NS12)


def test_12_inline_codes_are_kept_in_the_target_with_their_ids_in_order() -> None:
    data = xliff_12(
        '<trans-unit id="1"><source>Click <g id="1" ctype="bold">the <x id="2"/> button</g> and '
        '<bpt id="3">&lt;i&gt;</bpt>wait<ept id="3">&lt;/i&gt;</ept>.<ph id="4">&lt;br/&gt;</ph>'
        ' Then <bx id="5"/>go<ex id="6"/> on.</source></trans-unit>'
    )
    out = translated("a.xlf", data)
    assert target_12(out, "1") == (
        'CLICK <g id="1" ctype="bold">THE <x id="2"/> BUTTON</g> AND '
        '<bpt id="3">&lt;i&gt;</bpt>WAIT<ept id="3">&lt;/i&gt;</ept>.<ph id="4">&lt;br/&gt;</ph>'
        ' THEN <bx id="5"/>GO<ex id="6"/> ON.'
    )
    valid(out, NS12)


def test_12_the_native_code_inside_ph_is_not_sent_to_be_translated() -> None:
    data = xliff_12('<trans-unit id="1"><source>Line<ph id="1">&lt;br/&gt;</ph> two.</source></trans-unit>')
    assert read("a.xlf", data, LIMITS).split("en").sentences == ("Line two.",)


def test_12_an_existing_target_gets_the_translation_and_keeps_its_other_attributes() -> None:
    data = xliff_12(
        '<trans-unit id="1"><source>Save</source><target xml:lang="de" state="new">Save</target></trans-unit>'
    )
    out = translated("a.xlf", data)
    target = units_12(out)["1"].find(f"{{{NS12}}}target")
    assert target is not None and target.text == "SAVE"
    assert target.get("{http://www.w3.org/XML/1998/namespace}lang") == "de"
    assert target.get("state") == "needs-review-translation"


def test_12_final_signed_off_approved_and_translated_units_are_left_untouched() -> None:
    kept = (
        '<trans-unit id="final"><source>No</source><target state="final">Nein</target></trans-unit>\n'
        '<trans-unit id="signed"><source>Go</source><target state="signed-off">Los</target></trans-unit>\n'
        '<trans-unit id="approved" approved="yes"><source>Help</source><target>Hilfe</target></trans-unit>\n'
        '<trans-unit id="done"><source>Yes</source><target state="translated">Ja</target></trans-unit>'
    )
    data = xliff_12(kept + '\n<trans-unit id="new"><source>No</source></trans-unit>')
    split = read("a.xlf", data, LIMITS).split("en")
    assert split.sentences == ("No",)
    out = split.join(["NEIN"])
    for unit in ("final", "signed", "approved", "done"):
        assert etree.tostring(units_12(out)[unit]) == etree.tostring(units_12(data)[unit])
    assert target_12(out, "new") == "NEIN"


def test_12_translate_no_on_a_unit_or_its_group_is_left_untouched() -> None:
    data = xliff_12(
        '<trans-unit id="brand" translate="no"><source>Acme</source></trans-unit>\n'
        '<group id="g" translate="no"><trans-unit id="code"><source>printf</source></trans-unit></group>\n'
        '<trans-unit id="t"><source>Print</source></trans-unit>'
    )
    split = read("a.xlf", data, LIMITS).split("en")
    assert split.sentences == ("Print",)
    out = split.join(["DRUCKEN"])
    assert units_12(out)["brand"].find(f"{{{NS12}}}target") is None
    assert units_12(out)["code"].find(f"{{{NS12}}}target") is None


def test_12_seg_source_segments_are_translated_each_into_its_mrk() -> None:
    data = xliff_12(
        '<trans-unit id="1"><source>One. Two <g id="1">more</g>.</source>'
        '<seg-source><mrk mtype="seg" mid="1">One.</mrk> '
        '<mrk mtype="seg" mid="2">Two <g id="1">more</g>.</mrk></seg-source></trans-unit>'
    )
    split = read("a.xlf", data, LIMITS).split("en")
    assert split.sentences == ("One.", "Two more.")
    out = split.join(["EINS.", "ZWEI MEHR."])
    unit = units_12(out)["1"]
    assert [etree.QName(c).localname for c in unit] == ["source", "seg-source", "target"]
    assert target_12(out, "1") == (
        '<mrk mtype="seg" mid="1">EINS.</mrk> <mrk mtype="seg" mid="2">ZWEI <g id="1">MEHR</g>.</mrk>'
    )
    valid(out, NS12)


def test_12_without_a_namespace_is_read_as_12() -> None:
    unit = b'<trans-unit id="1"><source>Hi.</source></trans-unit>'
    data = b'<xliff version="1.2"><file><body>' + unit + b"</body></file></xliff>"
    assert (
        b'<target state="needs-review-translation" state-qualifier="mt-suggestion">HI.</target>'
        in translated("a.xlf", data)
    )


# --- XLIFF 2.x --------------------------------------------------------------------------------------


def test_2_nested_pc_and_mrk_are_kept_around_the_translated_words() -> None:
    data = xliff_2(
        '<unit id="u"><segment id="s"><source>Read <pc id="1">the <pc id="2">new '
        '<mrk id="m" type="term">terms</mrk></pc> now</pc>.</source></segment></unit>'
    )
    out = translated("a.xliff", data)
    segment = segments_2(out)["s"]
    assert segment.get("state") == "translated"
    assert inner(segment.find(f"{{{NS2}}}target")) == (
        'READ <pc id="1">THE <pc id="2">NEW <mrk id="m" type="term">TERMS</mrk></pc> NOW</pc>.'
    )
    valid(out, NS2)


def test_2_placeholders_and_sc_ec_are_copied_with_their_ids() -> None:
    data = xliff_2(
        '<unit id="u"><originalData><data id="d1">&lt;b&gt;</data>'
        '<data id="d2">&lt;/b&gt;</data></originalData>'
        '<segment id="s"><source><sc id="1" dataRef="d1"/>Hot<ec startRef="1" dataRef="d2"/> and '
        '<ph id="2"/> cold.</source></segment></unit>'
    )
    out = translated("a.xliff", data)
    assert inner(segments_2(out)["s"].find(f"{{{NS2}}}target")) == (
        '<sc id="1" dataRef="d1"/>HOT<ec startRef="1" dataRef="d2"/> AND <ph id="2"/> COLD.'
    )
    valid(out, NS2)


def test_2_final_segments_ignorables_and_translate_no_are_left_untouched() -> None:
    data = xliff_2(
        '<unit id="u"><segment id="a"><source>One.</source></segment>'
        "<ignorable><source> </source></ignorable>"
        '<segment id="b" state="final"><source>Two.</source><target>Zwei.</target></segment>'
        '<segment id="c" state="reviewed"><source>Three.</source><target>Drei.</target></segment></unit>\n'
        '<unit id="v" translate="no"><segment id="d"><source>Acme</source></segment></unit>\n'
        '<group id="g" translate="no">'
        '<unit id="w"><segment id="e"><source>Code</source></segment></unit></group>'
    )
    split = read("a.xliff", data, LIMITS).split("en")
    assert split.sentences == ("One.",)
    out = split.join(["EINS."])
    before, after = segments_2(data), segments_2(out)
    for kept in "bcde":
        assert etree.tostring(after[kept]) == etree.tostring(before[kept])
    assert inner(after["a"].find(f"{{{NS2}}}target")) == "EINS."
    assert b"<ignorable><source> </source></ignorable>" in out
    valid(out, NS2)


def test_2_translate_no_on_the_file_leaves_every_unit() -> None:
    data = xliff_2('<unit id="u"><segment><source>Hi.</source></segment></unit>', ' translate="no"')
    assert read("a.xliff", data, LIMITS).split("en").sentences == ()


def test_21_files_are_read_as_2x() -> None:
    data = xliff_2('<unit id="u"><segment id="s"><source>Hi.</source></segment></unit>').replace(
        b'version="2.0"', b'version="2.1"'
    )
    out = translated("a.xliff", data)
    assert inner(segments_2(out)["s"].find(f"{{{NS2}}}target")) == "HI."
    valid(out, NS2)


# --- what is kept byte for byte ---------------------------------------------------------------------


def test_a_file_with_nothing_to_translate_is_written_back_unchanged() -> None:
    data = (
        b"\xef\xbb\xbf<?xml version='1.0' encoding='utf-8'?>\n<!-- exported -->\n<?tool x=\"1\"?>\n"
        + xliff_12('<trans-unit id="1" translate="no"><source>Acme &amp; Co</source></trans-unit>', "")
    )
    assert translated("a.xlf", data) == data


def test_declaration_comments_namespaces_and_notes_are_kept() -> None:
    data = (
        '<?xml version="1.0" encoding="UTF-8" standalone="yes"?>\n<!-- from the tool -->\n'
        f'<x:xliff version="1.2" xmlns:x="{NS12}" xmlns:acme="urn:acme"><x:file original="a" '
        'source-language="en" datatype="plaintext"><x:body><!-- unit 1 -->\n'
        '<x:trans-unit id="1" acme:flag="on"><x:source>Hi.</x:source><x:note>Greeting</x:note>'
        "</x:trans-unit></x:body></x:file></x:xliff>\n"
    ).encode()
    out = translated("a.xlf", data)
    assert out.startswith(
        b'<?xml version="1.0" encoding="UTF-8" standalone="yes"?>\n<!-- from the tool -->\n'
    )
    assert b'<x:target state="needs-review-translation" state-qualifier="mt-suggestion">HI.</x:target>' in out
    target = b'<x:target state="needs-review-translation" state-qualifier="mt-suggestion">HI.</x:target>'
    assert out == data.replace(b"</x:source>", b"</x:source>" + target)


def test_another_encoding_is_written_back_as_utf8_and_says_so() -> None:
    data = (
        xliff_12(
            '<trans-unit id="1"><source>Café.</source></trans-unit>',
            '<?xml version="1.0" encoding="ISO-8859-1"?>\n',
        )
        .decode()
        .encode("latin-1")
    )
    out = translated("a.xlf", data)
    assert b"encoding='UTF-8'" in out.splitlines()[0]
    assert target_12(out, "1") == "CAFÉ."
    utf16 = xliff_12('<trans-unit id="1"><source>Thé.</source></trans-unit>', "").decode().encode("utf-16")
    assert target_12(translated("a.xlf", utf16), "1") == "THÉ."


# --- hostile files ----------------------------------------------------------------------------------


def billion_laughs() -> bytes:
    entities = '<!ENTITY lol "lol">' + "".join(
        f'<!ENTITY lol{i} "{("&lol;" if i == 1 else f"&lol{i - 1};") * 10}">' for i in range(1, 10)
    )
    return xliff_12(
        '<trans-unit id="1"><source>&lol9;</source></trans-unit>',
        f'<?xml version="1.0"?>\n<!DOCTYPE xliff [{entities}]>\n',
    )


@pytest.mark.parametrize(
    "data",
    [
        billion_laughs(),
        xliff_12(
            '<trans-unit id="1"><source>&secret;</source></trans-unit>',
            '<?xml version="1.0"?>\n<!DOCTYPE xliff [<!ENTITY secret SYSTEM "file:///etc/passwd">]>\n',
        ),
        xliff_12(
            '<trans-unit id="1"><source>Hi</source></trans-unit>',
            '<!DOCTYPE xliff SYSTEM "http://x/x.dtd">\n',
        ),
        xliff_12('<trans-unit id="1"><source>Hi</source></trans-unit>', "<!DOCTYPE xliff>\n"),
        xliff_12(
            '<trans-unit id="1"><source>&a;</source></trans-unit>',
            '<?xml version="1.0"?>\n<!-- c --><?pi x?>\n<!DOCTYPE xliff [<!ENTITY a "b">]>\n',
        ),
    ],
    ids=["billion-laughs", "external-entity", "external-dtd", "bare-doctype", "after-a-comment"],
)
def test_a_doctype_is_refused_with_422(data: bytes) -> None:
    with pytest.raises(Forbidden, match="DOCTYPE") as caught:
        read("a.xlf", data, LIMITS)
    assert caught.value.status == 422


def test_too_many_elements_is_413() -> None:
    limits = dataclasses.replace(LIMITS, max_elements=50)
    data = xliff_12("\n".join(f'<trans-unit id="{i}"><source>Hi</source></trans-unit>' for i in range(30)))
    with pytest.raises(TooLarge, match="XML elements") as caught:
        read("a.xlf", data, limits)
    assert caught.value.status == 413


def test_elements_nested_too_deep_are_413() -> None:
    nested = '<g id="1">' * 1000 + "Hi" + "</g>" * 1000
    data = xliff_12(f'<trans-unit id="1"><source>{nested}</source></trans-unit>')
    with pytest.raises(TooLarge, match="too deep"):
        read("a.xlf", data, LIMITS)


def test_too_much_text_is_413() -> None:
    limits = dataclasses.replace(LIMITS, max_chars=100)
    data = xliff_2(
        "\n".join(
            f'<unit id="{i}"><segment><source>{"word " * 10}</source></segment></unit>' for i in range(5)
        )
    )
    with pytest.raises(TooLarge, match="too much text"):
        read("a.xliff", data, limits)


@pytest.mark.parametrize(
    "data, message",
    [
        (b'<xliff version="1.2" xmlns="urn:oasis:names:tc:xliff:document:1.2"><file>', "not well-formed"),
        (b"", "not well-formed"),
        (b"\x00\x01 binary", "not well-formed"),
        (b'<xliff version="1.2"><source>&undefined;</source></xliff>', "not well-formed"),
        (b"<html><body><p>Hi</p></body></html>", "not an XLIFF document"),
        (b'<xliff xmlns="urn:other">Hi</xliff>', "not an XLIFF document"),
    ],
    ids=["truncated", "empty", "binary", "undefined-entity", "html-root", "other-namespace"],
)
def test_malformed_or_not_xliff_is_400(data: bytes, message: str) -> None:
    with pytest.raises(DocumentError, match=message) as caught:
        read("a.xlf", data, LIMITS)
    assert caught.value.status == 400
