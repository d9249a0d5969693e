"""model.cuda_graphs: the decision per setting and device profile, the regions compiled in graph
mode, a new graph step per micro-batch, and a failed capture stopping the run with the fix. The
CUDA branches run here on CPU: the device comes from a DeviceProfile, torch's compile and graph
calls are replaced by recorders, and failures are injected."""
from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from bertdist.config import ConfigError
from bertdist.device_profile import by_name
from bertdist.model import BertConfig
from bertdist.train import cuda_graphs
from bertdist.train.compile import CompileDecision, apply_compile, compile_regions, decide_compile
from bertdist.train.cuda_graphs import CudaGraphError, decide_cuda_graphs

REPO = Path(__file__).resolve().parents[2]
LARGE = REPO / "configs" / "pretrain" / "bert-large-phase1.yaml"
H100, CPU = by_name("h100"), by_name("cpu")
COMPILED, EAGER = CompileDecision(True, "model.compile=true"), CompileDecision(False, "model.compile=false")


def test_false_is_off_everywhere_and_true_is_on_for_compiled_cuda():
    for profile in (H100, CPU):
        for compiled in (COMPILED, EAGER):
            assert decide_cuda_graphs(False, profile.type, compiled) == cuda_graphs.CudaGraphsDecision(
                False, "model.cuda_graphs=false")
    assert decide_cuda_graphs(True, H100.type, COMPILED).enabled


def test_true_is_refused_on_cpu_and_without_compile():
    with pytest.raises(ConfigError, match="model.cuda_graphs=true needs a CUDA device; this run's device is cpu"):
        decide_cuda_graphs(True, CPU.type, COMPILED)
    # compile: auto on CUDA resolves eager (nothing measured there): the error says so and names both keys
    auto = decide_compile("auto", H100.type)
    with pytest.raises(ConfigError, match=r"model.cuda_graphs=true .* compiles none \(model.compile=auto: eager"
                                          r".*set model.compile=true, or model.cuda_graphs=false"):
        decide_cuda_graphs(True, H100.type, auto)
    with pytest.raises(ValueError, match="true, false or auto, got 'sometimes'"):
        decide_cuda_graphs("sometimes", H100.type, COMPILED)


def test_auto_follows_the_committed_measurement(monkeypatch):
    off = decide_cuda_graphs("auto", H100.type, COMPILED)
    assert not off.enabled and "not yet measured on cuda" in off.reason and "ours-trainer-graphs" in off.reason
    assert cuda_graphs.AUTO_DECISIONS == {}  # nothing measured: a measurement adds its row and its file
    cpu = decide_cuda_graphs("auto", CPU.type, COMPILED)
    assert not cpu.enabled and "CUDA's only" in cpu.reason
    uncompiled = decide_cuda_graphs("auto", H100.type, EAGER)
    assert not uncompiled.enabled and "not compiled (model.compile=false)" in uncompiled.reason
    monkeypatch.setitem(cuda_graphs.AUTO_DECISIONS, "cuda", (True, "faster (benchmarks/results/x.md)"))
    on = decide_cuda_graphs("auto", H100.type, COMPILED)
    assert on.enabled and on.reason == "model.cuda_graphs=auto: faster (benchmarks/results/x.md)"
    assert not decide_cuda_graphs("auto", H100.type, EAGER).enabled  # never without compile


def test_the_config_takes_true_false_auto_and_refuses_what_graphs_cannot_capture():
    from bertdist.train.config import load_train_config

    assert BertConfig.from_mapping({"preset": "tiny"}).cuda_graphs == "auto"
    assert load_train_config(LARGE, ["model.cuda_graphs=true", "model.compile=true"]).model.cuda_graphs is True
    with pytest.raises(ConfigError, match="cuda_graphs"):
        BertConfig.from_mapping({"preset": "tiny", "cuda_graphs": "always"})
    with pytest.raises(ConfigError, match="model.cuda_graphs=true .* model.compile=false compiles none"):
        load_train_config(LARGE, ["model.cuda_graphs=true", "model.compile=false"])
    with pytest.raises(ConfigError, match="deepspeed.zero_stage 0, 1 or 2 \\(got 3\\)"):
        load_train_config(LARGE, ["model.cuda_graphs=true", "optimizer.name=adamw", "deepspeed.zero_stage=3"])
    with pytest.raises(ConfigError, match="activation_checkpointing=torch is not supported"):
        load_train_config(LARGE, ["model.cuda_graphs=true", "deepspeed.activation_checkpointing=torch"])
    # auto and false never refuse: auto decides off where graphs cannot run
    load_train_config(LARGE, ["model.cuda_graphs=auto", "model.compile=false", "optimizer.name=adamw",
                              "deepspeed.zero_stage=3"])


def _recorded_compiles(monkeypatch, graphs: bool):
    from bertdist.model import BertForPreTraining

    calls = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: calls.append((self, kw)))
    model = BertForPreTraining(BertConfig.from_mapping({"preset": "tiny", "kernels": "reference"}), device_type="cpu")
    regions = apply_compile(model, COMPILED, graphs=graphs)
    assert [m for m, _ in calls] == regions == [m for m, _ in compile_regions(model)]
    return {type(m).__name__: kw for m, kw in calls}, calls


def test_static_regions_are_compiled_in_graph_mode_and_the_dynamic_head_never(monkeypatch):
    by_kind, calls = _recorded_compiles(monkeypatch, graphs=True)
    options = cuda_graphs.graph_options()
    # reduce-overhead's own options (torch's list), and no graph recorded per dynamic shape
    assert options["triton.cudagraphs"] is True and options["triton.cudagraph_skip_dynamic_graphs"] is True
    static = [kw for m, kw in calls if type(m).__name__ != "BertLMPredictionHead"]
    assert len(static) == 3  # two layers and the embeddings
    assert all(kw == {"backend": "inductor", "dynamic": None, "options": options} for kw in static)
    assert by_kind["BertLMPredictionHead"] == {"backend": "inductor", "dynamic": True}


def test_without_graphs_no_region_gets_graph_options(monkeypatch):
    _, calls = _recorded_compiles(monkeypatch, graphs=False)
    assert calls and all("options" not in kw for _, kw in calls)


class _Engine:
    """The DeepSpeed engine as a step sees it; records what happens in order."""

    def __init__(self, events: list, fail_at: int | None = None, error: Exception | None = None):
        self.module = torch.nn.Linear(4, 1)
        self.events, self.fail_at, self.error = events, fail_at, error
        self.skipped_steps, self.calls = 0, 0

    def __call__(self, **batch):
        self.calls += 1
        self.events.append(("forward", all(p.grad is not None for p in self.module.parameters())))
        if self.calls == self.fail_at:
            raise self.error
        return self.module(batch["input_ids"].float()[:, :4]).sum()

    def get_lr(self):
        return [1e-3]

    def backward(self, loss):
        self.events.append(("backward",))
        loss.backward()

    def step(self):
        self.events.append(("step",))

    def get_global_grad_norm(self):
        return 1.0


def _runner(monkeypatch, graphs: bool, accum: int, **engine_kw):
    from bertdist.train.step import StepRunner

    events = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: events.append(("mark",)))
    objective = lambda loss, mb: types.SimpleNamespace(loss=loss, parts={},  # noqa: E731
                                                       counts={"mlm_count": torch.tensor(2.0)})
    runner = StepRunner(_Engine(events, **engine_kw), torch.device("cpu"), accum, "fp32",
                        BertConfig.from_mapping({"preset": "tiny"}), own_grad_norm=False, objective=objective,
                        cuda_graphs=graphs)
    batch = {"input_ids": torch.ones(2, 8, dtype=torch.long), "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    return runner, [dict(batch) for _ in range(accum)], events


@pytest.mark.parametrize("accum", [1, 3])
def test_each_micro_batch_is_a_new_graph_step_when_graphs_are_on(monkeypatch, accum):
    from bertdist.train.step import launch_step

    runner, mbs, events = _runner(monkeypatch, graphs=True, accum=accum)
    launch_step(runner, mbs, False, step=1)
    kinds = [e[0] for e in events]
    assert kinds == ["mark", "forward", "backward", "step"] * accum
    # accumulating: every gradient has its own buffer before the first backward (not a graph output)
    assert events[1][1] is (accum > 1)


def test_no_graph_step_is_marked_when_graphs_are_off(monkeypatch):
    from bertdist.train.step import launch_step

    runner, mbs, events = _runner(monkeypatch, graphs=False, accum=3)
    launch_step(runner, mbs, False, step=1)
    assert [e[0] for e in events] == ["forward", "backward", "step"] * 3
    assert events[0][1] is False  # no gradient buffers allocated ahead


CAPTURE = RuntimeError("CUDA error: operation not permitted when stream is capturing")


def test_a_failed_capture_stops_the_step_with_the_fix(monkeypatch):
    from bertdist.train.step import launch_step

    runner, mbs, _ = _runner(monkeypatch, graphs=True, accum=2, fail_at=2, error=CAPTURE)
    with pytest.raises(CudaGraphError, match=r"failed at step 7, micro-batch 2 of 2: RuntimeError: CUDA error: "
                                             r"operation not permitted when stream is capturing\. Restart without "
                                             r"them: model.cuda_graphs=false, with --resume auto") as err:
        launch_step(runner, mbs, False, step=7)
    assert err.value.__cause__ is CAPTURE


def test_other_errors_and_errors_without_graphs_pass_through(monkeypatch):
    from bertdist.train.step import launch_step

    runner, mbs, _ = _runner(monkeypatch, graphs=False, accum=2, fail_at=1, error=CAPTURE)
    with pytest.raises(RuntimeError) as err:
        launch_step(runner, mbs, False, step=1)
    assert not isinstance(err.value, CudaGraphError)
    runner, mbs, _ = _runner(monkeypatch, graphs=True, accum=2, fail_at=1, error=ValueError("bad batch"))
    with pytest.raises(ValueError, match="bad batch"):
        launch_step(runner, mbs, False, step=1)


def test_graph_failures_are_told_by_message_or_by_where_they_were_raised():
    assert cuda_graphs.is_graph_failure(CAPTURE)
    assert cuda_graphs.is_graph_failure(RuntimeError("Error: accessing tensor output of CUDAGraphs that has been "
                                                     "overwritten by a subsequent run."))
    assert not cuda_graphs.is_graph_failure(RuntimeError("CUDA out of memory"))
    try:  # raised from a frame of torch's CUDA graph trees, whatever its message
        exec(compile("raise RuntimeError('invariant violated')", "torch/_inductor/cudagraph_trees.py", "exec"))
    except RuntimeError as e:
        assert cuda_graphs.is_graph_failure(e)


def test_evaluation_marks_each_batch_when_graphs_are_on(group, monkeypatch):
    from bertdist.train.step import evaluate

    class Engine(torch.nn.Module):
        def forward(self, **mb):
            return mb

    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    objective = types.SimpleNamespace(eval_sums=lambda out, mb: {"mlm_count": 1.0, "mlm_loss_sum": 0.5})
    batches = [{"input_ids": torch.ones(1, 2)} for _ in range(3)]
    for graphs, expected in ((False, 0), (True, 3)):
        marks.clear()
        res = evaluate(Engine(), batches, torch.device("cpu"), objective=objective,
                       model=BertConfig.from_mapping({"preset": "tiny"}), cuda_graphs=graphs)
        assert len(marks) == expected and res["masked_tokens"] == 3


def test_stable_grads_allocates_only_missing_buffers():
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    frozen = torch.nn.Parameter(torch.ones(1), requires_grad=False)
    b.grad = kept = torch.full((3,), 5.0)
    assert cuda_graphs.stable_grads([a, b, frozen]) == 1
    assert torch.equal(a.grad, torch.zeros(2)) and b.grad is kept and frozen.grad is None


def test_the_plan_reports_both_decisions_and_refuses_like_the_run():
    from bertdist.train.config import load_train_config
    from bertdist.train.launch_plan import compile_plan, format_launch_plan, launch_plan

    graphs = load_train_config(LARGE, ["model.compile=true", "model.cuda_graphs=true"])
    assert compile_plan(graphs, H100) == {"compile": True, "compile_reason": "model.compile=true",
                                          "cuda_graphs": True, "cuda_graphs_reason": "model.cuda_graphs=true"}
    plan = launch_plan(graphs, 8, H100)
    assert plan["compile"]["cuda_graphs"] is True
    assert "compile: model.compile=true; model.cuda_graphs=true" in format_launch_plan(plan).splitlines()
    default = compile_plan(load_train_config(LARGE), H100)
    assert not default["cuda_graphs"] and "not yet measured on cuda" in default["cuda_graphs_reason"]
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        compile_plan(graphs, CPU)


def test_a_run_reports_the_decision_and_refuses_true_on_cpu(tmp_path, train_records, small_vocab):
    from tests.train.conftest import assert_ok, metrics, run_pretrain, tiny_args

    res = run_pretrain(1, tiny_args(tmp_path / "graphs", train_records, small_vocab, "model.compile=true",
                                    "model.cuda_graphs=true", "max_steps=1"))
    assert res.returncode != 0 and "model.cuda_graphs=true needs a CUDA device; this run's device is cpu" in \
        res.stdout + res.stderr, res.stderr[-3000:]
    assert not list((tmp_path / "graphs").glob("checkpoints/step_*"))  # refused before the first step
    run_dir = tmp_path / "auto"
    res = run_pretrain(1, tiny_args(run_dir, train_records, small_vocab, "max_steps=1", "data.eval_split=null"))
    assert_ok(res)
    start = next(line for line in (res.stdout + res.stderr).splitlines() if "bertdist pretrain: phase" in line)
    assert start.endswith("; model.cuda_graphs=auto: off: CUDA graphs are CUDA's only (device cpu)"), start
    run = metrics(run_dir, "run")[0]
    assert run["cuda_graphs"] is False and run["compile"] is False
    assert run["cuda_graphs_reason"] == "model.cuda_graphs=auto: off: CUDA graphs are CUDA's only (device cpu)"
    assert run["compile_reason"].startswith("model.compile=auto: eager")


def test_torch_takes_the_graph_options_and_a_skipped_capture_is_counted():
    """The options are Inductor's own (torch checks every key); where a graph cannot be captured
    (here: a CPU device) Inductor compiles without one, and ``skipped_graphs`` counts it."""
    import torch._dynamo

    assert torch._TorchCompileInductorWrapper(None, cuda_graphs.graph_options(), None).config == \
        cuda_graphs.graph_options()
    torch._dynamo.reset()
    before = cuda_graphs.skipped_graphs()
    m = torch.nn.Linear(4, 4)
    m.compile(backend="inductor", options=cuda_graphs.graph_options())
    m(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert cuda_graphs.skipped_graphs() > before and m.weight.grad is not None


@pytest.mark.parametrize("graphs", [True, False])
def test_after_the_first_step_the_run_counts_the_graphs_inductor_skipped(monkeypatch, graphs):
    from bertdist.train.trainer import _Session

    monkeypatch.setattr(cuda_graphs, "skipped_graphs", lambda: 2)
    records, messages = [], []
    session = object.__new__(_Session)
    session.log = types.SimpleNamespace(record=lambda kind, step, values, tensorboard: records.append(values),
                                        message=messages.append)
    session.compile_pending = {"cache": None, "cache_loaded": None, "rank": 1, "cuda_graphs": graphs}
    session._report_compile(1, 3.0)
    assert session.compile_pending is None and records[0]["first_step_s"] == 3.0
    assert records[0].get("cuda_graphs_skipped") == (2 if graphs else None)
    assert ("CUDA graphs: 2 graphs Inductor did not capture (TORCH_LOGS=cudagraphs says why)" in messages[0]) is graphs
