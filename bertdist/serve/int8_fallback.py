"""Accuracy-aware int8: keep the most sensitive nodes in fp32, one per step, until the gate holds.

1. Quantise every weight MatMul (bertdist.serve.quantization) and judge the model with its gate
   (bertdist.serve.int8_gates). Within tolerance: done, nothing kept.
2. Otherwise measure each quantised node's sensitivity once: the relative error of its output in
   the int8 model against its fp32 product on the same input, ``||Y_int8 - X W|| / ||X W||`` over
   the calibration batches. The input is the int8 model's own, so the figure is the node's own
   quantisation error (its weights' and its input's), not what earlier layers passed on.
3. Re-quantise with the 1, 2, ... most sensitive nodes left in fp32 (onnxruntime's
   ``nodes_to_exclude``), judging and timing every step, until the gate holds or ``budget`` nodes
   are kept. Every step goes into the card: nodes kept, metric, speed.
"""
from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np

from bertdist.serve.int8_gates import Gate, batch_feeds
from bertdist.serve.quantization import quantize, weight_matmuls

DEFAULT_STEPS = 8  # nodes kept in fp32 at most (MiniLM-L6 has 38 weight MatMuls)
SPEED_BATCH = 32
SPEED_EXAMPLES = 128  # batches of 32 per timing round
SENSITIVITY_SHOWN = 10  # nodes listed in the card, most sensitive first


def node_errors(fp32_file: Path, int8_file: Path, feeds: list[dict[str, np.ndarray]],
                threads: int | None = None) -> dict[str, float]:
    """Each quantised weight MatMul's relative output error (see the module docstring)."""
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper

    from bertdist.serve.parity import graph_feed

    fp = onnx.load(str(fp32_file))
    weights = {i.name: i for i in fp.graph.initializer}
    q = onnx.load(str(int8_file))
    q_names = {n.name for n in q.graph.node}
    # a node left in fp32 keeps its name and op; a quantised one is replaced (dynamic: NAME_quant,
    # static: the same name, its weight now from a DequantizeLinear)
    q_weights = {i.name for i in q.graph.initializer}
    candidates = set(weight_matmuls(fp))
    nodes = {n.name: n for n in fp.graph.node if n.name in candidates}
    kept = {n.name for n in q.graph.node if n.op_type == "MatMul" and n.input[1] in q_weights and n.name in nodes}
    quantised = {k: v for k, v in nodes.items() if k not in kept and (k in q_names or k + "_quant" in q_names)}
    tensors = list(dict.fromkeys(t for n in quantised.values() for t in (n.input[0], n.output[0])))
    outputs = {o.name for o in q.graph.output}
    for t in tensors:
        if t not in outputs:
            q.graph.output.append(onnx.helper.make_tensor_value_info(t, onnx.TensorProto.FLOAT, None))
    so = ort.SessionOptions()
    if threads:
        so.intra_op_num_threads = int(threads)
    sess = ort.InferenceSession(q.SerializeToString(), so, providers=["CPUExecutionProvider"])
    w = {k: numpy_helper.to_array(weights[n.input[1]]).astype(np.float64) for k, n in quantised.items()}
    err = dict.fromkeys(quantised, 0.0)
    ref = dict.fromkeys(quantised, 0.0)
    for feed in feeds:
        got = dict(zip(tensors, sess.run(tensors, graph_feed(sess, feed))))
        for k, n in quantised.items():
            want = np.matmul(got[n.input[0]].astype(np.float64), w[k])
            err[k] += float(np.sum((got[n.output[0]] - want) ** 2))
            ref[k] += float(np.sum(want ** 2))
    return {k: (err[k] / ref[k]) ** 0.5 if ref[k] > 0 else 0.0 for k in quantised}


def throughput(sessions: dict, feeds: list[dict[str, np.ndarray]], repeats: int = 3) -> dict[str, float]:
    """Sequences per second of each session over ``feeds``, the sessions taking turns batch by batch
    (bertdist.serve.int8_report.take_turns); the median of ``repeats`` passes after a warm-up batch."""
    from bertdist.serve.int8_report import take_turns
    from bertdist.serve.parity import run_onnx

    runners = {k: (lambda s: lambda f: run_onnx(s, f))(s) for k, s in sessions.items()}
    for run in runners.values():
        run(feeds[0])
    n = sum(len(f["input_ids"]) for f in feeds)
    passes = [take_turns(runners, feeds) for _ in range(repeats)]
    return {k: n / statistics.median(p[k] for p in passes) for k in runners}


def search(fp32_file: Path, out_file: Path, mode: str, gate: Gate | None, calibration: list, budget: int,
           threads: int | None = None, log=print, timing: list | None = None) -> dict:
    """Quantise ``fp32_file`` into ``out_file``, keeping nodes in fp32 until ``gate`` holds (see the
    module docstring), each step timed on ``timing`` (default: the calibration examples). Returns the
    settings, the verdict, every step and the sensitivities."""
    from bertdist.serve.runtime import make_session

    cal_feeds = batch_feeds(calibration, 16)
    timing = timing or calibration
    speed_feeds = batch_feeds(timing[:SPEED_EXAMPLES], SPEED_BATCH)
    fp32_session = make_session(fp32_file, threads)
    kept: list[str] = []
    order: list[str] | None = None
    errors: dict[str, float] = {}
    steps = []
    while True:
        settings = quantize(fp32_file, out_file, mode, kept, cal_feeds if mode == "static" else None)
        session = make_session(out_file, threads)
        verdict = gate.judge(gate.measure(session)) if gate is not None else {"metric": None, "checked": False}
        speed = throughput({"fp32": fp32_session, "int8": session}, speed_feeds)
        steps.append({"step": len(steps), "kept_fp32": list(kept), "metric": verdict.get("int8"),
                      "drop_points": verdict.get("drop_points"), "within_tolerance": verdict.get("within_tolerance"),
                      "seq_per_s_b32": round(speed["int8"], 1), "fp32_onnx_seq_per_s_b32": round(speed["fp32"], 1),
                      "speedup_vs_fp32_onnx": round(speed["int8"] / speed["fp32"], 3)})
        _log_step(steps[-1], gate, log)
        if gate is None or verdict["within_tolerance"] or len(kept) >= budget:
            break
        if order is None:
            errors = node_errors(fp32_file, out_file, cal_feeds, threads)
            order = sorted(errors, key=lambda k: -errors[k])
            log("int8 sensitivity (relative output error of each quantised node, largest first): " +
                ", ".join(f"{k} {errors[k]:.3g}" for k in order[:5]))
        remaining = [k for k in order if k not in kept]
        if not remaining:
            break
        kept.append(remaining[0])
    shown = sorted(errors, key=lambda k: -errors[k])[:SENSITIVITY_SHOWN]
    return {"settings": settings, "verdict": verdict, "session": session,
            "fallback": {"budget": budget, "steps": steps, "speed_examples": min(len(timing), SPEED_EXAMPLES),
                         "sensitivity": [{"node": k, "error": round(errors[k], 5)} for k in shown]}}


def _log_step(step: dict, gate: Gate | None, log) -> None:
    what = "metric not checked" if gate is None else (
        f"{gate.name} {step['metric']:.4f} (fp32 {gate.fp32:.4f}"
        + (f", drop {step['drop_points']:+.2f} points)" if step["drop_points"] is not None else ")"))
    log(f"int8 step {step['step']}: {len(step['kept_fp32'])} node(s) kept in fp32"
        + (f" (+{step['kept_fp32'][-1]})" if step["kept_fp32"] else "")
        + f": {what}; {step['seq_per_s_b32']:.0f} seq/s at batch {SPEED_BATCH}, "
          f"{step['speedup_vs_fp32_onnx']:.2f}x fp32 ONNX")


def refusal(gate: Gate, steps: list[dict], budget: int) -> str:
    """The refusal message: the full int8 model's figures first, then the best the fallback reached."""
    first = steps[0]
    if gate.metric == "embedding_cosine_min":
        msg = (f"int8 refused: its sentence embeddings' lowest cosine to fp32's is {first['metric']:.4f} "
               f"(< {gate.judge(1.0)['minimum']}) over {gate.examples} texts")
    else:
        msg = (f"int8 refused: {gate.name} drops from {gate.fp32:.4f} to {first['metric']:.4f}, "
               f"{first['drop_points']:.2f} points, above the tolerance of "
               f"{gate.judge(gate.fp32)['tolerance_points']} points ({gate.examples} examples)")
    if len(steps) > 1:
        best = max(steps[1:], key=lambda s: s["metric"])
        msg += (f"; keeping up to {len(steps[-1]['kept_fp32'])} of the most sensitive nodes in fp32 "
                f"(--int8-fallback-steps {budget}) reached at best {best['metric']:.4f} "
                f"({len(best['kept_fp32'])} kept)")
    return msg + ("; raise the tolerance with --int8-tolerance POINTS, allow more steps with --int8-fallback-steps N, "
                  "or export without --quantize")

