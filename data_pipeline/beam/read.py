"""Beam readers, one composite PTransform per input kind (Wikipedia XML dumps, books, BERT-format
text, JSON lines): (doc_id, text) per document. Parse DoFns count
every skipped or repaired input (``skipped_*``, ``repaired_*``) and the documents per source
encoding (``decoded_<codec>``: data_pipeline.decoding); nothing is dropped silently."""
from __future__ import annotations

import apache_beam as beam

from data_pipeline import sources, text as textlib
from data_pipeline.beam.metrics import Progress, count, event
from data_pipeline.sources import DIRECTORY_SUFFIX, match_file_sizes, match_files, relative_ids


class _ReadWikiPages(beam.DoFn):
    def __init__(self, max_page_bytes: int):
        self.max_page_bytes = max_page_bytes

    def process(self, item):
        path, prefix = item
        from data_pipeline.wikitext import SKIP_EVENTS, iter_page_blobs

        with sources.open_input(path) as stream:
            try:
                for kind, blob in iter_page_blobs(stream, self.max_page_bytes):
                    if kind == "page":
                        yield blob
                    else:
                        event(SKIP_EVENTS[kind], path)
            except sources.STREAM_ERRORS as e:
                event("truncated_input_file", f"{path}: {e}; pages before the damage are kept")


class _ParseWikiPage(beam.DoFn):
    def __init__(self, prefix: str):
        self.prefix = prefix
        self.progress = None

    def process(self, blob: bytes):
        from data_pipeline.wikitext import article_paragraphs, parse_page

        if self.progress is None:
            self.progress = Progress("wiki pages parsed")
        self.progress.tick()
        page, encoding = parse_page(blob)
        if encoding is None:
            event("skipped_undecodable_document", f"wiki page {blob[:120]!r}")
            return
        count(sources.decoded_event(encoding))
        if page is None:
            event("skipped_wiki_malformed_page", blob[:120].decode("utf-8", "replace"))
            return
        if page.ns != 0:
            count("skipped_wiki_not_article_namespace")
            return
        if page.redirect:
            count("skipped_wiki_redirect")
            return
        try:
            paras = article_paragraphs(page.title, page.text)
        except Exception as e:  # the parser on pathological markup: one page lost, counted
            event("skipped_wiki_unparseable_page", f"{page.title}: {e!r}")
            return
        if paras is None:
            count("skipped_wiki_disambiguation")
            return
        yield (f"{self.prefix}{page.page_id}", "\n\n".join(paras))


class ReadWikipediaDump(beam.PTransform):
    """pages-articles XML (.xml / .xml.bz2, multistream ok) -> (doc_id, text), articles only."""

    def __init__(self, pattern: str, max_page_bytes: int = 64 << 20):
        super().__init__()
        self.files = match_files(pattern, directory_suffix=DIRECTORY_SUFFIX["wiki"])
        self.max_page_bytes = max_page_bytes

    def expand(self, pbegin):
        return (
            pbegin
            | "Files" >> beam.Create([(f, "") for f in self.files])
            | "SplitPages" >> beam.ParDo(_ReadWikiPages(self.max_page_bytes))
            | "Spread" >> beam.Reshuffle()
            | "Parse" >> beam.ParDo(_ParseWikiPage("wiki:"))
        )


class _ReadBook(beam.DoFn):
    def __init__(self, max_chars: int):
        self.max_chars = max_chars

    def process(self, item):
        path, rel = item
        with sources.open_input(path) as stream:
            text, events = sources.read_text_document(stream, self.max_chars)
        for e in events:
            event(e, path)
        if text is None:
            return
        text, stripped = textlib.strip_gutenberg(text)
        if stripped:
            count("repaired_gutenberg_boilerplate_stripped")
        yield (f"books:{rel}", text)


class ReadBooks(beam.PTransform):
    """A directory (or glob) of plain-text books -> (doc_id, text), one book per document."""

    def __init__(self, pattern: str, max_document_chars: int = 50_000_000):
        super().__init__()
        self.files = match_files(pattern, directory_suffix=DIRECTORY_SUFFIX["books"])
        self.max_chars = max_document_chars

    def expand(self, pbegin):
        ids = relative_ids(self.files)
        return (pbegin | "Files" >> beam.Create([(f, ids[f]) for f in self.files])
                | "Read" >> beam.ParDo(_ReadBook(self.max_chars)))


class _ReadBertText(beam.DoFn):
    def process(self, item):
        path, rel, start, end = item
        with sources.open_input(path) as stream:
            for a, b in sources.iter_bert_format(stream, start, end):
                if a == "!event":
                    event(b, path)
                else:
                    # one string, not a list: it goes through the quality rules, dedup and their
                    # shuffle as text, each pass one copy instead of one object per sentence
                    yield (f"text:{rel}:{a}", "\n".join(b))


def byte_ranges(path: str, size: int, split_bytes: int) -> list[tuple[int, int | None]]:
    """[start, end) ranges of about ``split_bytes`` for an uncompressed file; one open range
    for a compressed one (it can only be read from the start)."""
    if path.endswith((".bz2", ".gz")) or size <= split_bytes:
        return [(0, None)]
    cuts = list(range(0, size, split_bytes))
    return [(a, b) for a, b in zip(cuts, cuts[1:] + [None])]


class ReadBertFormatText(beam.PTransform):
    """One sentence per line, blank line between documents -> (doc_id, its cleaned non-empty
    lines joined by "\n"): :class:`data_pipeline.beam.tokenize.SplitLines` makes the sentences.

    Uncompressed files are read as byte ranges in parallel (documents are cut at blank lines,
    the id is the document's byte offset), so text never goes through a shuffle; compressed
    files are read whole and then spread over the workers."""

    def __init__(self, pattern: str, split_bytes: int | None = None):
        super().__init__()
        self.sizes = match_file_sizes(pattern, directory_suffix=DIRECTORY_SUFFIX["text"])
        self.files = list(self.sizes)
        self.split_bytes = split_bytes or self.auto_split_bytes(sum(self.sizes.values()))

    @staticmethod
    def auto_split_bytes(total: int, ranges: int = 32, lo: int = 1 << 20, hi: int = 8 << 20) -> int:
        """About ``ranges`` ranges for a small input, so that every worker gets a balanced share
        (runners hand out whole elements: two 8 MB-ranges of a 10 MB file are 8 MB against 2),
        and ranges of at most ``hi`` bytes for a large one."""
        return max(lo, min(hi, total // ranges))

    def expand(self, pbegin):
        ids = relative_ids(self.files)
        ranges = [(f, ids[f], a, b) for f in self.files for a, b in byte_ranges(f, self.sizes[f], self.split_bytes)]
        docs = pbegin | "Ranges" >> beam.Create(ranges) | "Read" >> beam.ParDo(_ReadBertText())
        if any(f.endswith((".bz2", ".gz")) for f in self.files):
            docs = docs | "Spread" >> beam.Reshuffle()
        return docs


class _ReadJsonl(beam.DoFn):
    def __init__(self, text_field: str, id_field: str):
        self.text_field, self.id_field = text_field, id_field

    def process(self, item):
        path, rel = item
        with sources.open_input(path) as stream:
            for a, b in sources.iter_json_lines(stream, self.text_field, self.id_field):
                if a == "!event":
                    event(b, path)
                else:
                    yield (f"jsonl:{rel}:{a}", b)


class ReadJsonLines(beam.PTransform):
    """JSON Lines with a configurable text field -> (doc_id, text)."""

    def __init__(self, pattern: str, text_field: str = "text", id_field: str = ""):
        super().__init__()
        self.files = match_files(pattern, directory_suffix=DIRECTORY_SUFFIX["jsonl"])
        self.text_field, self.id_field = text_field, id_field

    def expand(self, pbegin):
        ids = relative_ids(self.files)
        return (pbegin | "Files" >> beam.Create([(f, ids[f]) for f in self.files])
                | "Read" >> beam.ParDo(_ReadJsonl(self.text_field, self.id_field))
                | "Spread" >> beam.Reshuffle())
