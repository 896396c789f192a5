"""Reduced-precision twins of each fp32 file: fp16, int8 (dynamic), int8-qdq (static), onnxruntime graph optimisation."""
