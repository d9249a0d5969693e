"""model.compile: true, false, or the measured choice per device type; the model compiled in place."""
import pytest
import torch

from bertdist.config import ConfigError
from bertdist.model import BertConfig
from bertdist.train.compile import AUTO_DECISIONS, apply_compile, decide_compile


def test_true_and_false_are_obeyed_and_auto_follows_the_measurement():
    assert decide_compile(True, "cpu").enabled and not decide_compile(False, "cuda").enabled
    cpu = decide_compile("auto", "cpu")
    assert cpu.enabled == AUTO_DECISIONS["cpu"][0] is False
    assert "benchmarks/results/model_compile_cpu_2026-11-25.md" in cpu.reason
    cuda = decide_compile("auto", "cuda")  # no GPU measurement yet: eager, saying so
    assert not cuda.enabled and "not yet measured on cuda" in cuda.reason
    with pytest.raises(ValueError, match="true, false or auto"):
        decide_compile("sometimes", "cpu")


def test_the_config_takes_true_false_auto_only():
    assert BertConfig.from_mapping({"preset": "tiny", "compile": True}).compile is True
    assert BertConfig.from_mapping({"preset": "tiny"}).compile == "auto"
    with pytest.raises(ConfigError, match="compile"):
        BertConfig.from_mapping({"preset": "tiny", "compile": "yes please"})


def test_compiled_in_place_keeps_the_parameter_names():
    m = torch.nn.Sequential(torch.nn.Linear(4, 4))
    names = list(m.state_dict())
    apply_compile(m, decide_compile(False, "cpu"))
    assert m._compiled_call_impl is None
    apply_compile(m, decide_compile(True, "cpu"))
    assert m._compiled_call_impl is not None and list(m.state_dict()) == names


@pytest.mark.slow  # three one-process runs of the tiny recipe, each compiling with inductor: 500 s under load
def test_a_compiled_run_resumes_exactly_and_exports(tmp_path, train_records, small_vocab):
    from bertdist.export.sources import load_pretrained
    from tests.train.conftest import assert_ok, metrics, run_pretrain, tiny_args

    common = ("model.compile=true", "data.eval_split=null", "checkpoint.every_steps=2")
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert_ok(run_pretrain(1, tiny_args(whole, train_records, small_vocab, *common, "max_steps=4"), timeout=900))
    assert_ok(run_pretrain(1, tiny_args(part, train_records, small_vocab, *common, "max_steps=2"), timeout=900))
    assert_ok(run_pretrain(1, [*tiny_args(part, train_records, small_vocab, *common, "max_steps=4"), "--resume",
                               "auto"], timeout=900))
    assert all(r["compile"] is True for r in metrics(whole, "run"))
    ref = {r["step"]: r["loss"] for r in metrics(whole)}
    resumed = {r["step"]: r["loss"] for r in metrics(part)}
    assert sorted(resumed) == [1, 2, 3, 4] and resumed == ref  # bitwise, as without compile
    w = load_pretrained(part)  # the checkpoint of a compiled module exports under the usual names
    assert w.origin["tag"] == "step_00000004" and "bert.embeddings.word_embeddings.weight" in w.state_dict


def _train_steps(model, cfg, masked_counts, seq: int = 32, batch: int = 4):
    torch.manual_seed(0)
    for n in masked_counts:
        ids = torch.randint(5, cfg.vocab_size, (batch, seq))
        labels = torch.full((batch, seq), -100)
        labels[:, 1:1 + n] = ids[:, 1:1 + n]
        out = model(ids, torch.ones(batch, seq, dtype=torch.long), torch.zeros_like(ids), labels=labels,
                    next_sentence_label=torch.zeros(batch, dtype=torch.long))
        out.loss.backward()


@pytest.mark.parametrize("layers", [2, 4])
def test_regional_compile_traces_one_layer_graph_and_never_recompiles(layers):
    """Every encoder layer reuses one graph, so the graphs do not grow with depth; the sparse MLM
    head takes a new number of masked positions every step without recompiling."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from bertdist.model import BertForPreTraining
    from bertdist.train.compile import compile_regions

    cfg = BertConfig.from_mapping({"preset": "tiny", "kernels": "reference", "num_hidden_layers": layers})
    model = BertForPreTraining(cfg, device_type="cpu")
    torch._dynamo.reset()
    counters.clear()
    regions = apply_compile(model, decide_compile(True, "cpu"), backend="aot_eager")
    assert len(regions) == len(compile_regions(model)) == layers + 2  # the layers, the embeddings, the MLM head
    with torch._dynamo.config.patch(error_on_recompile=True):
        _train_steps(model, cfg, masked_counts=[3, 5, 4, 7])
    assert counters["stats"]["unique_graphs"] == 3, dict(counters["stats"])  # embeddings, a layer, the head
    assert not counters["recompiles"], dict(counters["recompiles"])
    assert list(model.state_dict()) == list(BertForPreTraining(cfg, device_type="cpu").state_dict())


def test_compile_cache_round_trip(tmp_path):
    """What a compiled model leaves in the cache is written (0600) and read back by the next run."""
    import os
    import stat

    import torch._dynamo

    from bertdist.model import BertForPreTraining
    from bertdist.train.compile import load_compile_cache, save_compile_cache

    cfg = BertConfig.from_mapping({"preset": "tiny", "kernels": "reference"})
    model = BertForPreTraining(cfg, device_type="cpu")
    torch._dynamo.reset()
    path = tmp_path / "cache" / "compile.bin"
    assert load_compile_cache(str(path)) is None and save_compile_cache(None) is None
    apply_compile(model, decide_compile(True, "cpu"))
    _train_steps(model, cfg, masked_counts=[3])
    saved = save_compile_cache(str(path))
    assert saved and saved["bytes"] == path.stat().st_size > 0 and saved["entries"].get("inductor", 0) > 0
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    loaded = load_compile_cache(str(path))
    # the same bytes back; torch counts entries its own way on each side (duplicates of a process's
    # earlier compiles are recorded once per compile, loaded once)
    assert loaded["bytes"] == saved["bytes"] and loaded["entries"].get("inductor", 0) > 0
