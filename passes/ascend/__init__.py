"""The Ascend lowering: neutral ops → what ATC's ONNX parser maps (:mod:`.lower`), the per-SoC kernel table it
consults (:mod:`.kernels`) and weight-only int8 matmuls (:mod:`.w8a16`)."""
