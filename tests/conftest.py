"""Shared fixtures and the skip rules for marked tests (see pyproject's markers)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SAMPLES = REPO / "data_pipeline" / "samples"  # bundled real text: tests need no ../shared
# Beam DirectRunner in this process: no worker start-up cost, fine for the bundled samples.
IN_PROCESS = ["--runner=DirectRunner", "--direct_running_mode=in_memory", "--direct_num_workers=1"]
# CI clones the repo with ../shared beside it; a user's fresh clone has none.
SHARED_DATA = Path(os.environ.get("BERTDIST_SHARED_DATA", REPO.parent / "shared" / "data"))


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    has_shared = SHARED_DATA.is_dir()
    has_cuda = _cuda_available()
    for item in items:
        if "shared" in item.keywords and not has_shared:
            item.add_marker(pytest.mark.skip(reason=f"../shared/data not found at {SHARED_DATA}"))
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """Path to ../shared/data; tests using it must also carry @pytest.mark.shared."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"../shared/data not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def small_vocab(tmp_path_factory) -> Path:
    """A 3,000-token WordPiece vocab trained on the bundled books."""
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
