"""SQuAD windows and n-best decoding on hand-built logits (no model): doc stride, spans that
only one window sees, max answer length, and the v2.0 no-answer threshold."""
from __future__ import annotations

import numpy as np
import pytest

from bertdist.export import bert_tokenizer
from bertdist.finetune.squad import SquadExample, decode_predictions, make_features

pytestmark = pytest.mark.shared

CONTEXT = " ".join(f"word{i}" for i in range(60)) + " the answer is Levi's Stadium in Santa Clara ."


@pytest.fixture(scope="module")
def tok(shared_data):
    return bert_tokenizer(shared_data / "vocab" / "bert-base-uncased-vocab.txt", True)


def _example(impossible=False):
    start = CONTEXT.index("Levi's Stadium")
    return SquadExample("q1", "Where was it?", CONTEXT, [] if impossible else [("Levi's Stadium", start)], impossible)


def test_windows_overlap_and_train_positions(tok):
    feats = make_features([_example()], tok, max_seq_length=48, doc_stride=16, max_query_length=64, train=True)
    assert len(feats.inputs) > 3  # the context is cut into several windows
    # consecutive windows share `doc_stride` context tokens
    ctx = [[o for o in offs if o is not None] for offs in feats.offsets]
    assert ctx[0][-16:] == ctx[1][:16]
    with_answer = [i for i, f in enumerate(feats.inputs) if f["start_positions"] > 0]
    assert with_answer, "the answer lies in at least one window"
    for i in with_answer:
        f, offs = feats.inputs[i], feats.offsets[i]
        assert CONTEXT[offs[f["start_positions"]][0]:offs[f["end_positions"]][1]] == "Levi's Stadium"
    others = [f for i, f in enumerate(feats.inputs) if i not in with_answer]
    assert others and all(f["start_positions"] == f["end_positions"] == 0 for f in others)  # [CLS]


def _logits(feats, target_text, tok, boost=10.0):
    """Logits that put `boost` on the start/end tokens of `target_text` wherever a window has it."""
    starts, ends = [], []
    for f, offs in zip(feats.inputs, feats.offsets):
        n = len(f["input_ids"])
        s, e = np.zeros(n), np.zeros(n)
        cs = CONTEXT.index(target_text)
        ce = cs + len(target_text)
        for j, o in enumerate(offs):
            if o is not None and o[0] == cs:
                s[j] = boost
            if o is not None and o[1] == ce:
                e[j] = boost
        starts.append(s)
        ends.append(e)
    return starts, ends


def test_nbest_decoding_finds_the_span_across_windows(tok):
    ex = [_example()]
    feats = make_features(ex, tok, max_seq_length=48, doc_stride=16, max_query_length=64, train=False)
    s, e = _logits(feats, "Levi's Stadium in Santa Clara", tok)
    preds, nbest = decode_predictions(ex, feats, s, e, n_best=5, max_answer_length=30)
    assert preds["q1"] == "Levi's Stadium in Santa Clara"  # the original text, casing kept
    assert nbest["q1"][0]["score"] == pytest.approx(20.0)
    # a max_answer_length shorter than the span forbids it
    preds, _ = decode_predictions(ex, feats, s, e, n_best=5, max_answer_length=3)
    assert preds["q1"] != "Levi's Stadium in Santa Clara"


def test_v2_null_threshold(tok):
    ex = [_example(impossible=True)]
    feats = make_features(ex, tok, max_seq_length=48, doc_stride=16, max_query_length=64, train=False)
    s, e = _logits(feats, "Levi's Stadium", tok, boost=2.0)  # best span scores 4
    for st, en in zip(s, e):
        st[0], en[0] = 3.0, 3.0  # [CLS]: null score 6
    preds, _ = decode_predictions(ex, feats, s, e, version_2=True, null_threshold=0.0)
    assert preds["q1"] == ""  # 6 - 4 = 2 > 0
    preds, _ = decode_predictions(ex, feats, s, e, version_2=True, null_threshold=2.5)
    assert preds["q1"] == "Levi's Stadium"  # 2 < 2.5: answer
    preds, _ = decode_predictions(ex, feats, s, e, version_2=False)
    assert preds["q1"] == "Levi's Stadium"  # v1.1 always answers
