"""Text to tokens: sentence splitting and WordPiece, one document at a time."""
from __future__ import annotations

import os
from itertools import repeat

import apache_beam as beam

from data_pipeline import text as textlib
from data_pipeline.beam.metrics import Progress, count, log


class SplitSentences(beam.PTransform):
    """(doc_id, text) -> (doc_id, [sentences]) with blingfire (see data_pipeline.text)."""

    def expand(self, docs):
        return docs | "Split" >> beam.Map(lambda kv: (kv[0], textlib.text_to_sentences(kv[1])))


class SplitLines(beam.PTransform):
    """(doc_id, one sentence per line) -> (doc_id, [sentences]): BERT-format text, whose lines
    are the sentences (ReadBertFormatText keeps only non-empty cleaned lines)."""

    def expand(self, docs):
        return docs | "Lines" >> beam.Map(lambda kv: (kv[0], kv[1].split("\n")))


class _TokenizeDoFn(beam.DoFn):
    def __init__(self, vocab_path: str, lowercase, min_sentences: int, max_sentences: int, max_sentence_chars: int):
        self.vocab_path, self.lowercase = vocab_path, lowercase
        self.min_sentences, self.max_sentences, self.max_sentence_chars = min_sentences, max_sentences, max_sentence_chars

    def setup(self):
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one thread per worker: honest per-core rates
        from data_pipeline.tokenization import load_encoder

        self.encoder = load_encoder(self.vocab_path, self.lowercase)
        log.info("tokenizer: %s", self.encoder.native_reason)
        self.progress = Progress("documents tokenized")

    def process(self, kv):
        doc_id, sentences = kv
        self.progress.tick()
        sents: list[str] = []
        for s in sentences:
            if len(s) > self.max_sentence_chars:
                count("repaired_long_sentence_cut")
                sents.extend(textlib.cut_long_sentence(s, self.max_sentence_chars))
            else:
                sents.append(s)
        if not sents:
            count("skipped_empty_document")
            return
        count("input_words", sum(map(str.count, sents, repeat(" "))) + len(sents))  # words = spaces + 1
        ids, bounds = self.encoder.encode_document(sents)
        n = len(bounds) - 1
        if n < self.min_sentences:
            count("skipped_empty_document" if n == 0 else "skipped_too_few_sentences")
            return
        cuts = list(range(0, n, self.max_sentences)) + [n]
        if len(cuts) > 2:
            count("repaired_enormous_document_split")
        for j in range(len(cuts) - 1):
            lo, hi = cuts[j], cuts[j + 1]
            if hi - lo < self.min_sentences:
                continue
            part_bounds = bounds[lo:hi + 1] - bounds[lo]
            count("documents")
            count("sentences", hi - lo)
            yield ((doc_id if len(cuts) == 2 else f"{doc_id}#part{j}"), ids[bounds[lo]:bounds[hi]], part_bounds)


class Tokenize(beam.PTransform):
    """(doc_id, [sentences]) -> (doc_id, ids, sentence bounds): fast WordPiece for a ``vocab.txt``,
    the tokenizer itself for a Hugging Face ``tokenizer.json``."""

    def __init__(self, vocab_path: str, lowercase=None, *, min_sentences: int = 2,
                 max_document_sentences: int = 20_000, max_sentence_chars: int = 20_000):
        super().__init__()
        self.fn = _TokenizeDoFn(vocab_path, lowercase, min_sentences, max_document_sentences, max_sentence_chars)

    def expand(self, docs):
        return docs | "Tokenize" >> beam.ParDo(self.fn)
