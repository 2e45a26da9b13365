"""The ort target's executor (ort_executor.py) and omforge's ONNX Runtime custom-op library (kernels/)."""
