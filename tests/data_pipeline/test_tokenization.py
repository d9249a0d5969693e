"""Fast WordPiece (tokenizers) == BERT's reference Python tokenizer, id for id; vocab layout."""
from __future__ import annotations

import pytest

from data_pipeline.text import text_to_sentences


@pytest.mark.shared
@pytest.mark.parametrize("case", ["uncased", "cased"])
def test_fast_equals_reference_tokenizer_on_real_text(shared_data, case):
    import bz2

    from transformers.models.bert.tokenization_bert_legacy import BertTokenizerLegacy

    from data_pipeline.tokenization import load_tokenizer
    from data_pipeline.wikitext import article_paragraphs, iter_page_blobs, parse_page

    vocab = shared_data / "vocab" / f"bert-base-{case}-vocab.txt"
    fast, lowercase = load_tokenizer(vocab)
    assert lowercase == (case == "uncased")
    slow = BertTokenizerLegacy(str(vocab), do_lower_case=lowercase)
    sents = text_to_sentences((shared_data / "books" / "melville-moby_dick.txt").read_text())[:1500]
    with bz2.open(shared_data / "wiki" / "enwiki-pages-articles-shortened.xml.bz2", "rb") as f:
        for n, (kind, blob) in enumerate(iter_page_blobs(f, 1 << 26)):
            page = parse_page(blob)[0]
            if page and not page.redirect and page.ns == 0 and len(sents) < 3000:
                for p in article_paragraphs(page.title, page.text) or []:
                    sents += text_to_sentences(p)
    sents += ["Café naïve résumé — “quoted” 東京 [MASK] text [UNK] x", "ﬁve\u200bzero\ttab\u00adsoft"]
    got = [e.ids for e in fast.encode_batch_fast(sents, add_special_tokens=False)]
    want = [slow.convert_tokens_to_ids(slow.tokenize(s)) for s in sents]
    bad = [(s, g, w) for s, g, w in zip(sents, got, want) if g != w]
    assert not bad, bad[:3]
    assert len(sents) > 2000


def test_trained_vocab_has_bert_special_ids(small_vocab):
    from bertdist.data.vocab import load_vocab, special_token_ids

    tokens = load_vocab(small_vocab)
    assert len(tokens) == 3000
    assert special_token_ids(tokens) == {"pad": 0, "unk": 100, "cls": 101, "sep": 102, "mask": 103}
    assert tokens[1] == "[unused0]" and any(t.startswith("##") for t in tokens)


def test_gutenberg_and_text_helpers():
    from data_pipeline.text import cut_long_sentence, decode_bytes, strip_gutenberg

    body, stripped = strip_gutenberg("head\n*** START OF THE PROJECT GUTENBERG EBOOK A ***\nBody text.\n"
                                     "End of the Project Gutenberg EBook of A\nlicence")
    assert stripped and body.strip() == "Body text."
    assert strip_gutenberg("No markers here.") == ("No markers here.", False)
    assert decode_bytes(b"ok \xff bad") == ("ok   bad", True)
    parts = cut_long_sentence("word " * 100, 50)
    assert all(len(p) <= 50 for p in parts) and " ".join(parts).split() == ["word"] * 100
