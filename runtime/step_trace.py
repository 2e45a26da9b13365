"""The engine's per-step trace: ``OMFORGE_STEP_TRACE=FILE`` appends one JSON line per model step — when it began
(``time.monotonic()`` seconds), how long the whole step took and how much of it was the model run, the prefill and
decode tokens it carried, and the sequences running and waiting after it. A serving tail reads off it: a long step
is every running stream's inter-token gap (benchmarks/RESULTS.md, issue 48 item 5). Off unless the variable is
set; when on, one buffered line per step."""

from __future__ import annotations

import atexit
import json
import os
from typing import TextIO

ENV = "OMFORGE_STEP_TRACE"


class StepTrace:
    """An open trace file; :meth:`record` one step, :meth:`close` at the engine's close."""

    def __init__(self, path: str) -> None:
        self._file: TextIO | None = open(path, "a", buffering=1 << 16)
        atexit.register(self.close)  # an engine nobody closes (the offline API's) still leaves its whole trace

    @classmethod
    def from_env(cls) -> StepTrace | None:
        path = os.environ.get(ENV)
        return cls(path) if path else None

    def record(self, start: float, seconds: float, model_seconds: float, prefill_tokens: int, decode_tokens: int,
               running: int, waiting: int) -> None:
        if self._file is not None:
            line = {"t": round(start, 6), "s": round(seconds, 6), "model_s": round(model_seconds, 6),
                    "prefill": prefill_tokens, "decode": decode_tokens, "running": running, "waiting": waiting}
            self._file.write(json.dumps(line) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
