"""data_pipeline.quality: each rule drops what it is for, and the defaults keep real text."""
from __future__ import annotations

import bz2
import random

import pytest

from data_pipeline.config import QualityConfig
from data_pipeline.decoding import decode_document
from data_pipeline.quality import check, document_stats
from data_pipeline.text import strip_gutenberg, text_to_sentences
from tests.conftest import SAMPLES, SHARED_DATA

PROSE = ("The committee met on a grey morning in the old hall by the river, and after a long discussion "
         "of the accounts it agreed that the bridge should be repaired before the winter floods arrived. ")


def rule(text: str, **kw) -> str | None:
    return check(text, QualityConfig(**kw))[0]


def test_prose_passes_and_its_stats_add_up():
    text = PROSE * 3
    s = document_stats(text)
    assert rule(text) is None
    assert s.words == 3 * len(PROSE.split())
    assert 0.95 < s.letter_fraction <= 1.0 and 4.0 < s.mean_word_length < 5.5
    assert s.duplicate_line_fraction == 0.0  # one line


@pytest.mark.parametrize("text,want", [
    ("Too short to be a document of any use.", "too_few_words"),
    (PROSE.replace("e", "\ufffd") * 2, "replacement_characters"),
    (PROSE.replace(" ", " \x01") * 2, "control_characters"),
    (" ".join(f"{i:06d} {i * 7 % 1000:03d}" for i in range(200)), "few_letters"),
    (" ".join(["supercalifragilisticexpialidocious"] * 80), "mean_word_length"),
    (" ".join(["a", "b", "c", "d"] * 40), "mean_word_length"),
    ("Home | About us | Contact | Privacy policy | Terms of use | Careers | Press | Blog | " * 8, "symbols"),
    ("\n".join(["Subscribe to our newsletter for the latest offers and news today"] * 9
               + [PROSE]), "repeated_lines"),
])
def test_each_rule_catches_its_case(text, want):
    assert rule(text) == want


def test_repeated_paragraphs():
    text = "\n\n".join([PROSE, "Click here to read more about this and many other stories on our site now."] * 4)
    assert rule(text) == "repeated_lines"  # a one-line paragraph is a line: that rule comes first
    assert rule(text, max_duplicate_line_fraction=1.0, max_duplicate_line_char_fraction=1.0) == "repeated_paragraphs"


def test_every_rule_can_be_loosened():
    assert rule("Too short to be a document of any use.", min_words=5) is None
    assert rule(" ".join(["a", "b", "c", "d"] * 40), min_mean_word_length=0.5) is None


def test_random_bytes_decoded_as_latin1_are_dropped():
    data = random.Random(5).randbytes(200_000)
    assert decode_document(data) is None  # the decoder already refuses them
    assert rule(data.decode("latin-1")) is not None  # and the filters would too


def test_bundled_samples_pass():
    from data_pipeline.wikitext import article_paragraphs, iter_page_blobs, parse_page

    n = 0
    for path in sorted((SAMPLES / "books").glob("*.txt")):
        text = strip_gutenberg(decode_document(path.read_bytes()).text)[0]
        assert rule(text) is None, path.name
    with bz2.open(SAMPLES / "wiki" / "enwiki-sample-pages-articles.xml.bz2") as f:
        for kind, blob in iter_page_blobs(f, 64 << 20):
            page, _ = parse_page(blob)
            if kind != "page" or page is None or page.ns != 0 or page.redirect:
                continue
            paras = article_paragraphs(page.title, page.text)
            if paras:
                n += 1
                assert rule("\n\n".join(paras)) is None, page.title
    assert n > 20


@pytest.mark.shared
def test_every_shared_article_and_book_passes_the_defaults():
    from data_pipeline.wikitext import article_paragraphs, iter_page_blobs, parse_page

    books = sorted((SHARED_DATA / "books").glob("*.txt"))
    assert len(books) == 14
    for path in books:
        text = strip_gutenberg(decode_document(path.read_bytes()).text)[0]
        assert rule(text) is None, (path.name, document_stats(text))
        bert_format = "\n".join(text_to_sentences(text))  # a sentence a line: the "text" source kind
        assert rule(bert_format) is None, (path.name, document_stats(bert_format))
    articles = 0
    with bz2.open(SHARED_DATA / "wiki" / "enwiki-pages-articles-shortened.xml.bz2") as f:
        for kind, blob in iter_page_blobs(f, 64 << 20):
            page, _ = parse_page(blob)
            if kind != "page" or page is None or page.ns != 0 or page.redirect:
                continue
            paras = article_paragraphs(page.title, page.text)
            if paras:
                articles += 1
                text = "\n\n".join(paras)
                assert rule(text) is None, (page.title, document_stats(text))
    assert articles >= 90
