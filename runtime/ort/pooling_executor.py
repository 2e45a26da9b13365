"""The ONNX Runtime executor of a pooling bundle's step graph (contract/pooling.py): no KV pool, one output.

One session, the kernel library registered when usable (the graph's weight MatMuls may be its ``MatMulF32``); the
inputs are numpy arrays, passed as they are. Nothing is kept between runs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from omforge.runtime.ort import kernels
from omforge.runtime.ort.ort_executor import release_freed_heap


class PoolingExecutor:
    """``run(inputs)`` → the ``output`` rows ``[num_seqs, width]`` for one packed batch
    (:func:`omforge.runtime.pooling.pack`)."""

    def __init__(self, model_path: Path, output: str, threads: int | None = None):
        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = threads
        if kernels.status().available:
            kernels.register(opts)
        self.session = ort.InferenceSession(str(model_path), opts, providers=["CPUExecutionProvider"])
        release_freed_heap()
        self.output = output

    def run(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        return self.session.run([self.output], inputs)[0]
