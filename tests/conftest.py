"""Shared fixtures and the skip rules for marked tests (see pyproject's markers)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
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
