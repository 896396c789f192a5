"""INT8 artifacts for the CPU: onnxruntime dynamic quantization of an fp32 ONNX model.

``onnxruntime.quantization.quantize_dynamic`` stores the weight of every MatMul / Gemm whose
weight is a constant initializer as int8 (with its scale and zero point) and quantizes the
activations at run time (``DynamicQuantizeLinear`` -> ``MatMulInteger`` / ``DynamicQuantizeMatMul``).
Norms, softmax, GELU, pooling and the I/O stay fp32, so an int8 file takes the same feeds and gives
the same output types as its fp32 file.

Settings, chosen by measurement (``benchmarks/int8_settings.py``, results in
``benchmarks/results/int8_settings.{json,md}``) on all-MiniLM-L6-v2, dense and one budget, on this
CPU (x86-64 with AVX2 and no VNNI; onnxruntime CPU EP, 2 threads, batch 8):

* **per_channel = True**: one scale per output column of each weight. Per-tensor scales lose too
  much: the min embedding cosine vs fp32 on 64 held-out texts is 0.919 (dense) / 0.969 (budget 0.5)
  per-tensor against 0.989 / 0.991 per-channel, at no measurable speed cost.
* **reduce_range = False**: full 8-bit weights. The 7-bit range (meant to avoid int16 saturation of
  the u8s8 kernels on CPUs without VNNI) was as fast within the noise of a shared machine and less
  accurate: 0.987 / 0.989 per-channel, 0.730 / 0.901 per-tensor.
* **weight_type = QInt8** (signed weights, the onnxruntime default for u8 activations);
  ``MatMulConstBOnly`` (the dynamic default): activation x activation MatMuls (attention scores)
  stay fp32. The token embedding table (a ``Gather``) stays fp32, so files shrink by about a third,
  not by 4x (MiniLM dense 90 -> 59 MB).

Every int8 file is checked against its own fp32 file on sample inputs: the cosine between the
embedding outputs (:func:`embedding`) of the two must be at least :data:`INT8_MIN_COSINE` for every
input. The bound is 0.95, from two measurements on MiniLM with these settings: on real held-out text
the minimum is 0.989 (dense) / 0.991 (budget 0.5); on the check inputs, which are random token ids
(the main job: batch 2 x 128 tokens; ``verify``: 2 x 32), it is 0.974 for the dense model at 128
tokens and 0.989 or more for every budget 0.1..0.6 and for ``verify``'s inputs
(``benchmarks/int8_check_inputs.py``, results in ``benchmarks/results/int8_check_inputs.md``).
0.95 leaves margin for other random inputs while a broken quantization still fails (per-tensor
7-bit weights: 0.73 on real text). Tiny random-weight test models are less regular: their dense
int8 files range from 0.91 (a CLIP text tower) to 0.99998, so ``--precision int8`` can fail the
check on such a model (a ``RuntimeError`` naming the file, nothing written).
Excluding the MLP down-projections from quantization raised the dense minimum
to 0.993 in a side measurement; it is not done (a third of the MatMul FLOPs would stay fp32).

Only the per-budget files (and the dense model) are quantized: the elastic graph slices every
weight whose width differs between budgets at run time (``budget_index`` -> ``Gather`` of a table ->
``Slice`` of the weight), so those MatMuls have no constant initializer weight and dynamic
quantization would leave them fp32 (only sub-blocks of equal width at every budget would be int8).
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Sequence

import numpy as np

from elastic_export.checks.compare import INT8_MIN_COSINE, embedding, min_cosine  # noqa: F401 - int8's bound
from elastic_export.core import onnx_io
from elastic_export.core.errors import UserError, first_line
from elastic_export.core.precisions import PRECISIONS

INT8_SETTINGS = {"per_channel": True, "reduce_range": False, "weight_type": "QInt8", "op_types": ["MatMul", "Gemm"]}


def int8_name(fp32_name: str) -> str:
    """File name of the int8 twin of an fp32 ONNX file: ``budget_s010.onnx`` -> ``budget_s010.int8.onnx``."""
    return fp32_name[:-5] + ".int8.onnx" if fp32_name.endswith(".onnx") else fp32_name + ".int8.onnx"


def parse_precisions(value: str | Sequence[str]) -> tuple[str, ...]:
    """``"fp32,int8"`` -> ``("fp32", "int8")``: fp32 always first, each once, unknown names refused.

    Raises:
        UserError: an unknown precision (one line).
    """
    items = [p.strip() for p in (value.split(",") if isinstance(value, str) else value)]
    bad = [p for p in items if p not in PRECISIONS]
    if bad or not any(items):
        what = f"unknown precision {bad[0]!r}" if bad else "no precision given"
        raise UserError(f"--precision {','.join(items)}: {what}; choose a comma list of {', '.join(PRECISIONS)}")
    return tuple(p for p in PRECISIONS if p == "fp32" or p in items)


@contextlib.contextmanager
def quiet_quantizer():
    """Drop onnxruntime.quantization's advice to pre-process the model (a root-logger warning per
    file; the exported graphs are already shape-inferred and constant-folded)."""
    def keep(record: logging.LogRecord) -> bool:
        return "pre-processing before quantization" not in record.getMessage()

    root = logging.getLogger()
    root.addFilter(keep)
    try:
        yield
    finally:
        root.removeFilter(keep)


def quantize(src: str | Path, dst: str | Path, per_channel: bool = True, reduce_range: bool = False) -> None:
    """Dynamic int8 quantization of the ONNX file ``src`` (MatMul / Gemm weights) into ``dst``
    (weights in ``dst.data`` when ``src`` has external data, as :mod:`elastic_export.core.onnx_io` names it)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    try:
        with quiet_quantizer():
            quantize_dynamic(str(src), str(dst), op_types_to_quantize=INT8_SETTINGS["op_types"],
                             per_channel=per_channel, reduce_range=reduce_range, weight_type=QuantType.QInt8,
                             use_external_data_format=bool(onnx_io.external_like(src)))
    except Exception as e:  # the quantizer's own errors on ops it cannot handle
        raise UserError(f"{Path(src).name}: int8 quantization failed ({first_line(e)})") from e


def session_min_cosine(ref, sess, feeds: dict[str, np.ndarray]) -> float:
    """:func:`min_cosine` of the embeddings of two onnxruntime sessions on ``feeds``."""
    names = [o.name for o in ref.get_outputs()]
    mask = feeds.get("attention_mask")
    want = embedding(names, ref.run(names, feeds), mask)
    got = embedding(names, sess.run(names, feeds), mask)
    return min_cosine(want, got)


def add_int8(directory: str | Path, fp32_name: str, feeds: dict[str, np.ndarray] | None = None,
             bound: float = INT8_MIN_COSINE) -> tuple[str, float | None]:
    """Write the int8 twin of ``directory/fp32_name`` and, given ``feeds``, check it against the fp32 file.

    Returns:
        (int8 file name, min embedding cosine vs fp32 or None when not checked).

    Raises:
        RuntimeError: the min cosine is below ``bound`` (names the file).
    """
    from elastic_export.checks.compare import twin_scores

    directory = Path(directory)
    name = int8_name(fp32_name)
    onnx_io.write_via_scratch(directory, name, lambda dst: quantize(
        directory / fp32_name, dst, INT8_SETTINGS["per_channel"], INT8_SETTINGS["reduce_range"]))
    if feeds is None:
        return name, None
    cos = min(twin_scores(directory, fp32_name, name, [feeds], session_min_cosine))
    if not cos >= bound:
        raise RuntimeError(f"{name}: int8 embedding cosine vs {fp32_name} is {cos:.4f}, below {bound:g}")
    return name, cos
