"""Graceful shutdown of `kvcache serve` on SIGTERM or SIGINT (a rolling deploy, a supervisor, Ctrl-C).

The first signal starts a drain; the listening socket stays open while it runs:
1. new requests get 503 with Retry-After, and GET /health answers 503, so a load balancer takes the instance out;
2. the requests already taken run on for up to `--shutdown-timeout` seconds;
3. those still open then are aborted: a stream ends with an error event naming the shutdown and `data: [DONE]`, a
   whole response is a 503 in OpenAI's error shape;
4. uvicorn closes the connections, giving responses FLUSH_S seconds to finish sending (a client that never reads its
   stream cannot hold the shutdown longer);
5. `kvcache serve` stops the engine loop and closes the engine (the offload tiers' writer, the last KV events) and
   exits 0.
Each phase logs one line. A second signal exits at once with SECOND_SIGNAL_STATUS.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import uvicorn

from kvcache.server.engine_loop import EngineLoop

log = logging.getLogger("kvcache.server")
SECOND_SIGNAL_STATUS = 130  # 128 + SIGINT, what a shell reports for an interrupted command
FLUSH_S = 3.0  # after the drain: seconds uvicorn gives open responses to finish sending before it cancels them
POLL_S = 0.05


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain on the first SIGTERM or SIGINT instead of its own shutdown (which closes the
    listening socket at once and cancels whatever is still streaming after its timeout)."""

    def __init__(self, config: uvicorn.Config, loop: EngineLoop, shutdown_timeout_s: float) -> None:
        config.timeout_graceful_shutdown = FLUSH_S
        super().__init__(config)
        self.engine_loop = loop
        self.shutdown_timeout_s = shutdown_timeout_s
        self.signals = 0
        self.drained_by: str | None = None  # the signal that started the drain
        self._aio: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._aio = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        """uvicorn's signal handler (main thread, between bytecodes): start the drain on the event loop, or exit
        at once on a second signal. The signal is not re-raised after the shutdown, as uvicorn would."""
        self.signals += 1
        name = signal.Signals(sig).name
        if self.signals > 1:
            log.warning("%s again: exiting now, without finishing the drain (status %d)", name, SECOND_SIGNAL_STATUS)
            logging.shutdown()
            os._exit(SECOND_SIGNAL_STATUS)
        self.drained_by = name
        if self._aio is None or self._aio.is_closed():  # not serving yet, or no more: nothing to drain
            log.info("%s: stopping", name)
            self.should_exit = True
            return
        self._aio.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain = asyncio.ensure_future(self.drain())

    async def drain(self) -> None:
        """drain_engine, then let uvicorn shut down (whatever happened in the drain)."""
        try:
            await drain_engine(self.engine_loop, self.shutdown_timeout_s, self.drained_by)
        finally:
            self.should_exit = True

    def install_signals(self) -> None:
        """Make handle_exit the handler of SIGTERM and SIGINT from now to the process's end: uvicorn installs it
        only while it serves, then puts back what was there before, which is then this one (a signal before uvicorn
        starts stops it at once; one while the engine closes after it lets the close finish; a second exits)."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self.handle_exit)


async def drain_engine(loop: EngineLoop, timeout_s: float, why: str) -> int:
    """Refuse new requests, wait for the open ones up to `timeout_s`, then abort the rest (each one's handler gets
    ServerShuttingDown) and give them FLUSH_S to go. Returns the number aborted. Logs one line per phase."""
    loop.begin_drain()
    log.info("%s: draining %d open requests for up to %g s (--shutdown-timeout); new requests get 503", why,
             loop.num_open, timeout_s)
    if await _wait_until_closed(loop, time.monotonic() + timeout_s):
        log.info("drained: every open request finished")
        return 0
    left = loop.num_open
    log.warning("the %g s shutdown timeout passed: aborting the %d requests still open", timeout_s, left)
    loop.abort_all(f"the server is shutting down and aborted this request at the end of its {timeout_s:g} s drain")
    await _wait_until_closed(loop, time.monotonic() + FLUSH_S)
    return left


async def _wait_until_closed(loop: EngineLoop, deadline: float) -> bool:
    """Wait until `loop` has no open request (True), its thread has stopped, or `deadline` passes (False)."""
    while loop.num_open and loop.running and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
    return not loop.num_open or not loop.running
