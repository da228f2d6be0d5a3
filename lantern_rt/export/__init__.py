"""torch -> ONNX: the fixed-shape graphs, their lint, and the bundle with its manifest."""
