"""Fixtures: a small WordPiece vocab trained on the bundled samples (no ../shared needed)."""
from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "data_pipeline" / "samples"
IN_PROCESS = ["--runner=DirectRunner", "--direct_running_mode=in_memory", "--direct_num_workers=1"]


@pytest.fixture(scope="session")
def small_vocab(tmp_path_factory) -> Path:
    from data_pipeline.config import InputConfig
    from data_pipeline.tokenization import train_vocab
    from data_pipeline.vocab_corpus import iter_sentences

    out = tmp_path_factory.mktemp("vocab") / "vocab.txt"
    train_vocab(iter_sentences([InputConfig(kind="books", path=str(SAMPLES / "books"))]), out,
                vocab_size=3000, lowercase=True)
    return out


@pytest.fixture(scope="session")
def sample_records(tmp_path_factory, small_vocab) -> Path:
    """Records from the bundled wiki sample + books, built in-process (a few seconds)."""
    from data_pipeline import build_records

    out = tmp_path_factory.mktemp("records")
    return build_records([f"wiki:{SAMPLES / 'wiki'}", f"books:{SAMPLES / 'books'}"], out, small_vocab,
                         max_seq_length=64, dupe_factor=1, num_shards=3, heldout_fraction=0.1,
                         max_predictions_per_seq=10)
