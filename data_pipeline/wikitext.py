"""Wikipedia pages-articles XML: page splitting and wikitext -> prose (pure functions).

Pages are cut out of the byte stream one ``<page>...</page>`` at a time and each is parsed on
its own, so a dump is never held in memory and a malformed page costs one page, not the file.
Wikitext goes through mwparserfromhell's parser; the tree is rendered to prose by
:func:`render`, which drops templates, ``<ref>``s, tables, galleries, math, comments,
File/Image/Category and interlanguage links and magic words, and keeps link text.
Headings become paragraph breaks (the heading text itself is not prose and is dropped), and
the reference-like tail sections (References, External links, See also, ...) are dropped whole.
List items are kept as their own paragraphs only when they read as prose (>= 5 words), which
drops link lists and keeps descriptive bullets.
"""
from __future__ import annotations

import html
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from typing import BinaryIO, Iterator

import mwparserfromhell
from mwparserfromhell import nodes

from data_pipeline.decoding import decode_document
from data_pipeline.sources import MAX_LINE_BYTES, read_line
from data_pipeline.text import clean_line

DROP_TAGS = frozenset({
    "ref", "references", "table", "gallery", "math", "chem", "ce", "timeline", "imagemap", "score",
    "hiero", "syntaxhighlight", "source", "pre", "code", "nowiki", "templatedata", "graph", "mapframe",
    "maplink", "inputbox", "categorytree", "noinclude", "includeonly", "onlyinclude", "poem", "blockquote",
})
DROP_SECTIONS = frozenset({
    "references", "external links", "see also", "further reading", "notes", "bibliography",
    "sources", "citations", "footnotes", "notes and references", "references and notes",
    "works cited", "selected bibliography", "discography", "filmography", "gallery",
})
DROP_LINK_NAMESPACES = frozenset({"file", "image", "category", "media", "wikipedia", "wp", "template",
                                  "help", "portal", "special", "user", "talk", "draft", "module"})
DISAMBIGUATION_TEMPLATES = frozenset({
    "disambiguation", "disambig", "dab", "disamb", "hndis", "geodis", "surname", "given name",
    "set index article", "sia", "hospital disambiguation", "school disambiguation", "mountainindex",
    "shipindex", "roadindex", "place name disambiguation", "human name disambiguation",
})
_MAGIC = re.compile(r"__[A-Z]+__")
_EMPTY_PARENS = re.compile(r"\(\s*[,;:]?\s*\)")
_SPACE_PUNCT = re.compile(r"\s+([,.;:!?])")
_LANG_PREFIX = re.compile(r"^[a-z]{2,3}(-[a-z]+)?$")
_LIST_MARK = "\x01"
_HEADING_MARK = "\x02"
_PRE_STRIP = re.compile(r"<!--.*?(-->|$)|<ref[^>]*?/>|<ref[^>]*?>.*?</ref\s*>", re.DOTALL | re.IGNORECASE)
_RAW_HEADING = re.compile(r"^(={1,6})\s*(.*?)\s*\1\s*$")
_ITALIC_BOLD = re.compile(r"'{2,}")
_LEFTOVER_TAG = re.compile(r"</?[a-zA-Z][^<>]{0,200}>")


@dataclass
class Page:
    page_id: str
    title: str
    ns: int
    redirect: bool
    text: str


# The skip counter of each kind iter_page_blobs reports besides pages.
SKIP_EVENTS = {"malformed": "skipped_wiki_malformed_page", "oversized": "skipped_wiki_oversized_page",
               "junk": "skipped_wiki_junk_outside_pages"}


def _is_junk(line: bytes) -> bool:
    """Outside a page a dump holds only XML lines (the header, siteinfo) and blank ones."""
    stripped = line.strip()
    return bool(stripped) and (not stripped.startswith(b"<") or b"\x00" in stripped)


def iter_page_blobs(stream: BinaryIO, max_page_bytes: int) -> Iterator[tuple[str, bytes]]:
    """Yield ("page", bytes) per ``<page>`` element, or ("malformed"|"oversized", b"") for a page
    that never closed before the next one / was larger than ``max_page_bytes`` or held a line
    longer than MAX_LINE_BYTES, and ("junk", b"") once per run of lines outside any page that are
    not XML (zeros, stray text). Memory stays bounded by those two whatever the stream holds."""
    buf: list[bytes] = []
    size = 0
    inside = oversized = in_junk = False
    readline = stream.readline
    while True:
        line, n = read_line(readline, MAX_LINE_BYTES)
        if not n:
            break
        if line is None:  # a line longer than any wikitext line: read in pieces and dropped
            if inside:
                oversized, buf = True, []
            elif not in_junk:
                in_junk = True
                yield ("junk", b"")
            continue
        if not inside and b"<page>" not in line:
            if _is_junk(line) and not in_junk:
                yield ("junk", b"")
            in_junk = _is_junk(line) or (in_junk and not line.strip())
            continue
        in_junk = False
        if b"<page>" in line:
            if inside:
                yield ("malformed", b"")
            inside, oversized, buf, size = True, False, [], 0
        if inside:
            if not oversized:
                buf.append(line)
                size += len(line)
                if size > max_page_bytes:
                    oversized, buf = True, []
            if b"</page>" in line:
                inside = False
                yield ("oversized", b"") if oversized else ("page", b"".join(buf))
                buf = []
    if inside:
        yield ("malformed", b"")  # the stream ended inside a page (truncated file)


def parse_page(blob: bytes) -> tuple[Page | None, str | None]:
    """One ``<page>`` element -> Page (None if malformed or undecodable). Returns (page, the
    encoding it was decoded from: "utf_8", another that was detected, or None: undecodable)."""
    decoded = decode_document(blob)
    if decoded is None:
        return None, None
    repaired = decoded.encoding
    try:
        el = ET.fromstring(decoded.text)
    except ET.ParseError:
        return None, repaired
    ns_text = el.findtext("ns")
    try:
        ns = int(ns_text) if ns_text is not None else 0
    except ValueError:
        return None, repaired
    rev = el.find("revision")
    body = rev.findtext("text") if rev is not None else None
    return Page(
        page_id=(el.findtext("id") or "").strip(),
        title=(el.findtext("title") or "").strip(),
        ns=ns,
        redirect=el.find("redirect") is not None or (body or "").lstrip()[:9].upper() == "#REDIRECT",
        text=body or "",
    ), repaired


def is_disambiguation(title: str, code: mwparserfromhell.wikicode.Wikicode) -> bool:
    if title.endswith("(disambiguation)"):
        return True
    for t in code.filter_templates(recursive=False):
        name = str(t.name).strip().lower().replace("_", " ")
        if name in DISAMBIGUATION_TEMPLATES or name.endswith(" disambiguation"):
            return True
    return False


def _link_dropped(title: str) -> bool:
    t = title.strip().lstrip(":")
    if ":" not in t:
        return False
    prefix = t.split(":", 1)[0].strip().lower()
    return prefix in DROP_LINK_NAMESPACES or bool(_LANG_PREFIX.match(prefix))


def render(code) -> str:
    """Wikicode -> plain text with list items marked; see the module docstring for the rules."""
    out: list[str] = []
    for node in code.nodes:
        if isinstance(node, nodes.Text):
            out.append(str(node.value))
        elif isinstance(node, nodes.Wikilink):
            title = str(node.title)
            if _link_dropped(title):
                continue
            out.append(render(node.text) if node.text is not None else title.split("#")[0].lstrip(":"))
        elif isinstance(node, nodes.ExternalLink):
            if node.title is not None:
                out.append(render(node.title))
        elif isinstance(node, nodes.Tag):
            tag = str(node.tag).strip().lower()
            if node.wiki_markup and tag in ("li", "dt", "dd"):
                out.append("\n" + _LIST_MARK)
            elif tag == "br":
                out.append(" ")
            elif tag in ("hr",):
                out.append("\n\n")
            elif tag in DROP_TAGS or node.self_closing or node.contents is None:
                continue
            else:
                out.append(render(node.contents))
        elif isinstance(node, nodes.HTMLEntity):
            out.append(node.normalize())
        elif isinstance(node, nodes.Heading):
            title = clean_line(render(node.title)).strip(" :")
            out.append(f"\n{_HEADING_MARK}{node.level}{_HEADING_MARK}{title}\n")
        # Template, Comment, Argument and anything else: not prose
    return "".join(out)


def article_paragraphs(title: str, wikitext: str) -> list[str] | None:
    """An article's prose paragraphs, or None when the page is a disambiguation page."""
    # <ref>s and comments go before parsing: they are never prose, and unbalanced ones
    # otherwise make the parser fall back to raw text for the rest of the page.
    code = mwparserfromhell.parse(_PRE_STRIP.sub("", wikitext))
    if is_disambiguation(title, code):
        return None
    return _paragraphs_from_rendered(_MAGIC.sub("", render(code)))


def wikitext_to_paragraphs(wikitext: str) -> list[str]:
    return _paragraphs_from_rendered(_MAGIC.sub("", render(mwparserfromhell.parse(_PRE_STRIP.sub("", wikitext)))))


def _paragraphs_from_rendered(text: str) -> list[str]:
    paras: list[str] = []
    current: list[str] = []
    drop_level = None

    def flush():
        if current:
            p = _tidy(" ".join(current))
            if p:
                paras.append(p)
            current.clear()

    for line in text.split("\n"):
        heading = None
        if line.startswith(_HEADING_MARK):
            _, level, title = line.split(_HEADING_MARK, 2)
            heading = (int(level), title)
        else:
            m = _RAW_HEADING.match(line.strip())  # a heading the parser left as text
            if m:
                heading = (len(m.group(1)), m.group(2))
        if heading is not None:
            flush()
            level, title = heading
            if drop_level is not None and level > drop_level:
                continue
            drop_level = level if clean_line(title).lower().strip(" :") in DROP_SECTIONS else None
            continue
        if drop_level is not None:
            continue
        if line.startswith(_LIST_MARK):
            flush()
            item = _tidy(line.lstrip(_LIST_MARK))
            if len(item.split()) >= 5:
                paras.append(item)
        elif not line.strip():
            flush()
        else:
            current.append(line)
    flush()
    # markup the parser could not place (broken tables or templates) is not prose
    return [p for p in paras if not _looks_like_markup(p)]


def _looks_like_markup(p: str) -> bool:
    return "{{" in p or "}}" in p or "{|" in p or "|}" in p or "[[" in p or "]]" in p or p.count("|") >= 3


def _tidy(p: str) -> str:
    p = clean_line(html.unescape(p))
    p = _LEFTOVER_TAG.sub("", _ITALIC_BOLD.sub("", p))
    p = _EMPTY_PARENS.sub("", p)
    p = _SPACE_PUNCT.sub(r"\1", p)
    return clean_line(p)
