"""Contracts every stage shares: errors, file output, ONNX I/O, the manifest, precision names, the unit
map, budgets, the latency profile file.
"""
