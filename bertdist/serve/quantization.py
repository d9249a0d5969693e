"""int8 ONNX models in three modes, all onnxruntime's own quantisers over the plain fp32 graph:

* ``dynamic``: int8 weights, one scale per weight tensor, activations quantised at run time;
* ``per-channel`` (the default): the same with one weight scale per output channel, so one
  channel's large weights no longer cost every other channel its precision;
* ``static``: QDQ format, per-channel weights and activation scales fixed beforehand from a
  calibration set (min/max over ``--calibration N`` examples).

Only MatMuls with a constant weight are quantised; the attention score products between two
activations stay fp32. ``keep_fp32`` names nodes left in fp32 (onnxruntime's ``nodes_to_exclude``):
what the accuracy-aware fallback (bertdist.serve.int8_fallback) chooses.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

MODES = ("dynamic", "per-channel", "static")
DEFAULT_MODE = "per-channel"
DEFAULT_CALIBRATION = 256  # examples: a few hundred, as onnxruntime's own examples calibrate with
OP_TYPES = ["MatMul", "Attention"]


def weight_matmuls(model) -> list[str]:
    """Names of the graph's MatMul nodes whose second input is a constant weight, in graph order."""
    weights = {init.name for init in model.graph.initializer}
    return [n.name for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in weights]


class FeedReader:
    """onnxruntime's CalibrationDataReader protocol over prepared feed dicts."""

    def __init__(self, feeds: Sequence[dict[str, np.ndarray]]):
        self._feeds = list(feeds)
        self._it = iter(self._feeds)

    def get_next(self):
        return next(self._it, None)

    def rewind(self):
        self._it = iter(self._feeds)


def quantize(in_file: Path, out_file: Path, mode: str = DEFAULT_MODE, keep_fp32: Iterable[str] = (),
             calibration: Sequence[dict[str, np.ndarray]] | None = None) -> dict:
    """Write ``out_file``, the int8 model of ``in_file`` in ``mode``; return the settings for the card."""
    import onnx
    from onnxruntime.quantization import (CalibrationMethod, QuantFormat, QuantType, quantize_dynamic,
                                          quantize_static)

    if mode not in MODES:
        raise ValueError(f"int8 mode {mode!r}: one of {list(MODES)}")
    keep = list(keep_fp32)
    settings = {"mode": mode, "weight_type": "QInt8", "per_channel": mode != "dynamic", "reduce_range": False,
                "op_types": OP_TYPES, "source": Path(in_file).name, "kept_fp32": keep}
    if mode == "static":
        if not calibration:
            raise ValueError("static int8 needs calibration inputs")
        settings.update(format="QDQ", activation_type="QInt8", calibrate_method="MinMax",
                        calibration_examples=sum(len(f["input_ids"]) for f in calibration), op_types=["MatMul"])
        names = {i.name for i in onnx.load(str(in_file), load_external_data=False).graph.input}
        feeds = [{k: v for k, v in f.items() if k in names} for f in calibration]  # ModernBERT: no token types
        quantize_static(str(in_file), str(out_file), FeedReader(feeds), quant_format=QuantFormat.QDQ,
                        op_types_to_quantize=["MatMul"], per_channel=True, reduce_range=False,
                        activation_type=QuantType.QInt8, weight_type=QuantType.QInt8, nodes_to_exclude=keep,
                        calibrate_method=CalibrationMethod.MinMax, extra_options={"MatMulConstBOnly": True})
        return settings
    quantize_dynamic(str(in_file), str(out_file), weight_type=QuantType.QInt8, per_channel=mode != "dynamic",
                     reduce_range=False, op_types_to_quantize=OP_TYPES, nodes_to_exclude=keep,
                     # fused com.microsoft ops have no ONNX shape inference; their outputs are float
                     extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
    return settings
