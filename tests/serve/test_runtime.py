"""A served model's request handling without a server: the bounded tokenization."""
from __future__ import annotations

import random

import pytest

from tests.serve.test_server import WORDS


@pytest.fixture(scope="module")
def cls_model(onnx_model):
    from bertdist.serve.runtime import load_served_model

    return load_served_model(onnx_model("classification"), name="cls")


def _whole(model, text, direction):
    """The tokens of the whole text (or pair), truncated to the model's limit: what the cut must equal."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model.dir / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(model.max_length, strategy="longest_first", direction=direction)
    return tok.encode(*((text,) if isinstance(text, str) else text)).ids


def _long(rng: random.Random, words: int, gap: str = " ") -> str:
    return gap.join(rng.choice(WORDS) + rng.choice(["", ",", "."]) for _ in range(words))


@pytest.mark.parametrize("direction", ["right", "left"])
def test_a_cut_text_tokenizes_as_the_whole_text_truncated(cls_model, direction):
    rng = random.Random(direction)
    cases = [_long(rng, 2000), _long(rng, 60), "x" * 5000 + " end", "a" + " " * 20000 + " ".join(WORDS),
             _long(rng, 300, gap="\n\t  "), (_long(rng, 900), _long(rng, 700)), (_long(rng, 5), _long(rng, 3000))]
    # A pair is truncated longest-first: the longer side gets the odd token, whichever side it is on.
    cases += [(_long(rng, 3000), "a short question"), (_long(rng, 700), _long(rng, 900)), ("z " * 400, "z " * 400)]
    items = cls_model.encode(cases, truncate=True, direction=direction)
    for case, item in zip(cases, items):
        assert list(item.input_ids) == _whole(cls_model, case, direction), str(case)[:80]
        assert item.length <= cls_model.max_length


def test_work_per_text_is_bounded_by_the_limit_not_the_body(cls_model, monkeypatch):
    """A 1 MB text is cut before tokenizing: the tokenizer sees a few thousand characters."""
    from bertdist.serve import runtime

    seen = []
    tok = cls_model._tok["right"]

    class Spy:
        def encode(self, *texts):
            seen.append(sum(len(t) for t in texts))
            return tok.encode(*texts)

        def encode_batch(self, inputs):
            seen.extend(len(t) if isinstance(t, str) else sum(map(len, t)) for t in inputs)
            return tok.encode_batch(inputs)

    monkeypatch.setitem(cls_model._tok, "right", Spy())
    item, = cls_model.encode(["word " * 200_000], truncate=True)
    assert item.length == cls_model.max_length
    assert max(seen) <= (cls_model.max_length + 1) * runtime.CHARS_PER_TOKEN, seen
    with pytest.raises(runtime.RequestError, match="input 0 is over the model's limit of 128 tokens"):
        cls_model.encode(["word " * 200_000], truncate=False)


def test_bad_unicode_is_a_422_naming_the_input(cls_model):
    from bertdist.serve.runtime import RequestError

    with pytest.raises(RequestError, match="input 1 is not valid Unicode: a lone surrogate") as e:
        cls_model.prepare("predict", {"inputs": ["fine", "\ud800 hello", "also fine"]})
    assert e.value.status == 422
