"""int8 judged by each model's own metric (STS Spearman, re-ranking nDCG@10), and static int8 from the CLI."""
from __future__ import annotations

import json

import pytest

from bertdist.serve.card import CARD, ExportError
from bertdist.serve.onnx_export import ExportOptions, export_onnx
from tests.serve.conftest import self_labelled_sst2

STSB_HEADER = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"


@pytest.fixture(scope="module")
def embed_ckpt(tmp_path_factory):
    from tests.embed import fixtures

    d = tmp_path_factory.mktemp("embed_ckpt")
    return fixtures.tiny_checkpoint(d / "tiny", fixtures.word_vocab(d / "vocab.txt"))


def write_stsb_dev(d, n: int = 24):
    """STS-B's dev.tsv layout: a sentence with its own paragraph (score 4.5) or another's (0.5)."""
    from tests.embed import fixtures

    rows = fixtures.book_pairs(n=n)
    d.mkdir()
    lines = [STSB_HEADER]
    for i, r in enumerate(rows):
        other = rows[(i + 7) % n]["positive"] if i % 2 else r["positive"]
        lines.append(f"{i}\tmain-captions\tMSRvid\t2012test\t{i:04d}\tnone\tnone\t{r['query']}\t{other}\t"
                     f"{0.5 if i % 2 else 4.5}\n")
    (d / "dev.tsv").write_text("".join(lines))
    return d


def test_a_bi_encoder_is_judged_by_its_sts_spearman(embed_ckpt, tmp_path):
    from bertdist.embed.data import read_stsb
    from bertdist.embed.evaluate import sts_eval
    from bertdist.embed.export import write_bi_encoder
    from bertdist.embed.model import load_bi_encoder

    model = load_bi_encoder(embed_ckpt, pooling="mean", normalize=True, max_seq_length=64, kernels="reference")
    src = write_bi_encoder(tmp_path / "st", model)
    dev = write_stsb_dev(tmp_path / "STS-B")
    card = export_onnx(src, tmp_path / "onnx", ExportOptions(quantize="int8", task="sts", dev=str(dev),
                                                             tolerance_points=100.0, calibration=16), log=lambda *_: None)
    p = card["parity"]["int8"]
    want = sts_eval(model, read_stsb(dev / "dev.tsv"))["spearman"]
    assert p["metric"] == "spearman" and p["examples"] == 24 and p["within_tolerance"]
    assert abs(p["fp32"] - want) < 1e-3  # the ONNX fp32 model scored as the PyTorch bi-encoder is
    assert card["int8_report"]["metric"] == "spearman" and card["int8_report"]["fp32"] == p["fp32"]


def test_a_cross_encoder_is_judged_by_its_reranking_ndcg(embed_ckpt, tmp_path):
    import torch

    from bertdist.embed.data import read_pairs
    from bertdist.embed.evaluate import build_rerank_dev, rerank_eval
    from bertdist.embed.export import write_cross_encoder
    from bertdist.embed.model import load_cross_encoder

    torch.manual_seed(0)
    ce = load_cross_encoder(embed_ckpt, max_seq_length=96, activation="sigmoid", kernels="reference")
    src = write_cross_encoder(tmp_path / "ce", ce)
    data, p = _judged_on_pairs(src, tmp_path, "rerank")
    want = rerank_eval(ce, build_rerank_dev(read_pairs(data / "dev.jsonl")))["ndcg@10"]
    assert p["metric"] == "ndcg@10" and p["examples"] == 12
    assert abs(p["fp32"] - want) < 1e-6

    with pytest.raises(ExportError, match="--task sts measures an encoder model"):
        export_onnx(src, tmp_path / "wrong", ExportOptions(quantize="int8", task="sts", dev=str(data)),
                    log=lambda *_: None)


def test_static_int8_from_the_cli(tmp_path, hf_model, onnx_model, capsys):
    import onnx

    from bertdist.cli.main import main

    dev = self_labelled_sst2(tmp_path, onnx_model("classification"))
    out = tmp_path / "o"
    rc = main(["export", str(hf_model("classification")), "--format", "onnx", "--quantize", "int8", "--int8-mode", "static",
               "--calibration", "32", "--task", "sst2", "--dev", str(dev), "--int8-tolerance", "20", "--out", str(out)])
    assert rc == 0
    assert "int8 report (static): accuracy 1.0000 fp32 -> " in capsys.readouterr().out
    q = json.loads((out / CARD).read_text())["quantization"]
    # no train.tsv beside the dev set: calibrated on the first 32 dev rows
    assert q["mode"] == "static" and q["format"] == "QDQ" and q["calibration_examples"] == 32
    ops = {n.op_type for n in onnx.load(str(out / "model.int8.onnx")).graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops and "MatMulInteger" not in ops
    with pytest.raises(SystemExit):
        main(["export", str(hf_model("classification")), "--format", "onnx", "--quantize", "int8", "--int8-mode", "int4",
              "--out", str(tmp_path / "x")])


def _judged_on_pairs(src, tmp_path, task: str):
    """(the pairs folder, the int8 verdict) of ``src`` exported with ``--task TASK`` on tiny pairs."""
    from tests.embed import fixtures

    data = fixtures.retrieval_dir(tmp_path / "pairs", n_train=8, n_dev=12, negatives=3)
    card = export_onnx(src, tmp_path / "onnx", ExportOptions(quantize="int8", task=task, dev=str(data),
                                                             tolerance_points=100.0, calibration=16), log=lambda *_: None)
    return data, card["parity"]["int8"]


def test_a_bi_encoder_is_judged_by_its_retrieval_ndcg(embed_ckpt, tmp_path):
    from bertdist.embed.data import read_pairs
    from bertdist.embed.evaluate import build_retrieval_dev, retrieval_eval
    from bertdist.embed.export import write_bi_encoder
    from bertdist.embed.model import load_bi_encoder

    model = load_bi_encoder(embed_ckpt, pooling="mean", normalize=True, max_seq_length=64, kernels="reference")
    src = write_bi_encoder(tmp_path / "st", model)
    data, p = _judged_on_pairs(src, tmp_path, "embed")
    want = retrieval_eval(model, build_retrieval_dev(read_pairs(data / "dev.jsonl")))["ndcg@10"]
    assert p["metric"] == "ndcg@10" and p["examples"] == 12 and p["within_tolerance"]
    assert abs(p["fp32"] - want) < 1e-3  # the ONNX fp32 model ranked as the PyTorch bi-encoder does
