"""INT8 QDQ artifacts for TensorRT (and the TensorRT EP): static quantization with explicit Q/DQ nodes.

``--precision int8-qdq`` writes ``NAME.int8-qdq.onnx`` next to the dense model and every budget:
``onnxruntime.quantization.quantize_static`` in QDQ format, calibrated on the calibration data of
the main job (the ranking's: same ``--calib``, ``--calib-size``, ``--batch-size``, ``--seed``). This
is *explicit* quantization, the only int8 form TensorRT 10 (``BuilderFlag.INT8`` with Q/DQ layers)
and TensorRT 11 (strongly typed only: no INT8 flag, no calibrator) both build; onnxruntime's CPU EP
runs the same file, so it is checked here.

Settings (``QDQ_SETTINGS``; measured on all-MiniLM-L6-v2 by ``benchmarks/int8_qdq_settings.py``,
``benchmarks/results/int8_qdq_settings.md``):

* int8 weights (``QInt8``), symmetric, **per output channel** (MatMul axis 1): one scale per column;
* int8 activations (``QInt8``), **symmetric** (``ActivationSymmetric``: zero point 0, as TensorRT
  requires), one scale per tensor from MinMax ranges over the calibration samples;
* Q/DQ on the **inputs of the weight MatMuls / Gemms** only (Q, K, V, attention output, MLP up /
  gate); their outputs are not quantized (``OpTypesToExcludeOutputQuantization``), so
  LayerNormalization, Softmax, GELU and the residual Adds see fp32, as TensorRT's placement
  recommendations ask (quantize the inputs of weighted ops, let the builder fuse the rest);
* fp32: the attention score / value MatMuls (activation x activation), the **MLP down projections**
  (the neurons' consumer MatMuls of the unit map: their GELU inputs have the widest ranges) and the
  tail after the last LayerNormalization (pooling, projection / pooler head, the final
  normalisation), as in :mod:`elastic_export.precision.fp16`.

  Measured on MiniLM dense (worst / mean embedding cosine vs fp32 on 64 held-out calibration
  samples): every MatMul int8 0.888 / 0.974; weight MatMuls only 0.939 / 0.977; and the down
  projections fp32 too 0.974 / 0.989 (these settings). Percentile (99.999) ranges on the same
  settings: 0.979 / 0.989, no better on the mean, and onnxruntime's histogram calibrator keeps every
  output of every sample in memory at one (padded) shape, so MinMax it is. On the CPU EP (AVX2,
  no VNNI) the files are not faster than fp32 (the point is TensorRT): ``int8`` is the CPU choice.

Held-out check: every 4th calibration sample (:data:`HELDOUT_EVERY`) is held out of the
calibration reader; the file's embedding (:func:`elastic_export.checks.compare.embedding`) must have cosine
>= :data:`QDQ_MIN_COSINE` to its own fp32 file's on every held-out sample. ``verify`` has no
calibration data and re-checks on its own random inputs with the same bound.

No elastic twin: see :data:`NO_ELASTIC`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from elastic_export.checks.compare import QDQ_MIN_COSINE  # noqa: F401 - int8-qdq's bound
from elastic_export.core import onnx_io
from elastic_export.core.errors import UserError, first_line

PRECISION = "int8-qdq"  # its manifest fields: core.precisions.FILE_KEYS[PRECISION], ERROR_KEYS[PRECISION]
MANIFEST_ENTRY = "int8_qdq"  # top-level manifest entry: settings, bound, calibration data
HELDOUT_EVERY = 4
CALIBRATE_METHOD = "MinMax"
QDQ_SETTINGS = {"format": "QDQ", "per_channel": True, "activation_type": "QInt8", "weight_type": "QInt8",
                "activation_symmetric": True, "weight_symmetric": True, "calibrate_method": CALIBRATE_METHOD,
                "op_types": ["MatMul", "Gemm"], "weight_matmuls_only": True, "mlp_down_projection": "fp32",
                "outputs_quantized": False, "fp32_tail": True}
NO_ELASTIC = ("the elastic graph slices weights at run time (budget_index -> Gather -> Slice), so per-channel "
              "weight scales would have to be sliced with the columns at run time too, and TensorRT needs Q/DQ "
              "scales that are build-time constants; one static activation scale would also have to serve every "
              "budget")


def qdq_name(fp32_name: str) -> str:
    """``budget_s010.onnx`` -> ``budget_s010.int8-qdq.onnx``."""
    stem = fp32_name[:-5] if fp32_name.endswith(".onnx") else fp32_name
    return f"{stem}.{PRECISION}.onnx"


@dataclass
class QdqData:
    """Calibration feeds (numpy) for the quantizer and held-out feeds for the check.

    Args:
        calib: batches fed to the calibration reader.
        heldout: batches of the held-out samples (every :data:`HELDOUT_EVERY`-th).
        description: where they came from (the calibration description plus the split).
    """

    calib: list[dict[str, np.ndarray]]
    heldout: list[dict[str, np.ndarray]]
    description: dict = field(default_factory=dict)


def split_heldout(batches: Sequence[dict[str, Any]], description: dict | None = None,
                  every: int = HELDOUT_EVERY) -> QdqData:
    """Split calibration batches by sample: sample ``i`` (counted across batches) is held out when
    ``i % every == every - 1``; batches keep their padding.

    Raises:
        UserError: fewer than 2 samples (nothing left to hold out), one line.
    """
    calib, heldout = [], []
    start = 0
    for batch in batches:
        arrays = {k: np.asarray(v.numpy() if hasattr(v, "numpy") else v) for k, v in batch.items()}
        n = len(next(iter(arrays.values())))
        out = (np.arange(start, start + n) % every) == every - 1
        start += n
        for dest, rows in ((calib, ~out), (heldout, out)):
            if rows.any():
                dest.append({k: v[rows] for k, v in arrays.items()})
    if not heldout or not calib:
        raise UserError(f"--precision {PRECISION}: needs at least {every} calibration samples (every {every}th is held "
                        f"out to check the quantized files), got {start}; raise --calib-size")
    desc = {**(description or {}), "calibration_samples": start - sum(len(next(iter(b.values()))) for b in heldout),
            "heldout_samples": sum(len(next(iter(b.values()))) for b in heldout), "heldout": f"every {every}th sample"}
    return QdqData(calib, heldout, desc)


def manifest_entry(data: QdqData) -> dict:
    """The top-level manifest entry: what every ``*.int8-qdq.onnx`` was calibrated and checked on."""
    return {"settings": dict(QDQ_SETTINGS), "min_cosine_bound": QDQ_MIN_COSINE, "calibration": data.description,
            "elastic": None, "why_no_elastic": NO_ELASTIC}


def _reader(batches: list[dict[str, np.ndarray]], names: list[str]):
    """A ``CalibrationDataReader`` over ``batches`` (restricted to the model's inputs ``names``)."""
    from onnxruntime.quantization import CalibrationDataReader

    class FeedReader(CalibrationDataReader):
        def __init__(self) -> None:
            self._it = iter([{k: v for k, v in b.items() if k in names} for b in batches])

        def get_next(self):
            return next(self._it, None)

    return FeedReader()


def _excluded(model, const_b_only: bool, fp32_down: bool) -> list[str]:
    """Names of the nodes left fp32: the tail after the last LayerNormalization; with ``const_b_only``
    the MatMuls whose second input is not a weight (attention scores and values); with ``fp32_down``
    the MLP down projections (the neurons' consumer MatMuls of the unit map). Names every node first."""
    from elastic_export.core.unit_map import UNITS_KEY, get_units
    from elastic_export.precision.fp16 import fp32_tail, name_nodes

    name_nodes(model)
    inits = {i.name for i in model.graph.initializer}
    out = fp32_tail(model)
    out |= {n.name for n in model.graph.node if const_b_only and n.op_type == "MatMul" and n.input[1] not in inits}
    if fp32_down and any(p.key == UNITS_KEY for p in model.metadata_props):
        out |= {(layer.get("neurons") or {}).get("consumer", {}).get("matmul") for layer in get_units(model)} - {None}
    return sorted(out)


def _uniform(batches: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """One sample per batch, every input zero-padded to the largest shape (the histogram calibrators
    stack all batches, so they need one shape; zero is the padding id and mask value)."""
    rows = [{k: v[i:i + 1] for k, v in b.items()} for b in batches for i in range(len(next(iter(b.values()))))]
    shapes = {k: np.max([r[k].shape for r in rows], axis=0) for k in rows[0]}
    return [{k: np.pad(v, [(0, int(s) - d) for s, d in zip(shapes[k], v.shape)]) for k, v in r.items()} for r in rows]


def quantize_qdq(src: str | Path, dst: str | Path, batches: list[dict[str, np.ndarray]],
                 method: str = CALIBRATE_METHOD, const_b_only: bool = True, fp32_down: bool = True) -> None:
    """Static QDQ int8 quantization of the ONNX file ``src`` into ``dst`` (:data:`QDQ_SETTINGS`),
    calibrated on ``batches`` (``method``: ``MinMax`` or ``Percentile``; ``const_b_only`` and
    ``fp32_down``: see :func:`_excluded`; both on in :data:`QDQ_SETTINGS`).

    Raises:
        UserError: the quantizer failed (e.g. an op it cannot handle), one line.
    """
    import onnx
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    from elastic_export.precision.int8 import quiet_quantizer

    model = onnx.load(str(src))
    names = [i.name for i in model.graph.input]
    extra = {"ActivationSymmetric": True, "WeightSymmetric": True,
             "OpTypesToExcludeOutputQuantization": list(QDQ_SETTINGS["op_types"])}
    if method != "MinMax":
        batches = _uniform(batches)
    try:
        with quiet_quantizer():
            quantize_static(model, str(dst), _reader(batches, names), quant_format=QuantFormat.QDQ,
                            op_types_to_quantize=list(QDQ_SETTINGS["op_types"]), per_channel=True,
                            activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                            nodes_to_exclude=_excluded(model, const_b_only, fp32_down),
                            calibrate_method=getattr(CalibrationMethod, method),
                            use_external_data_format=bool(onnx_io.external_like(src)), extra_options=extra)
    except Exception as e:  # the quantizer's / calibrator's own errors
        raise UserError(f"{Path(src).name}: {PRECISION} quantization failed ({first_line(e)})") from e


def batch_min_cosine(ref, sess, batch: dict[str, np.ndarray]) -> float:
    """Smallest embedding cosine between two onnxruntime sessions on the rows of one calibration
    ``batch`` (the entries the models take as inputs)."""
    from elastic_export.precision.int8 import session_min_cosine

    names = {i.name for i in ref.get_inputs()}
    return session_min_cosine(ref, sess, {k: v for k, v in batch.items() if k in names})


def batches_min_cosine(ref, sess, batches: Sequence[dict[str, np.ndarray]]) -> float:
    """Smallest embedding cosine between two onnxruntime sessions over every row of ``batches``."""
    return min(batch_min_cosine(ref, sess, b) for b in batches)


def add_qdq(directory: str | Path, fp32_name: str, data: QdqData, check: bool = True,
            bound: float = QDQ_MIN_COSINE) -> tuple[str, float | None]:
    """Write the QDQ twin of ``directory/fp32_name`` calibrated on ``data.calib`` and, with ``check``,
    check it against the fp32 file on ``data.heldout``.

    Returns:
        (file name, min embedding cosine vs fp32 on the held-out samples, or None unchecked).

    Raises:
        RuntimeError: the min cosine is below ``bound`` (names the file).
    """
    from elastic_export.checks.compare import twin_scores

    directory = Path(directory)
    name = qdq_name(fp32_name)
    onnx_io.write_via_scratch(directory, name, lambda dst: quantize_qdq(directory / fp32_name, dst, data.calib))
    if not check:
        return name, None
    cos = min(twin_scores(directory, fp32_name, name, data.heldout, batch_min_cosine))
    if not cos >= bound:
        raise RuntimeError(f"{name}: {PRECISION} embedding cosine vs {fp32_name} on held-out calibration samples is "
                           f"{cos:.4f}, below {bound:g}")
    return name, cos
