"""The errors of the KV transfer layer: the user-fixable ones are :class:`~omforge.errors.OmforgeError` (one line
naming the field), the ones a peer or the network causes are :class:`KVTransferError`."""

from __future__ import annotations

from omforge.errors import OmforgeError


class KVTransferConfigError(OmforgeError):
    """``--kv-transfer-config`` is not JSON, names an unknown field, or a field holds a value omforge refuses."""


class KVTransferParamsError(OmforgeError):
    """A request's ``kv_transfer_params`` is malformed (the server answers 400 with this line)."""


class KVLayoutMismatch(OmforgeError):
    """The peer's KV pools are laid out differently (block size, KV dtype, layers, KV heads, row elements):
    its blocks cannot be copied byte for byte into ours."""


class ClusterExtraMissing(OmforgeError):
    """NIXL is not installed: PD disaggregation needs the ``cluster`` extra."""


class KVTransferError(RuntimeError):
    """A handshake or a block transfer with a peer failed or timed out.

    ``handle_released`` is False only when NIXL refused to release (cancel) an in-flight READ: then the local
    destination blocks may still be written by the backend and must not be freed or reused until
    :meth:`~omforge.runtime.kv_transfer.nixl_agent.NixlKVAgent.close` (vLLM keeps such blocks too:
    ``_try_release_xfer_handle`` in ``nixl/base_worker.py``, vLLM 0.33.0, lines 3454-3467)."""

    def __init__(self, message: str, *, handle_released: bool = True):
        super().__init__(message)
        self.handle_released = handle_released


class KVTransferTimeout(KVTransferError):
    """A transfer or handshake did not finish within its bound."""
