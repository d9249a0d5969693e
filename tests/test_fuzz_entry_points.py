"""Fuzzing the entry points that read what users hand us: configs, task files, data-build inputs
and manifests. Every failure must be one of our error types with a message (never a raw
traceback), and nothing outside the working folder may change. Bounded and deterministic in CI:
a fixed number of examples per entry point, derandomized."""
from __future__ import annotations

import bz2
import gzip
import io
import json
import os
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bertdist.config import ConfigError, load_config
from bertdist.data import RecordsError, open_records
from bertdist.finetune import glue
from bertdist.finetune.errors import DataError
from bertdist.finetune.ner import read_conll
from bertdist.finetune.squad import read_squad
from bertdist.finetune.swag import read_swag
from data_pipeline import sources
from data_pipeline.wikitext import iter_page_blobs, parse_page

REPO = Path(__file__).resolve().parents[1]
OUR_ERRORS = (ConfigError, DataError, RecordsError)
FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=True),
                    st.text(max_size=20))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                      max_leaves=8)


def _our_error_or_nothing(fn) -> None:
    try:
        fn()
    except OUR_ERRORS as e:
        assert str(e).strip(), f"{type(e).__name__} without a message"


@pytest.fixture
def unchanged(tmp_path):
    """The working folder's parent before and after: nothing outside tmp_path appears or goes."""
    parent = tmp_path.parent
    before = sorted(os.listdir(parent))
    yield tmp_path
    assert sorted(os.listdir(parent)) == before


def _schemas():
    from bertdist.distill.config import DistillConfig
    from bertdist.finetune.config import FinetuneConfig
    from bertdist.train.config import TrainConfig
    from data_pipeline.config import BuildConfig

    return [(TrainConfig, REPO / "configs/pretrain/tiny.yaml"), (BuildConfig, REPO / "configs/data/tiny_demo.yaml"),
            (FinetuneConfig, REPO / "configs/finetune/glue.yaml"), (DistillConfig, REPO / "configs/distill/glue.yaml")]


@FUZZ
@given(which=st.integers(0, 3), key=st.sampled_from(["", "model.", "data.", "optimizer.", "train.", "x."]),
       name=st.text(st.characters(codec="ascii", categories=["L", "N", "Pc"]), min_size=1, max_size=24), value=values)
def test_config_overrides_and_files(unchanged, which, key, name, value):
    cls, path = _schemas()[which]
    known = list(yaml.safe_load(path.read_text()))
    override = f"{key or (known[len(name) % len(known)] + '.')}{name}={json.dumps(value)}"
    _our_error_or_nothing(lambda: load_config(cls, path, [override]))
    doc = unchanged / "config.yaml"
    doc.write_text(yaml.safe_dump({known[0]: value, name: value}))
    _our_error_or_nothing(lambda: load_config(cls, doc))


@FUZZ
@given(data=st.binary(max_size=2000))
def test_config_files_of_any_bytes(unchanged, data):
    from bertdist.train.config import TrainConfig

    doc = unchanged / "bytes.yaml"
    doc.write_bytes(data)
    _our_error_or_nothing(lambda: load_config(TrainConfig, doc))


cells = st.text(st.characters(blacklist_categories=["Cs"]), max_size=12)


@FUZZ
@given(rows=st.lists(st.lists(cells, min_size=1, max_size=11), max_size=6), raw=st.binary(max_size=300),
       task=st.sampled_from(["sst2", "stsb", "mnli", "cola", "mrpc"]))
def test_glue_tsv_files(unchanged, rows, raw, task):
    path = unchanged / "train.tsv"
    path.write_text("\n".join("\t".join(r) for r in rows))
    _our_error_or_nothing(lambda: glue.read_glue(glue.GLUE_TASKS[task], path))
    path.write_bytes(raw)
    _our_error_or_nothing(lambda: glue.read_glue(glue.GLUE_TASKS[task], path))


@FUZZ
@given(text=st.text(max_size=400), raw=st.binary(max_size=300), doc=values)
def test_conll_squad_swag_files(unchanged, text, raw, doc):
    conll, squad, swag = unchanged / "train.txt", unchanged / "dev-v1.1.json", unchanged / "train.csv"
    for content in (text.encode("utf-8", "surrogatepass"), raw):
        conll.write_bytes(content)
        _our_error_or_nothing(lambda: read_conll(conll))
        swag.write_bytes(content)
        _our_error_or_nothing(lambda: read_swag(swag))
        squad.write_bytes(content)
        _our_error_or_nothing(lambda: read_squad(squad))
    squad.write_text(json.dumps({"version": "1.1", "data": doc}))
    _our_error_or_nothing(lambda: read_squad(squad))


@FUZZ
@given(raw=st.binary(max_size=3000), cut=st.integers(0, 3000), kind=st.sampled_from(["plain", "gz", "bz2"]))
def test_data_build_readers_count_bad_input_and_never_raise(unchanged, raw, cut, kind):
    """Random bytes, truncated compressed files and long lines: the readers skip and count."""
    body = raw + b"x" * (cut * 700) if cut % 3 == 0 else raw  # now and then a line over the limit
    packed = {"plain": body, "gz": gzip.compress(body), "bz2": bz2.compress(body)}[kind]
    packed = packed[: max(1, len(packed) * cut // 3000)] if kind != "plain" and cut % 2 else packed
    path = unchanged / f"input.{ {'plain': 'txt', 'gz': 'txt.gz', 'bz2': 'xml.bz2'}[kind] }"
    path.write_bytes(packed)
    old = sources.MAX_LINE_BYTES
    sources.MAX_LINE_BYTES = 1024  # small enough for the examples to reach it
    try:
        with sources.open_input(str(path)) as s:
            list(sources.iter_bert_format(s))
        with sources.open_input(str(path)) as s:
            list(sources.iter_json_lines(s, "text", "id"))
        with sources.open_input(str(path)) as s:
            sources.read_text_document(s, 10_000)
        with sources.open_input(str(path)) as s:
            try:  # the wiki reader's callers count a damaged stream as a truncated file, keeping the pages before
                for kind_, blob in iter_page_blobs(s, 4096):
                    if kind_ == "page":
                        parse_page(blob)
            except sources.STREAM_ERRORS:
                pass
        if kind == "plain" and len(body) > 2:  # byte ranges, as the parallel reader cuts the file
            for a, b in ((0, len(body) // 2), (len(body) // 2, None)):
                list(sources.iter_bert_format(io.BytesIO(body), a, b))
    finally:
        sources.MAX_LINE_BYTES = old


@FUZZ
@given(manifest=values, shard=st.text(max_size=40), raw=st.binary(max_size=200))
def test_manifests(unchanged, manifest, shard, raw):
    folder = unchanged / "records"
    folder.mkdir(exist_ok=True)
    path = folder / "manifest.json"
    path.write_text(json.dumps(manifest))
    _our_error_or_nothing(lambda: open_records(path))
    well_formed = {"format": "bertdist-records", "format_version": 1, "vocab": {"sha256": "0", "size": 8},
                   "records": {"max_seq_length": 64}, "special_token_ids": {},
                   "splits": {"train": {"shards": [{"path": shard, "rows": 1, "sha256": "0"}]}}}
    path.write_text(json.dumps(well_formed))
    _our_error_or_nothing(lambda: open_records(path))
    path.write_bytes(raw)
    _our_error_or_nothing(lambda: open_records(path))
