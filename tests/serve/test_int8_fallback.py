"""Accuracy-aware int8: a layer planted to break under int8 is found and kept in fp32, alone."""
from __future__ import annotations

import pytest

from bertdist.serve.onnx_export import ExportOptions, export_onnx
from tests.serve.conftest import make_hf_dir, self_labelled_sst2

PLANTED = "/model/bert/encoder/layer.1/intermediate/dense/MatMul"


def plant_outlier_channel(hf_dir, layer: int = 1, channel: int = 5, texts: int = 512) -> None:
    """One input channel of ``layer``'s FFN weights made extreme (1e4), its input held at 0.

    In fp32 the channel multiplies zeros and changes nothing; int8 takes its weight scale from the
    largest weight of the tensor (per tensor) or of each output channel (per channel), so every
    other weight of the layer rounds to 0 and the layer's output is lost. The weights are drawn
    wider than BERT's initialisation (std 0.1; 1.0 for the FFN's output) so that the logits depend
    on the text through that layer, and the classifier's bias puts the decision at the median
    text, so both labels occur."""
    import numpy as np
    import torch
    import transformers

    from bertdist.serve.parity import sample_texts

    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification.from_pretrained(str(hf_dir)).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    block = model.bert.encoder.layer[layer]
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.normal_(0.0, 0.1)
        block.output.dense.weight.normal_(0.0, 1.0)  # the layer's FFN outweighs its residual input
        block.intermediate.dense.weight[:, channel] = 1e4
        block.attention.output.LayerNorm.weight[channel] = 0.0
        block.attention.output.LayerNorm.bias[channel] = 0.0
        enc = tok([t[:300] for t in sample_texts(texts)], padding=True, truncation=True, max_length=128,
                  return_tensors="pt")
        logits = model(**enc).logits
        model.classifier.bias[1] -= float(np.median((logits[:, 1] - logits[:, 0]).numpy()))
    model.save_pretrained(str(hf_dir))


@pytest.fixture(scope="module")
def planted(tmp_path_factory, small_vocab):
    """The planted model and a dev set of its 128 most confident labels out of 512 texts (int8's
    rounding elsewhere flips none of them; the planted layer flips many)."""
    d = tmp_path_factory.mktemp("planted")
    hf = make_hf_dir(d / "hf", "classification", small_vocab, seed=1)
    plant_outlier_channel(hf)
    export_onnx(hf, d / "fp32", ExportOptions(), log=lambda *_: None)
    return hf, self_labelled_sst2(d, d / "fp32", n=512, keep=128)


@pytest.mark.parametrize("mode", ["dynamic", "per-channel"])
def test_fallback_keeps_exactly_the_planted_layer_in_fp32(planted, tmp_path, mode):
    hf, dev = planted
    card = export_onnx(hf, tmp_path / "out", ExportOptions(quantize="int8", int8_mode=mode, task="sst2", dev=str(dev),
                                                            tolerance_points=5.0), log=lambda *_: None)
    q = card["quantization"]
    steps = q["fallback"]["steps"]
    assert q["mode"] == mode and q["per_channel"] is (mode != "dynamic")
    assert not steps[0]["within_tolerance"] and steps[0]["drop_points"] > 5.0  # the planted layer breaks int8
    sens = q["fallback"]["sensitivity"]
    assert sens[0]["node"] == PLANTED and sens[0]["error"] > 0.5 > sens[1]["error"]
    assert q["kept_fp32"] == [PLANTED] and len(steps) == 2 and steps[1]["within_tolerance"]
    assert card["parity"]["int8"]["within_tolerance"] and card["parity"]["int8"]["drop_points"] <= 5.0
    report = card["int8_report"]
    assert report["kept_fp32"] == [PLANTED] and report["int8"] == steps[1]["metric"] == card["parity"]["int8"]["int8"]
    assert report["fp32"] == card["parity"]["int8"]["fp32"] >= 0.95  # the dev set is the fp32 model's own labels
    for b in ("batch_1", "batch_32"):
        assert report["speed"][b]["onnx_int8_seq_per_s"] > 0 and report["speed"][b]["int8_vs_torch_eager"] > 0
    for s in steps:
        assert s["seq_per_s_b32"] > 0 and s["speedup_vs_fp32_onnx"] > 0
