"""The engine's own thread: HTTP handlers submit and abort through a queue; outputs go back to asyncio.

LLMEngine is not thread-safe, so only this thread touches it. Each step batches every
running request (continuous batching across HTTP requests); each request's outputs are put
on its asyncio queue with `call_soon_threadsafe`. A request the engine fails arrives as a
finished output with its error; the loop carries on. Only when the engine itself gives up
(EngineDeadError: several steps in a row failed with no request to blame) or the thread is
killed does the loop stop: every pending request gets the error, `alive` turns False (GET
/health answers 503) and `on_dead` is called, which `kvcache serve` uses to shut the server
down with a non-zero exit status, so that its supervisor restarts it.
"""
from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvcache.compress.spec import EvictionSpec
from kvcache.engine.llm_engine import EngineDeadError, LLMEngine, RequestOutput
from kvcache.engine.sampling_params import SamplingParams
from kvcache.server import kv_snapshot

log = logging.getLogger("kvcache.server")
__all__ = ["EngineDeadError", "EngineLoop", "EngineRequestError", "ServerShuttingDown"]


class ServerShuttingDown(EngineDeadError):
    """The server is shutting down (a drain, server/drain.py): the request was refused, or aborted at the drain's
    timeout."""


class EngineRequestError(RuntimeError):
    """The engine could not take a request for a reason that is the server's fault, not the client's (the engine
    process could not decode it, say): a 500 naming why."""


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # RequestOutput items, then (request_id, None) when done, or an exception


@dataclass(slots=True)
class _Add:
    """A request for the engine thread to add, and where to tell the handler it was taken."""

    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    add_special_tokens: bool
    cache_salt: str | None
    eviction: EvictionSpec | None
    stream: _Stream
    accepted: asyncio.Future


def small_step_threads(all_threads: int) -> int | None:
    """CPU threads for a server's small steps (ModelRunner.SMALL_STEP_ROWS), from KVCACHE_SMALL_STEP_THREADS (a count;
    0: every thread); None when it is not set: every thread. (One core used to be left to the HTTP frontend; with
    the OpenMP pool no longer throttled, see build_engine, two threads decode one stream faster than one: on this
    2-core machine, TPOT 10 ms against 13 through the server.)"""
    env = os.environ.get("KVCACHE_SMALL_STEP_THREADS")
    if env is None:
        return None
    if not env.isdigit():
        raise ValueError(f"KVCACHE_SMALL_STEP_THREADS must be a number of threads (0: all); got {env!r}")
    return min(int(env), all_threads) or all_threads


def use_small_step_threads(engine: LLMEngine) -> None:
    """A server's engine on a multi-core CPU: its small steps take KVCACHE_SMALL_STEP_THREADS threads (see
    small_step_threads); the engine loop and the engine process both serve through it."""
    runner = engine.runner
    if engine.device.type == "cpu" and runner.all_threads > 1:
        runner.small_step_threads = small_step_threads(runner.all_threads)


def record_step(metrics, outputs: list[RequestOutput], now: float, last_log: float, log_interval_s: float) -> float:
    """A step's metrics, and the periodic log line when `log_interval_s` has passed since `last_log`; returns the
    time of the last log line. A metrics bug is logged, never fatal to serving."""
    try:
        metrics.on_step(outputs, now)
        if now - last_log >= log_interval_s:
            log.info(metrics.log_line())
            return now
    except Exception:
        log.exception("recording the step's metrics failed")
    return last_log


def build_engine(config) -> LLMEngine:
    """LLMEngine(config), built on a thread of its own that ends before serving starts.

    The engine steps on the loop's thread. Had the main thread run OpenMP work while loading (it does: the weights'
    conversions), libgomp would keep its worker pool alive beside the engine thread's, count more OpenMP threads
    than cores, and throttle every worker's spin-wait to ~100 spins: each of a decode step's hundred-odd parallel
    regions would then wake its worker through a futex. Measured on this 2-core machine: an int4 layer call at 16
    rows took 183 us from a second thread against 126 from the first, and the server's 32-prompt throughput fell by
    a third. A thread's pool goes away with the thread, so the loading thread leaves none behind."""
    box: dict = {}

    def build() -> None:
        try:
            box["engine"] = LLMEngine(config)
        except BaseException as e:  # noqa: BLE001 -- re-raised on the caller's thread, with its traceback
            box["error"] = e

    t = threading.Thread(target=build, name="kvcache-load", daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["engine"]


class EngineLoop:
    """Runs `engine.step()` in a thread while requests are unfinished; sleeps on the command queue otherwise."""

    build_snapshot = staticmethod(kv_snapshot.build)  # request_snapshot settles with capture()'s copies

    def __init__(self, engine: LLMEngine, metrics=None, log_interval_s: float = 10.0,
                 on_dead: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.log_interval_s = log_interval_s
        self.on_dead = on_dead  # called from the engine thread once it has failed every pending request
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._thread = threading.Thread(target=self._run, name="kvcache-engine", daemon=True)
        self._stopping = False
        self.draining = False  # set by begin_drain: no request is taken any more, running ones go on
        self._closing = threading.Lock()
        self._closed = False  # set, under _closing, when the thread has failed every pending command
        self.error: BaseException | None = None
        # Each counter has one writer thread, so no lock: pending = submitted - taken.
        self._submitted = 0  # by asyncio handlers
        self._taken = 0  # by the engine thread

    # ---- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        use_small_step_threads(self.engine)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._commands.put(("stop",))
        self._thread.join(timeout)
        runner = self.engine.runner
        if runner.small_step_threads is not None and not self._thread.is_alive():  # the engine used directly again
            runner.small_step_threads = None
            torch.set_num_threads(runner.all_threads)

    @property
    def stopped(self) -> bool:
        """stop() was called, or the thread has ended."""
        return self._stopping or (self._thread.ident is not None and not self._thread.is_alive())

    @property
    def alive(self) -> bool:
        """The loop takes requests: its thread runs, the engine has not died, and it is neither stopping nor draining."""
        return self._thread.is_alive() and self.error is None and not self._stopping and not self.draining

    @property
    def running(self) -> bool:
        """The thread still steps the engine (also while draining)."""
        return self._thread.is_alive() and self.error is None and not self._stopping

    def begin_drain(self) -> None:
        """Take no new request (enqueue raises ServerShuttingDown); the ones taken run on."""
        self.draining = True

    @property
    def num_open(self) -> int:
        """Requests submitted and not yet finished or aborted (read from another thread: a snapshot)."""
        return len(self._streams) + self._submitted - self._taken

    def abort_all(self, message: str) -> None:
        """Abort every open request (a drain's timeout): each one's handler gets ServerShuttingDown(`message`) and its
        blocks are freed before the next step."""
        self._commands.put(("abort_all", message))

    @property
    def num_waiting(self) -> int:
        """Requests queued and not yet running (read from another thread: a snapshot)."""
        return len(self.engine.scheduler.waiting) + self._submitted - self._taken

    @property
    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    # ---- called from asyncio handlers ----------------------------------------------------------------

    def enqueue(self, request_id: str, prompt: str | list[int], params: SamplingParams, add_special_tokens: bool = True,
                cache_salt: str | None = None, out: asyncio.Queue | None = None,
                eviction: EvictionSpec | None = None) -> tuple[asyncio.Queue, asyncio.Future]:
        """Queue a request without waiting (call it on the event loop): returns its output queue (`out`, or a new
        one: each RequestOutput, then (request_id, None) when it is done) and a future that settles once the
        engine has taken it, with the engine's ValueError if the prompt or parameters are bad."""
        loop = asyncio.get_running_loop()
        accepted = loop.create_future()
        stream = _Stream(loop, out if out is not None else asyncio.Queue())
        with self._closing:  # never queue a command after the dying thread has drained the queue
            if self.draining:
                raise ServerShuttingDown("the server is shutting down")
            if self._closed or not self.alive:
                raise EngineDeadError("the engine loop is not running")
            self._submitted += 1
            self._commands.put(_Add(request_id, prompt, params, add_special_tokens, cache_salt, eviction, stream,
                                    accepted))
        return stream.queue, accepted

    async def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                     add_special_tokens: bool = True, cache_salt: str | None = None,
                     out: asyncio.Queue | None = None, eviction: EvictionSpec | None = None) -> asyncio.Queue:
        """`enqueue`, then wait until the engine has taken the request; raises what add_request raised."""
        queue_, accepted = self.enqueue(request_id, prompt, params, add_special_tokens, cache_salt, out, eviction)
        await accepted
        return queue_

    def abort(self, request_id: str) -> None:
        """Abort a request (the client went away); its blocks are freed before the next step."""
        self._commands.put(("abort", request_id))

    def request_snapshot(self, future: asyncio.Future, loop: asyncio.AbstractEventLoop, show_text: bool) -> None:
        """Have the engine thread capture a KV snapshot (server/kv_snapshot.py) between steps and settle `future`
        with its copies (with EngineDeadError if the loop is not running)."""
        with self._closing:
            if self._closed or not self.alive:
                loop.call_soon_threadsafe(_settle, future, EngineDeadError("the engine loop is not running"))
                return
            self._commands.put(("snapshot", future, loop, show_text))

    # ---- the engine thread ----------------------------------------------------------------------------

    def _handle(self, cmd: _Add | tuple) -> None:
        if isinstance(cmd, _Add):
            # open in _streams before it leaves the queue's count: num_open never misses it (a drain reads it)
            self._streams[cmd.request_id] = cmd.stream
            self._taken += 1
            try:
                self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, stream=True,
                                        add_special_tokens=cmd.add_special_tokens, cache_salt=cmd.cache_salt,
                                        eviction=cmd.eviction)
            except Exception as e:  # noqa: BLE001 -- the handler turns it into an HTTP error
                del self._streams[cmd.request_id]
                _call(cmd.stream.loop, _settle, cmd.accepted, e)
                return
            _call(cmd.stream.loop, _settle, cmd.accepted, None)
        elif cmd[0] == "snapshot":
            _, future, loop, show_text = cmd
            try:
                snap, error = kv_snapshot.capture(self.engine, show_text), None
            except Exception as e:  # a page must not take the engine down: the viewer gets the error
                log.exception("taking the KV snapshot failed")
                snap, error = None, e
            _call(loop, _settle, future, error, snap)
        elif cmd[0] == "abort":
            stream = self._abort(cmd[1])
            if stream:
                _post(stream, (cmd[1], None))
        elif cmd[0] == "abort_all":
            for rid in list(self._streams):
                _post(self._abort(rid), ServerShuttingDown(cmd[1]))

    def _abort(self, rid: str) -> _Stream | None:
        """Abort `rid` in the engine and forget its stream (returned, None if it had none)."""
        if self.engine.abort_request(rid) and self.metrics:
            self.metrics.on_abort(rid)
        return self._streams.pop(rid, None)

    def _run(self) -> None:
        last_log = time.monotonic()
        try:
            while not self._stopping:
                # Idle: sleep until a command comes. Busy: take what is queued and step.
                block = not self.engine.has_unfinished_requests()
                try:
                    while True:
                        cmd = self._commands.get(block=block)
                        block = False
                        if cmd != ("stop",):
                            self._handle(cmd)
                except queue.Empty:
                    pass
                if self._stopping or not self.engine.has_unfinished_requests():
                    continue
                outputs = self.engine.step()
                now = time.monotonic()
                for out in outputs:
                    self._deliver(out)
                if self.metrics:
                    last_log = record_step(self.metrics, outputs, now, last_log, self.log_interval_s)
        except BaseException as e:
            self.error = e
            log.exception("the engine loop stopped")
        finally:
            self._fail_all(self.error or ServerShuttingDown("the server is shutting down"))
            if self.error is not None and self.on_dead is not None:
                self.on_dead()

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        _post(stream, out)
        if out.finished:
            del self._streams[out.request_id]
            _post(stream, (out.request_id, None))

    def _fail_all(self, error: BaseException) -> None:
        with self._closing:
            self._closed = True
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add):
                _call(cmd.stream.loop, _settle, cmd.accepted, _dead(error))
            elif cmd[0] == "snapshot":
                _call(cmd[2], _settle, cmd[1], _dead(error))
        for stream in self._streams.values():
            _post(stream, _dead(error))
        self._streams.clear()


def _dead(error: BaseException) -> EngineDeadError:
    """What a pending request gets when the loop ends with `error`: a shutdown stays a shutdown."""
    return ServerShuttingDown(str(error)) if isinstance(error, ServerShuttingDown) else EngineDeadError(str(error))


def _call(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    """`fn(*args)` on the asyncio `loop`; nothing if that loop has closed (the server stopped first: no one waits)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # "Event loop is closed"
        pass


def _post(stream: _Stream, item) -> None:
    """Put `item` on a handler's queue, from the engine thread."""
    _call(stream.loop, stream.queue.put_nowait, item)


def _settle(future: asyncio.Future, error: BaseException | None, result=None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)
