"""The clients people already use, unchanged, against a live server: Hugging Face's
``InferenceClient`` (at the root and at the route URLs) and the ``openai`` package's embeddings.
Every answer equals the model's own answer computed offline for the same text."""
from __future__ import annotations

import base64
import logging
import re
from pathlib import Path

import numpy as np
import pytest

from tests.serve.test_server import Offline, ThreadServer, assert_same, call, metric, metric_values, text

SERVING_MD = Path(__file__).resolve().parents[2] / "docs" / "serving.md"


@pytest.fixture(scope="module")
def dirs(onnx_model):
    return {"cls": onnx_model("classification"), "enc": onnx_model("encoder"), "reg": onnx_model("regression")}


@pytest.fixture(scope="module")
def offline(dirs):
    return Offline(dirs)


def _server(dirs, *names):
    from bertdist.serve.app import ServeSettings
    from bertdist.serve.runtime import load_served_model

    return ThreadServer([load_served_model(dirs[n], name=n) for n in names], ServeSettings(max_wait_ms=2))


@pytest.fixture(scope="module")
def servers(dirs):
    """One server per single model (its root answers), and one with all three."""
    made = {"cls": _server(dirs, "cls"), "enc": _server(dirs, "enc"), "all": _server(dirs, "cls", "enc", "reg")}
    yield {k: s.port for k, s in made.items()}
    for s in made.values():
        s.stop()


def hf(port: int, path: str = ""):
    from huggingface_hub import InferenceClient

    return InferenceClient(model=f"http://127.0.0.1:{port}{path}", timeout=30)


def labels(elements) -> list[dict]:
    return [{"label": e.label, "score": e.score} for e in elements]


def embeddings(offline, texts: list[str], normalize: bool = True) -> np.ndarray:
    return np.asarray(offline.answer("enc", "embed", {"inputs": texts, "normalize": normalize}))


@pytest.mark.parametrize("where", ["root", "route"])
def test_inference_client_text_classification(servers, offline, where):
    port, path = (servers["cls"], "") if where == "root" else (servers["all"], "/models/cls/predict")
    client = hf(port, path)
    sentence = text(f"hf-{where}", 9)
    want = offline.answer("cls", "predict", {"inputs": sentence})
    got = client.text_classification(sentence)
    assert_same(labels(got), want, f"text_classification at {where}")
    assert len(got) == 2 and got[0].score >= got[1].score
    # The client's task parameters.
    assert_same(labels(client.text_classification(sentence, top_k=1)), want[:1], "top_k=1")
    raw = offline.answer("cls", "predict", {"inputs": sentence, "raw_scores": True})
    assert_same(labels(client.text_classification(sentence, function_to_apply="none")), raw, "none")
    sig = sorted(({"label": r["label"], "score": float(1 / (1 + np.exp(-r["score"])))} for r in raw),
                 key=lambda r: -r["score"])
    assert_same(labels(client.text_classification(sentence, function_to_apply="sigmoid")), sig, "sigmoid")


@pytest.mark.parametrize("where", ["root", "route"])
def test_inference_client_feature_extraction_and_similarity(servers, offline, where):
    port = servers["enc"] if where == "root" else servers["all"]
    sentence, others = text(f"fe-{where}", 7), [text(f"fe-{where}-{i}", 5 + i) for i in range(3)]
    client = hf(port, "" if where == "root" else "/embed")
    got = client.feature_extraction(sentence)
    assert got.shape == (1, embeddings(offline, [sentence]).shape[1])
    np.testing.assert_allclose(got, embeddings(offline, [sentence]), atol=2e-6)
    unnormalized = client.feature_extraction(sentence, normalize=False, truncate=True, truncation_direction="right")
    np.testing.assert_allclose(unnormalized, embeddings(offline, [sentence], normalize=False), atol=2e-6)
    assert abs(np.linalg.norm(unnormalized) - 1) > 1e-3  # the option reached the model

    vecs = embeddings(offline, [sentence, *others])
    client = hf(port, "" if where == "root" else "/similarity")
    sims = client.sentence_similarity(sentence, other_sentences=others)
    np.testing.assert_allclose(sims, vecs[1:] @ vecs[0], atol=2e-6)


def test_openai_embeddings(servers, offline, dirs):
    from openai import BadRequestError, NotFoundError, OpenAI

    texts = [text(f"oa{i}", 4 + 3 * i) for i in range(4)]
    want = embeddings(offline, texts)
    for port, model in ((servers["enc"], "text-embedding-3-small"), (servers["all"], "enc")):
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        for fmt in ("float", "base64"):
            res = client.embeddings.create(input=texts, model=model, encoding_format=fmt)
            assert res.model == "enc" and [d.index for d in res.data] == list(range(len(texts)))
            got = np.asarray([np.frombuffer(base64.b64decode(d.embedding), "<f4") if fmt == "base64" else d.embedding
                              for d in res.data])
            np.testing.assert_allclose(got, want, atol=2e-6)
            lengths = [it.length for it in offline.models["enc"].prepare("embed", {"inputs": texts}).items]
            assert res.usage.prompt_tokens == res.usage.total_tokens == sum(lengths)
        # The package's default (no encoding_format given) asks for base64 and decodes it.
        one = client.embeddings.create(input=texts[0], model=model)
        np.testing.assert_allclose(one.data[0].embedding, want[0], atol=2e-6)
        assert [m.id for m in client.models.list()] == (["enc"] if port == servers["enc"] else ["cls", "enc", "reg"])
    client = OpenAI(base_url=f"http://127.0.0.1:{servers['all']}/v1", api_key="unused", max_retries=0)
    with pytest.raises(NotFoundError, match="model 'cls' is a classification model, not an encoder; embeddings come from: enc"):
        client.embeddings.create(input="a", model="cls")
    with pytest.raises(BadRequestError, match="token arrays are not accepted"):
        client.embeddings.create(input=[[101, 2023]], model="enc")
    with pytest.raises(BadRequestError, match="gives 32-dimensional embeddings"):
        client.embeddings.create(input="a", model="enc", dimensions=8)


def test_openai_errors_have_openais_shape(servers):
    status, _, body = call(servers["enc"], "POST", "/v1/embeddings", {"inputs": "a"})
    assert status == 400 and body["error"]["param"] == "inputs" and "unknown field 'inputs'" in body["error"]["message"]
    assert body["error"]["type"] == "invalid_request_error"
    status, _, body = call(servers["cls"], "POST", "/v1/embeddings", {"input": "a", "model": "x"})
    assert status == 404 and "no loaded model serves embeddings; loaded: cls (classification)" in \
        body["error"]["message"], body
    status, _, body = call(servers["enc"], "POST", "/v1/embeddings", raw=b"{")
    assert status == 400 and "malformed JSON" in body["error"]["message"], body


def test_root_answers_with_the_one_model_and_refuses_when_there_are_several(servers, offline):
    body = {"inputs": text("root", 6)}
    status, _, got = call(servers["cls"], "POST", "/", body)
    assert status == 200
    assert_same(got, offline.answer("cls", "predict", body), "POST / (TEI shape)")
    status, _, got = call(servers["all"], "POST", "/", body)
    assert status == 400 and "3 are loaded: cls (/predict); enc (/embed, /similarity); reg (/predict, /rerank)" in \
        got["error"], got
    values = metric_values(servers["cls"])
    assert metric(values, "bertdist_serve_requests_total", model="cls", route="root", code="200") >= 1


def test_parameters_are_understood_and_other_keys_ignored_with_a_warning(servers, offline, caplog):
    sentence = text("params", 5)
    with caplog.at_level(logging.WARNING, logger="bertdist.serve.runtime"):
        status, _, got = call(servers["cls"], "POST", "/predict",
                              {"inputs": sentence, "parameters": {"top_k": 1, "wait_for_model": True}})
    assert status == 200
    assert_same(got, [offline.answer("cls", "predict", {"inputs": sentence})[:1]], "nested top_k=1")
    assert any("ignoring parameters wait_for_model" in r.getMessage() for r in caplog.records), caplog.text
    # Unknown top-level keys stay an error; a parameter given twice must agree.
    status, _, got = call(servers["cls"], "POST", "/predict", {"inputs": sentence, "top_k": 1})
    assert status == 422 and "unknown field 'top_k'" in got["error"]
    status, _, got = call(servers["enc"], "POST", "/embed",
                          {"inputs": sentence, "normalize": True, "parameters": {"normalize": False}})
    assert status == 422 and "'normalize' is True at the top level but False in 'parameters'" in got["error"]
    for params, words in (({"function_to_apply": "relu"}, "function_to_apply 'relu'"),
                          ({"top_k": 0}, "top_k 0"), ([], "'parameters' must be a JSON object")):
        status, _, got = call(servers["cls"], "POST", "/predict", {"inputs": sentence, "parameters": params})
        assert status == 422 and words in got["error"], got


def test_left_truncation_keeps_the_end(servers, offline):
    words = text("left", 400)  # far over the 128-token limit
    status, _, got = call(servers["enc"], "POST", "/embed", {"inputs": words, "truncation_direction": "left"})
    assert status == 200
    tail = " ".join(words.split()[-60:])  # a short end: within the limit, so not truncated
    model = offline.models["enc"]
    left = model.prepare("embed", {"inputs": words, "truncation_direction": "Left"}).items[0]
    assert left.length == 128
    end_ids = model.prepare("embed", {"inputs": tail}).items[0].input_ids
    assert list(left.input_ids[-len(end_ids) + 1:]) == list(end_ids[1:])  # the same last tokens, then [SEP]
    np.testing.assert_allclose(got, offline.answer("enc", "embed", {"inputs": words, "truncation_direction": "left"}),
                               atol=2e-6)


def _doc_examples() -> list[str]:
    """The Python blocks of docs/serving.md's client section."""
    text_ = SERVING_MD.read_text(encoding="utf-8")
    section = text_.split("## Clients", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_every_documented_client_example_runs(servers, offline, capsys):
    examples = _doc_examples()
    assert len(examples) >= 3, "docs/serving.md's client examples are missing"
    for code in examples:
        port = servers["enc"] if "embed" in code or "similarity" in code else servers["cls"]
        exec(compile(code.replace("127.0.0.1:8080", f"127.0.0.1:{port}"), "docs/serving.md", "exec"), {})
    printed = capsys.readouterr().out
    assert printed.strip(), "the examples print their answers"


def test_both_clients_against_the_bertdist_serve_command(dirs, offline):
    """The same clients against a `bertdist serve` process (its connection limits and all)."""
    from openai import OpenAI

    from tests.serve.test_server import CliServer

    srv = CliServer(str(dirs["enc"]), "--name", "enc")
    try:
        sentence = text("cli", 6)
        np.testing.assert_allclose(hf(srv.port).feature_extraction(sentence), embeddings(offline, [sentence]),
                                   atol=2e-6)
        client = OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="unused", max_retries=0)
        res = client.embeddings.create(input=[sentence], model="any-name")
        np.testing.assert_allclose([res.data[0].embedding], embeddings(offline, [sentence]), atol=2e-6)
    finally:
        rc = srv.stop()
    assert rc == 0 and "2 requests answered, 0 cut off" in srv.output[-1], "".join(srv.output)
