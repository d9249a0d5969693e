"""data_pipeline.decoding: non-UTF-8 text comes out with its letters, garbage does not come out."""
from __future__ import annotations

import io
import random

import pytest

from data_pipeline.decoding import decode_document, decode_line
from data_pipeline.sources import read_text_document
from tests.conftest import SHARED_DATA

FRENCH = "Le café était très agréable; à côté, une crème brûlée. Où est le garçon? Voilà, déjà.\n"
CP1252 = "He said \u201chello\u201d \u2014 and paid \u20ac5 for the caf\u00e9\u2019s cr\u00e8me br\u00fbl\u00e9e\u2026 na\u00efve fa\u00e7ade.\n"
JAPANESE = "吾輩は猫である。名前はまだ無い。どこで生れたかとんと見当がつかぬ。何でも薄暗いじめじめした所で泣いていた事だけは記憶している。\n"
CZECH = "Příliš žluťoučký kůň úpěl ďábelské ódy. Česká republika je stát ve střední Evropě.\n"


@pytest.mark.parametrize("text,encoding", [(FRENCH, "latin-1"), (CP1252, "cp1252"), (JAPANESE, "shift_jis"),
                                           (CZECH, "cp1250")])
@pytest.mark.parametrize("repeat", [1, 20])
def test_non_utf8_documents_keep_every_letter(text, encoding, repeat):
    doc = text * repeat
    out = decode_document(doc.encode(encoding))
    assert out is not None and out.text == doc, (encoding, out)
    assert out.encoding != "utf_8"


def test_utf8_is_taken_as_is():
    out = decode_document(CP1252.encode("utf-8"))
    assert out.text == CP1252 and out.encoding == "utf_8"


def test_random_bytes_are_not_a_document():
    r = random.Random(7)
    for _ in range(3):
        assert decode_document(r.randbytes(200_000)) is None


def test_book_reader_skips_and_counts_random_bytes():
    text, events = read_text_document(io.BytesIO(random.Random(3).randbytes(200_000)), 1 << 20)
    assert text is None and events == ["skipped_undecodable_document"]
    text, events = read_text_document(io.BytesIO(("Caf\u00e9 au lait. " * 50).encode("latin-1")), 1 << 20)
    assert text.startswith("Caf\u00e9 au lait.") and events == ["decoded_cp1252"]


def test_a_line_in_a_mixed_file_decodes_by_itself():
    assert decode_line("naïve".encode("utf-8"), "cp1252") == "naïve"
    assert decode_line("naïve".encode("cp1252"), "cp1252") == "naïve"
    assert decode_line(b"\x81\x8d", None) is None


@pytest.mark.shared
@pytest.mark.parametrize("name,words", [("chesterton-ball.txt", ["Brunetière", "Coppée"]),
                                        ("shakespeare-caesar.txt", ["Cæsar"])])
def test_latin1_books_in_shared_data(name, words):
    with open(SHARED_DATA / "books" / name, "rb") as f:
        text, events = read_text_document(f, 50_000_000)
    assert events == ["decoded_cp1252"]
    for w in words:
        assert w in text
    assert "\ufffd" not in text
