"""Seed derivation: one stable 64-bit seed from any parts, shared by the instance algorithm and the
NSP negatives (both import it; it imports neither)."""
from __future__ import annotations

import hashlib


def derive_seed(*parts) -> int:
    """64-bit seed from any parts (blake2b of their repr: stable across processes and runs)."""
    h = hashlib.blake2b("\x1f".join(map(str, parts)).encode("utf-8"), digest_size=8)
    return int.from_bytes(h.digest(), "little")
