"""Sentences from the configured sources without Beam, for vocab training (one process)."""
from __future__ import annotations

from typing import Iterable, Iterator

from data_pipeline import sources, text as textlib
from data_pipeline.config import InputConfig


def iter_sentences(inputs: Iterable[InputConfig], max_document_chars: int = 50_000_000,
                   skipped: list[str] | None = None) -> Iterator[str]:
    """Sentences of every input; a book that cannot be read or decoded is skipped and, when
    ``skipped`` is given, its path with the reason appended there."""
    for src in inputs:
        if src.kind == "wiki":
            from data_pipeline.wikitext import article_paragraphs, iter_page_blobs, parse_page

            for path in sources.match_files(src.path, directory_suffix=sources.DIRECTORY_SUFFIX["wiki"]):
                with sources.open_input(path) as stream:
                    try:
                        for kind, blob in iter_page_blobs(stream, 64 << 20):
                            page = parse_page(blob)[0] if kind == "page" else None
                            if page is None or page.ns != 0 or page.redirect:
                                continue
                            for p in article_paragraphs(page.title, page.text) or []:
                                yield from textlib.split_sentences(p)
                    except sources.STREAM_ERRORS:
                        continue
        elif src.kind == "books":
            for path in sources.match_files(src.path, directory_suffix=sources.DIRECTORY_SUFFIX["books"]):
                with sources.open_input(path) as stream:
                    text, events = sources.read_text_document(stream, max_document_chars)
                if text is None:  # binary or undecodable: the data build counts the same skip
                    if skipped is not None:
                        skipped.append(f"{path} ({events[0]})")
                    continue
                yield from textlib.text_to_sentences(textlib.strip_gutenberg(text)[0])
        elif src.kind == "jsonl":
            for path in sources.match_files(src.path, directory_suffix=sources.DIRECTORY_SUFFIX["jsonl"]):
                with sources.open_input(path) as stream:
                    for a, b in sources.iter_json_lines(stream, src.text_field, src.id_field):
                        if a != "!event":
                            yield from textlib.text_to_sentences(b)
        else:
            for path in sources.match_files(src.path):
                with sources.open_input(path) as stream:
                    for a, b in sources.iter_bert_format(stream):
                        if a != "!event":
                            yield from b
