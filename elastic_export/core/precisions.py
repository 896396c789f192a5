"""The precisions an artifact directory can hold: one list, and the manifest field of each one's files.

* ``fp32``: the reference files (``dense.onnx``, ``budget_sXXX.onnx``, ``elastic.onnx``);
* ``fp16``: fp16 twins with explicit Casts (:mod:`elastic_export.precision.fp16`; GPU, TensorRT strongly typed);
* ``int8``: CPU int8 twins, dynamic quantization (:mod:`elastic_export.precision.int8`);
* ``int8-qdq``: int8 twins with explicit Q/DQ nodes from static, calibrated quantization
  (:mod:`elastic_export.precision.int8_qdq`; TensorRT and the TensorRT EP; the CPU EP runs them too).

The order is the default quality order (best first) where no measured quality figure says otherwise.
"""

from __future__ import annotations

PRECISIONS = ("fp32", "fp16", "int8", "int8-qdq")
FILE_KEYS = {"fp32": "onnx", "fp16": "onnx_fp16", "int8": "onnx_int8", "int8-qdq": "onnx_int8_qdq"}
"""Precision -> manifest field (per budget and in ``dense``) naming its file."""
ERROR_KEYS = {"fp16": "fp16_max_rel_error", "int8": "int8_min_cosine", "int8-qdq": "int8_qdq_min_cosine"}
"""Twin precision -> manifest field (next to its file) of its measured error against the fp32 file:
the largest relative error (fp16), the smallest embedding cosine (int8, int8-qdq)."""
