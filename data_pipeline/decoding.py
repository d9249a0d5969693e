"""Bytes to text without damage: strict UTF-8 first, else the encoding that ``charset-normalizer``
detects, else nothing (the caller skips the document and counts it).

A single-byte Western text (latin-1, cp1252) is ambiguous to any detector: its few accented
bytes are valid in every 8-bit code page, and ``charset-normalizer`` often ranks a Central or
Baltic page first at the same "chaos" score ("Brunetière" comes out as "Brunetičre" in cp1250).
So among the candidates it found that are about as clean as its best one, the most widespread
Western encodings win, and else the one whose text reads most like a language (charset-normalizer's
"coherence"); a text that only decodes cleanly in another code page (Czech in cp1250) keeps it.
"""
from __future__ import annotations

from dataclasses import dataclass

# Preferred on a near-tie, in this order (cp1252 is a superset of latin-1's printable range).
WESTERN_ENCODINGS = ("cp1252", "latin_1", "iso8859_15")
# A candidate within this much "chaos" (charset-normalizer's mess ratio, 0 = clean) of the best
# one counts as a tie.
TIE_CHAOS = 0.1
# charset-normalizer's own default ceiling: above it a decoding is mostly noise.
MAX_CHAOS = 0.2


@dataclass(frozen=True)
class Decoded:
    text: str
    encoding: str  # Python codec name, "utf_8" when the bytes were valid UTF-8


def decode_strict(data: bytes) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def detect_encoding(data: bytes, max_chaos: float = MAX_CHAOS) -> str | None:
    """The codec ``data`` is written in, or None when nothing decodes it with confidence."""
    from charset_normalizer import from_bytes

    matches = list(from_bytes(data, threshold=max_chaos))
    if not matches:
        return None
    best = min(matches, key=lambda m: m.chaos)
    if best.chaos > max_chaos:
        return None
    near = [m for m in matches if m.chaos <= best.chaos + TIE_CHAOS]
    for enc in WESTERN_ENCODINGS:
        if any(m.encoding == enc for m in near):
            return enc
        # charset-normalizer lists one of several code pages that give the same text
        try:
            western = data.decode(enc)
        except UnicodeDecodeError:
            continue
        if any(str(m) == western for m in near):
            return enc
    # else the most coherent language among the near-ties (Shift-JIS Japanese, not a Korean
    # code page that decodes the same bytes into syllables of no language at the same chaos)
    return max(near, key=lambda m: (m.coherence, -m.chaos)).encoding


def decode_document(data: bytes, max_chaos: float = MAX_CHAOS) -> Decoded | None:
    """Strict UTF-8, else the detected encoding; None when the bytes cannot be decoded with
    confidence (random bytes, binary files). A letter is never replaced or dropped."""
    text = decode_strict(data)
    if text is not None:
        return Decoded(text, "utf_8")
    enc = detect_encoding(data, max_chaos)
    if enc is None:
        return None
    try:
        return Decoded(data.decode(enc), enc)
    except UnicodeDecodeError:  # the detector looked at a sample; the rest does not fit
        return None


def decode_line(data: bytes, fallback: str | None) -> str | None:
    """One line of a file whose encoding was detected on a larger block: UTF-8 when the line is
    valid UTF-8 (a file may mix both), else ``fallback``; None when neither decodes it."""
    text = decode_strict(data)
    if text is not None or fallback is None:
        return text
    try:
        return data.decode(fallback)
    except UnicodeDecodeError:
        return None
