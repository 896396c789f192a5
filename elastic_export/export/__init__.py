"""The dense ONNX export with its unit map (the graph passes live in elastic_export.passes)."""
