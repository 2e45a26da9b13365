"""uvicorn's h11 protocol with a deadline for a request's headers.

uvicorn times out an idle keep-alive connection, but any byte cancels that timer and nothing bounds the time a
request's headers take: 200 connections trickling a header line now and then held the server's sockets for as
long as the clients liked. Here each connection must deliver a request's complete headers within
``header_timeout`` seconds of opening, and of finishing the previous response; past it the connection is closed
(nginx's ``client_header_timeout``, Apache's ``RequestReadTimeout header=``). The body has its own bound
(serve/body.py, a 408).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

DEFAULT_HEADER_TIMEOUT_S = 10.0


def with_header_timeout(seconds: float) -> type[H11Protocol]:
    """An :class:`H11Protocol` subclass that closes a connection whose request headers are not all in within
    ``seconds`` (pass it as ``uvicorn.Config(http=…)``)."""

    class HeaderTimeoutProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _waiting_after: Any = None  # the cycle that was current when the timer was armed

        def _arm(self, after: Any) -> None:
            self._disarm()
            self._waiting_after = after
            self._header_timer = self.loop.call_later(seconds, self._headers_late)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if self.cycle is self._waiting_after and not self.transport.is_closing():
                self.transport.close()  # no request is in progress on it: nothing to answer

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm(self.cycle)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._header_timer is not None and self.cycle is not self._waiting_after:
                self._disarm()  # a new request's headers are complete: its cycle has begun

        def on_response_complete(self) -> None:
            finished = self.cycle
            super().on_response_complete()  # may start a pipelined request's cycle at once
            if not self.transport.is_closing() and self.cycle is finished:
                self._arm(finished)  # the next request's headers

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol
