"""The API process's side of `kvcache serve --engine-process`: EngineClient runs the engine in a process of its own
(server/engine_core.py) and stands in for EngineLoop, with the same methods the routes, the KV page and the drain
call. The API process keeps the tokenizer (the routes tokenize, apply the chat template and decode logprob tokens
here); the engine process schedules, runs the steps and detokenizes the samples (its stop strings end a request
in the step that produced them, so that its blocks are freed there).

A receiver thread takes what the engine process sends (server/wire.py) and puts each request's outputs on its
asyncio queue. It also watches the process: if it dies, the death is seen within WATCH_S, every open request gets
EngineDeadError (503), `alive` turns False (/health 503) and `on_dead` is called, as when EngineLoop's thread dies.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace

from prometheus_client import CONTENT_TYPE_LATEST

from kvcache.compress.spec import EvictionSpec
from kvcache.engine.admission import encode_prompt
from kvcache.engine.llm_engine import EngineDeadError
from kvcache.engine.outputs import RequestMetrics, RequestOutput
from kvcache.engine.sampling_params import SamplingParams
from kvcache.server import wire
from kvcache.server.engine_loop import (
    EngineLoop,
    EngineRequestError,
    ServerShuttingDown,
    _call,
    _dead,
    _post,
    _settle,
    _Stream,
)

log = logging.getLogger("kvcache.server")
WATCH_S = 0.1  # the receiver's poll: how soon a dead engine process is noticed
SEND_TIMEOUT_MS = 5000  # a send the engine process has not taken in this long fails (it has stopped reading)
EXIT_WAIT_S = 5.0  # for an engine process that said it closed unasked to exit, before it is killed
STOP_TIMEOUT_S = 30.0  # for the engine process to close its engine (the offload writer's queue) and exit


class EngineStartError(RuntimeError):
    """The engine process could not start; its message is the engine's error."""


class RemoteEngine:
    """What the API process knows of the engine in the other process: the tokenizer and the figures the routes
    read (the model's config, the context length, the KV format)."""

    def __init__(self, config, loaded, info: dict) -> None:
        self.config = config
        self.tokenizer = loaded.tokenizer
        self.model = SimpleNamespace(config=loaded.config)
        self.max_model_len = int(info["max_model_len"])
        self.kv_dtype = info["kv_dtype"]

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return encode_prompt(self.tokenizer, text, add_special_tokens)

    def close(self) -> None:
        """Nothing: the engine process closes its engine when the client stops it."""


class RemoteMetrics:
    """The engine process's Prometheus text as it last sent it (every engine_core.METRICS_EVERY_S while working)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.text = b""

    def render(self) -> bytes:
        return self.text


class EngineClient:
    """EngineLoop's interface over an engine process. Built with the process started and ready (the weights
    loaded); `start` starts the receiver."""

    build_snapshot = staticmethod(lambda snap: snap)  # the engine process sends snapshots built

    def __init__(self, config, model_name: str, log_interval_s: float = 10.0,
                 on_dead: Callable[[], None] | None = None) -> None:
        import zmq

        from kvcache.models.loader import read_checkpoint
        self.on_dead = on_dead
        self.metrics = RemoteMetrics()
        self.error: BaseException | None = None
        self.draining = False
        self._stopping = False
        self._closed = False  # the engine process said it closed its engine
        self._streams: dict[str, _Stream] = {}
        self._accepting: dict[str, asyncio.Future] = {}  # sent, the engine's "added" not yet back
        self._prompts: dict[str, list[int]] = {}  # each open request's prompt ids (sent with its first output)
        self._snapshots: dict[bytes, tuple[asyncio.Future, asyncio.AbstractEventLoop]] = {}
        self._snapshot_ids = itertools.count()
        self._counts = (0, 0)  # waiting, running: the engine's scheduler after its last step
        self._lock = threading.Lock()  # the maps above, and the send socket (ZMQ sockets are not thread-safe)
        self._dir = tempfile.mkdtemp(prefix="kvcache-engine-")
        self._ctx = zmq.Context()
        self._tx, self._rx = self._ctx.socket(zmq.PUSH), self._ctx.socket(zmq.PULL)
        self._tx.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
        to_engine, from_engine = (f"ipc://{os.path.join(self._dir, name)}" for name in ("in", "out"))
        self._tx.bind(to_engine)
        self._rx.bind(from_engine)
        with open(os.path.join(self._dir, "args.pickle"), "wb") as f:  # a directory of ours (mode 0700)
            pickle.dump({"config": config, "model_name": model_name, "to_engine": to_engine,
                         "from_engine": from_engine, "log_interval_s": log_interval_s,
                         "log_level": logging.getLogger().level, "parent": os.getpid()}, f)
        # a fresh interpreter (not multiprocessing's spawn, which would import this process's __main__ again)
        self.process = subprocess.Popen([sys.executable, "-m", "kvcache.server.engine_core", self._dir])
        try:
            loaded = read_checkpoint(config.model)  # the tokenizer, while the engine process loads the weights
            info = self._wait_ready()
            self.engine = RemoteEngine(config, loaded, info)
        except BaseException:
            self._kill()
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._receive, name="kvcache-engine-client", daemon=True)
        log.info("the engine runs in a process of its own (pid %d), over ZMQ", info["pid"])

    def _wait_ready(self) -> dict:
        while True:
            if self._rx.poll(int(WATCH_S * 1000)):
                frames = self._rx.recv_multipart()
                if frames[0] == b"ready":
                    return wire.unpack(frames[1])
                if frames[0] == b"failed_start":
                    message = frames[1].decode(errors="replace")
                    if message.startswith("ValueError: "):  # a setting the engine refused: bad input, as in-process
                        raise ValueError(message.removeprefix("ValueError: "))
                    raise EngineStartError(f"the engine process could not start: {message}")
                if frames[0] == b"metrics":
                    self.metrics.text = frames[1]
            elif self.process.poll() is not None:
                raise EngineStartError(f"the engine process exited while starting ({exit_status(self.process)})")

    # ---- lifecycle (EngineLoop's) -------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Have the engine process abort what is left, close its engine and exit; killed if it has not within
        `timeout` seconds. Every request still open gets ServerShuttingDown."""
        self._stopping = True
        if self.process.poll() is None:
            self._send([b"stop"])  # if it is not taken, the wait below ends in a kill
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                log.error("the engine process did not exit within %.0f s of stop; killing it", timeout)
                self._kill()
        if self._thread.ident is not None:  # it ends once the process has (it reads what is left first)
            self._thread.join(10)
        self._fail_all(ServerShuttingDown("the server is shutting down"))
        if not self._thread.is_alive():  # never close a socket another thread is in
            self._close_sockets()

    def _kill(self) -> None:
        self.process.kill()
        self.process.wait(5)

    def _close_sockets(self) -> None:
        self._tx.close(linger=0)
        self._rx.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    @property
    def stopped(self) -> bool:
        return self._stopping or (self._thread.ident is not None and not self._thread.is_alive())

    @property
    def alive(self) -> bool:
        return self.running and not self.draining

    @property
    def running(self) -> bool:
        return self.error is None and not self._stopping and self.process.poll() is None

    def begin_drain(self) -> None:
        self.draining = True

    @property
    def num_open(self) -> int:
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        return self._counts[0] + len(self._accepting)

    @property
    def num_running(self) -> int:
        return self._counts[1]

    def abort_all(self, message: str) -> None:
        with self._lock:
            rids = list(self._streams)
        for rid in rids:
            self._forget(rid, ServerShuttingDown(message), abort=True)

    # ---- called from asyncio handlers ---------------------------------------------------------------

    def enqueue(self, request_id: str, prompt: list[int], params: SamplingParams, add_special_tokens: bool = True,
                cache_salt: str | None = None, out: asyncio.Queue | None = None,
                eviction: EvictionSpec | None = None) -> tuple[asyncio.Queue, asyncio.Future]:
        loop = asyncio.get_running_loop()
        accepted = loop.create_future()
        stream = _Stream(loop, out if out is not None else asyncio.Queue())
        body = wire.pack_request(prompt, params, add_special_tokens, cache_salt, eviction)
        with self._lock:
            if self.draining:
                raise ServerShuttingDown("the server is shutting down")
            if not self.running:
                raise EngineDeadError("the engine process is not running")
            if not self._send_locked([b"add", request_id.encode(), body]):
                raise EngineDeadError("the engine process is not taking requests")
            self._streams[request_id] = stream
            self._accepting[request_id] = accepted
        return stream.queue, accepted

    submit = EngineLoop.submit  # `enqueue`, then wait until the engine has taken the request

    def abort(self, request_id: str) -> None:
        self._forget(request_id, (request_id, None), abort=True)

    def request_snapshot(self, future: asyncio.Future, loop: asyncio.AbstractEventLoop, show_text: bool) -> None:
        with self._lock:
            if not self.alive:
                loop.call_soon_threadsafe(_settle, future, EngineDeadError("the engine process is not running"))
                return
            ask = str(next(self._snapshot_ids)).encode()
            if not self._send_locked([b"snapshot", ask, wire.pack(show_text)]):
                loop.call_soon_threadsafe(_settle, future, EngineDeadError("the engine process is not answering"))
                return
            self._snapshots[ask] = (future, loop)

    def _send(self, frames: list[bytes]) -> bool:
        """Send under the lock; False (logged) if the engine process did not take it within SEND_TIMEOUT_MS."""
        with self._lock:
            return self._send_locked(frames)

    def _send_locked(self, frames: list[bytes]) -> bool:
        import zmq
        try:
            self._tx.send_multipart(frames)
            return True
        except zmq.ZMQError as e:
            log.error("a %r message to the engine process was not sent: %s", frames[0], e)
            return False

    def _forget(self, rid: str, last, abort: bool) -> None:
        """Close `rid`'s stream with `last` (and abort it in the engine process). A request the engine has not
        said it took yet is settled as taken, or with `last` where that is an error, as EngineLoop, which takes
        an add before the abort queued after it, would have it."""
        with self._lock:
            stream = self._streams.pop(rid, None)
            accepted = self._accepting.pop(rid, None)
            self._prompts.pop(rid, None)
            if abort and self.process.poll() is None:
                self._send_locked([b"abort", rid.encode()])
        if stream is None:
            return
        if accepted is not None:
            _call(stream.loop, _settle, accepted, last if isinstance(last, BaseException) else None)
        _post(stream, last)

    # ---- the receiver thread ------------------------------------------------------------------------

    def _receive(self) -> None:
        try:
            while not self._closed:
                if self._rx.poll(int(WATCH_S * 1000)):
                    self._dispatch(self._rx.recv_multipart())
                elif self.process.poll() is not None:
                    break
            if not self._stopping:  # it closed or exited without being asked: its engine stopped
                try:
                    self.process.wait(EXIT_WAIT_S)
                except subprocess.TimeoutExpired:
                    self._kill()
                self._died()
        except Exception as e:  # noqa: BLE001 -- the sockets closed under it (stop), or a bug: no request hangs
            if not self._stopping:
                log.exception("the engine client's receiver stopped")
                self._give_up(EngineDeadError(f"the engine client failed: {e}"))

    def _died(self) -> None:
        why = exit_status(self.process)
        log.error("the engine process exited (%s); failing every open request", why)
        self._give_up(EngineDeadError(f"the engine process exited ({why})"))

    def _give_up(self, error: EngineDeadError) -> None:
        """The engine is gone: `error` for every waiter, `alive` False, on_dead called."""
        self.error = error
        self._fail_all(error)
        if self.on_dead is not None:
            self.on_dead()

    def _dispatch(self, frames: list[bytes]) -> None:
        kind = frames[0]
        try:
            if kind == b"outputs":
                for i in range(2, len(frames) - 1, 2):
                    self._deliver(frames[i].decode(errors="replace"), frames[i + 1])
                self._counts = tuple(wire.unpack(frames[1]))
            elif kind == b"counts":
                self._counts = tuple(wire.unpack(frames[1]))
            elif kind == b"added":
                self._added(frames[1].decode(), frames[2].decode())
            elif kind == b"metrics":
                self.metrics.text = frames[1]
            elif kind == b"snapshot":
                self._snapshot(frames[1], frames[2], frames[3].decode())
            elif kind == b"closed":
                self._closed = True
            else:
                log.error("a message of unknown kind %r from the engine process was dropped", kind[:32])
        except (IndexError, UnicodeDecodeError, TypeError, wire.WireError) as e:
            log.error("a %r message from the engine process that cannot be decoded was dropped: %s", kind[:32], e)

    def _added(self, rid: str, error: str) -> None:
        with self._lock:
            accepted = self._accepting.pop(rid, None)
            stream = self._streams.get(rid)
            if error:
                self._streams.pop(rid, None)
        if accepted is None or stream is None:  # aborted meanwhile: _forget settled it
            return
        if not error:
            _call(stream.loop, _settle, accepted, None)
            return
        kind, _, message = error.partition(": ")
        exc = ValueError(message) if kind == "ValueError" else EngineRequestError(error)
        _call(stream.loop, _settle, accepted, exc)

    def _deliver(self, rid: str, body: bytes) -> None:
        stream = self._streams.get(rid)
        if stream is None:
            return
        try:
            out, ids = wire.unpack_output(rid, body, self._prompts.get(rid))
            with self._lock:  # not for a request aborted meanwhile: its entry would stay
                if rid in self._streams:
                    self._prompts[rid] = ids
        except wire.WireError as e:
            log.error("request %s: %s", rid, e)
            out = RequestOutput(rid, None, self._prompts.get(rid, []), [], True, RequestMetrics(time.monotonic()),
                                error=f"the engine process's output could not be decoded: {e}")
            self._forget(rid, out, abort=True)
            _post(stream, (rid, None))
            return
        _post(stream, out)
        if out.finished:
            self._forget(rid, (rid, None), abort=False)

    def _snapshot(self, ask: bytes, body: bytes, error: str) -> None:
        with self._lock:
            waiter = self._snapshots.pop(ask, None)
        if waiter is None:
            return
        future, loop = waiter
        try:
            snap = None if error else wire.unpack(body)
        except wire.WireError as e:
            error = str(e)
        if error:
            _call(loop, _settle, future, RuntimeError(f"taking the KV snapshot failed: {error}"))
        else:
            _call(loop, _settle, future, None, snap)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            streams, self._streams = self._streams, {}
            accepting, self._accepting = self._accepting, {}
            snapshots, self._snapshots = self._snapshots, {}
            self._prompts.clear()
        for rid, stream in streams.items():  # one exception per waiter (_dead), as EngineLoop's _fail_all
            if rid in accepting:
                _call(stream.loop, _settle, accepting[rid], _dead(error))
            else:
                _post(stream, _dead(error))
        for future, loop in snapshots.values():
            _call(loop, _settle, future, _dead(error))


def exit_status(process: subprocess.Popen) -> str:
    """How the exited `process` ended, in words: 'status N' or 'signal NAME'."""
    code = process.returncode
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"status {code}"
