"""Fuzzing what a server and the ONNX export are handed: request bodies on every route, and model
directories' config.json. Every answer is a 2xx or a 4xx with our JSON error (never a 500 or a
traceback); every refused directory raises our ExportError. Bounded and deterministic in CI."""
from __future__ import annotations

import json
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.serve.test_server import ThreadServer, call

FUZZ = settings(max_examples=80, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
ROUTES = ("/", "/predict", "/embed", "/similarity", "/rerank", "/models/cls/predict", "/models/enc/embed",
          "/models/enc/similarity", "/models/reg/rerank", "/v1/embeddings")

# Texts with what breaks naive servers: lone surrogates, NULs, control and combining characters.
texts = st.one_of(st.text(max_size=40), st.sampled_from(["\ud800 hello", "\x00", "a\u0301" * 50, " " * 300, ""]))
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=False), texts)
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                      max_leaves=10)
fields = st.sampled_from(["inputs", "input", "parameters", "query", "texts", "normalize", "raw_scores", "truncate",
                          "truncation_direction", "top_k", "function_to_apply", "model", "encoding_format",
                          "dimensions", "source_sentence", "sentences", "return_text"])
bodies = st.one_of(
    st.dictionaries(fields, values, max_size=4),
    st.fixed_dictionaries({"inputs": st.one_of(texts, st.lists(texts, min_size=1, max_size=4),
                                               st.fixed_dictionaries({"source_sentence": texts,
                                                                      "sentences": st.lists(texts, max_size=3)})),
                           "parameters": st.dictionaries(fields, values, max_size=3)}),
    st.fixed_dictionaries({"input": st.one_of(texts, st.lists(st.one_of(texts, st.integers()), max_size=3)),
                           "model": st.sampled_from(["enc", "cls", "x"]),
                           "encoding_format": st.sampled_from(["float", "base64", "hex"])}),
)


@pytest.fixture(scope="module")
def server(onnx_model):
    from bertdist.serve.app import ServeSettings
    from bertdist.serve.runtime import load_served_model

    models = [load_served_model(onnx_model(kind), name=name)
              for name, kind in (("cls", "classification"), ("enc", "encoder"), ("reg", "regression"))]
    s = ThreadServer(models, ServeSettings(max_wait_ms=1))
    yield s
    s.stop()


@FUZZ
@given(route=st.sampled_from(ROUTES), body=bodies, raw=st.one_of(st.none(), st.binary(max_size=64)))
def test_every_route_answers_any_body_with_a_2xx_or_our_4xx(server, caplog, route, body, raw):
    if raw is None:
        raw = json.dumps(body).encode("utf-8", "surrogatepass")
    status, _, got = call(server.port, "POST", route, raw=raw)
    assert status < 500, (route, raw[:200], got)
    if status >= 400:
        error = got["error"]
        message = error["message"] if route.startswith("/v1/") else error
        assert isinstance(message, str) and message.strip(), got
    assert "Traceback" not in caplog.text


config_values = st.one_of(st.none(), st.booleans(), st.integers(-3, 70), st.text(max_size=6),
                          st.lists(st.text(max_size=12), max_size=2), st.floats(allow_nan=True))
config_keys = st.sampled_from(["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                               "intermediate_size", "max_position_embeddings", "architectures", "model_type",
                               "id2label", "num_labels", "problem_type", "type_vocab_size", "hidden_act"])


@settings(FUZZ, max_examples=40)
@given(changes=st.dictionaries(config_keys, config_values, min_size=1, max_size=3), cut=st.integers(0, 3))
def test_the_onnx_export_refuses_any_bad_directory_with_our_error(hf_model, tmp_path_factory, changes, cut):
    """A fuzzed config.json (or a cut weights file): reading the directory and building its model
    either work or raise ExportError with a message."""
    from bertdist.export.hf import ExportError as HFExportError
    from bertdist.serve.card import ExportError
    from bertdist.serve.onnx_export import load_torch_model, read_source

    src = tmp_path_factory.mktemp("fuzz") / "hf"
    shutil.copytree(hf_model("classification"), src)
    conf = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**conf, **changes}))
    if cut:
        weights = src / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: 8 * cut])
    try:
        load_torch_model(read_source(src))
    except (ExportError, HFExportError) as e:
        assert str(e).strip()
