"""data_pipeline.config: quality and dedup sections, build-wide defaults and per-source overrides."""
from __future__ import annotations

import pytest

from bertdist.config import ConfigError, apply_overrides, from_dict, load_config
from data_pipeline.config import BuildConfig
from tests.conftest import REPO


def test_cleaning_is_on_by_default_for_every_source():
    cfg = from_dict(BuildConfig, {"inputs": [{"kind": "wiki", "path": "w"}, {"kind": "books", "path": "b"}]})
    for i in range(2):
        assert cfg.source_quality(i).enabled and cfg.source_dedup(i).enabled and cfg.source_dedup(i).near
        assert cfg.source_dedup(i).threshold == 0.8 and cfg.source_dedup(i).ngram == 5


def test_a_source_section_replaces_the_build_default():
    cfg = from_dict(BuildConfig, {"dedup": {"threshold": 0.9},
                                  "inputs": [{"kind": "wiki", "path": "w"},
                                             {"kind": "books", "path": "b", "dedup": {"enabled": False},
                                              "quality": {"min_words": 10}}]})
    assert cfg.source_dedup(0).threshold == 0.9 and cfg.source_dedup(1).enabled is False
    assert cfg.source_quality(0).min_words == 50 and cfg.source_quality(1).min_words == 10


def test_dotted_overrides_and_unknown_keys():
    data = apply_overrides(BuildConfig, {}, ["dedup.threshold=0.7", "quality.enabled=false"])
    cfg = from_dict(BuildConfig, data)
    assert cfg.dedup.threshold == 0.7 and cfg.quality.enabled is False
    with pytest.raises(ConfigError, match="max_bucket_comparisons"):
        apply_overrides(BuildConfig, {}, ["dedup.treshold=0.7"])


def test_the_shipped_configs_load():
    for path in sorted((REPO / "configs" / "data").glob("*.yaml")):
        cfg = load_config(BuildConfig, path)
        assert cfg.dedup.enabled and cfg.quality.enabled, path.name
