"""The engine in a process of its own (`kvcache serve --engine-process`): this module is that process's side.

`run` (the process's target) builds the LLMEngine and its metrics, says it is ready, then loops: it takes what the
API process sent (server/wire.py's messages) and steps the engine while requests are unfinished, sending each
step's outputs back; idle, it sleeps on the socket. It renders the Prometheus text at most every METRICS_EVERY_S
while it works (and once more when it goes idle), so that the API process answers /metrics from its last copy
without waiting for a step. A message that cannot be decoded is logged and fails only its request.

The process ignores SIGINT and SIGTERM: the API process drains and then sends "stop", on which the engine aborts
what is left, closes (offload writer, KV events) and exits. It exits too if the API process has gone (its parent
changed).
"""
from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import time

from kvcache.server import wire
from kvcache.server.engine_loop import record_step, use_small_step_threads

log = logging.getLogger("kvcache.engine_process")
METRICS_EVERY_S = 0.25
SEND_TIMEOUT_MS = 10_000  # a send that the API process has not taken in this long fails (it has stopped reading)
IDLE_POLL_MS = 500  # how long an idle engine sleeps on its socket before it checks that its parent is there


def run(config, model_name: str, to_engine: str, from_engine: str, log_interval_s: float, log_level: int,
        parent: int) -> None:
    """The engine process's body: connect, build, serve until "stop" or the end of `parent` (the API process's
    pid)."""
    import zmq
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    ctx = zmq.Context()
    rx, tx = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    tx.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
    rx.connect(to_engine)
    tx.connect(from_engine)
    try:
        core = EngineCore(config, model_name, tx, log_interval_s)
    except BaseException as e:  # noqa: BLE001 -- the API process reports it and exits
        log.exception("the engine process could not start")
        tx.send_multipart([b"failed_start", f"{type(e).__name__}: {e}".encode()])
        tx.close(linger=2000)
        return
    try:
        core.serve(rx, parent)
    except BaseException:
        log.exception("the engine stopped")  # the API process sees the exit and fails what is open
        raise
    finally:
        core.close()
        try:
            tx.send_multipart([b"closed"])
        except zmq.ZMQError:  # no one reads any more (SNDTIMEO)
            pass
        tx.close(linger=2000)
        rx.close(linger=0)


class EngineCore:
    """The engine, its metrics and the socket its results go out on; `serve` runs it."""

    def __init__(self, config, model_name: str, tx, log_interval_s: float) -> None:
        from kvcache.engine.llm_engine import LLMEngine
        from kvcache.server.metrics import ServerMetrics
        self.engine = LLMEngine(config)
        self.metrics = ServerMetrics(self.engine, model_name)
        use_small_step_threads(self.engine)
        self.tx = tx
        self.log_interval_s = log_interval_s
        self.open: set[str] = set()  # requests added and not yet finished or aborted
        self.sent_prompt: set[str] = set()  # requests whose prompt ids went out with an output
        self.stopping = False
        self.metrics_time = 0.0
        self.metrics_stale = False  # a step or an abort changed them since they were last sent
        self.log_time = time.monotonic()
        e = self.engine
        tx.send_multipart([b"ready", wire.pack({
            "max_model_len": e.max_model_len, "kv_dtype": e.kv_dtype, "pid": os.getpid()})])
        self._send_metrics()

    def serve(self, rx, parent: int) -> None:
        import zmq
        poller = zmq.Poller()
        poller.register(rx, zmq.POLLIN)
        while not self.stopping:
            busy = self.engine.has_unfinished_requests()
            if not busy and self.metrics_stale:  # idle now: the last word on the work, before sleeping
                self._send_counts()
                self._send_metrics()
            if poller.poll(0 if busy else IDLE_POLL_MS):
                while True:
                    try:
                        self.handle(rx.recv_multipart(zmq.NOBLOCK))
                    except zmq.Again:
                        break
                self._send_counts()  # what it took is waiting now (the API process's queue limit reads it)
            if os.getppid() != parent:  # busy or not: its outputs would queue for no one
                log.error("the API process has gone; the engine process stops")
                return
            if not self.stopping and self.engine.has_unfinished_requests():
                self.step()

    def handle(self, frames: list[bytes]) -> None:
        kind = frames[0]
        try:
            if kind == b"add":
                self._add(frames[1].decode(), frames[2])
            elif kind == b"abort":
                self._abort(frames[1].decode())
            elif kind == b"abort_all":
                for rid in list(self.open):
                    self._abort(rid)
            elif kind == b"snapshot":
                self._snapshot(frames[1], frames[2])
            elif kind == b"stop":
                self.stopping = True
            else:
                log.error("a message of unknown kind %r (%d frames) was dropped", kind[:32], len(frames))
        except (IndexError, UnicodeDecodeError, wire.WireError) as e:
            log.error("a %r message that cannot be decoded was dropped: %s", kind[:32], e)

    def _add(self, rid: str, body: bytes) -> None:
        try:
            kwargs = wire.unpack_request(body)
            self.engine.add_request(rid, stream=True, **kwargs)
        except wire.WireError as e:
            log.error("request %s: %s", rid, e)
            self._reply_added(rid, f"WireError: request {rid} could not be decoded by the engine process: {e}")
            return
        except Exception as e:  # noqa: BLE001 -- the API process turns it into an HTTP error
            self._reply_added(rid, f"{type(e).__name__}: {e}")
            return
        self.open.add(rid)
        self._reply_added(rid, "")

    def _reply_added(self, rid: str, error: str) -> None:
        self.tx.send_multipart([b"added", rid.encode(), error.encode()])

    def _abort(self, rid: str) -> None:
        self.open.discard(rid)
        self.sent_prompt.discard(rid)
        if self.engine.abort_request(rid):
            self.metrics.on_abort(rid)
            self.metrics_stale = True

    def _snapshot(self, ask_id: bytes, show_text: bytes) -> None:
        from kvcache.server import kv_snapshot
        try:
            body, error = wire.pack(kv_snapshot.take(self.engine, bool(wire.unpack(show_text)))), b""
        except Exception as e:  # noqa: BLE001 -- a page must not take the engine down: the viewer gets the error
            log.exception("taking the KV snapshot failed")
            body, error = b"", f"{type(e).__name__}: {e}".encode()
        self.tx.send_multipart([b"snapshot", ask_id, body, error])

    def step(self) -> None:
        outputs = self.engine.step()
        now = time.monotonic()
        frames = [b"outputs", self._counts()]
        for out in outputs:
            if out.request_id not in self.open:
                continue
            first = out.request_id not in self.sent_prompt
            try:
                body = wire.pack_output(out, first)
            except Exception as e:  # noqa: BLE001 -- one request's output: it fails alone
                log.exception("request %s: its output could not be encoded", out.request_id)
                self.engine.abort_request(out.request_id)
                out = failed_output(out, f"the engine process could not encode its output: {type(e).__name__}")
                body = wire.pack_output(out, first)
            frames += [out.request_id.encode(), body]
            if out.finished:
                self.open.discard(out.request_id)
                self.sent_prompt.discard(out.request_id)
            elif first:
                self.sent_prompt.add(out.request_id)
        self.tx.send_multipart(frames)
        self.log_time = record_step(self.metrics, outputs, now, self.log_time, self.log_interval_s)
        self.metrics_stale = True
        if now - self.metrics_time >= METRICS_EVERY_S:
            self._send_metrics()

    def _counts(self) -> bytes:
        return wire.pack([len(self.engine.scheduler.waiting), len(self.engine.scheduler.running)])

    def _send_counts(self) -> None:
        self.tx.send_multipart([b"counts", self._counts()])

    def _send_metrics(self) -> None:
        self.metrics_time, self.metrics_stale = time.monotonic(), False
        self.tx.send_multipart([b"metrics", self.metrics.render()])

    def close(self) -> None:
        """Abort what is left and close the engine (the offload writer's queue, the last KV events)."""
        for rid in list(self.open):
            self._abort(rid)
        self.engine.close()
        log.info("engine process: engine closed")


def failed_output(out, error: str):
    """`out` as the last output of a request that failed with `error` (its samples' text and logprobs dropped)."""
    from kvcache.engine.outputs import CompletionOutput, RequestOutput
    samples = [CompletionOutput(c.index, "", [], "error") for c in out.outputs]
    return RequestOutput(out.request_id, None, list(out.prompt_token_ids), samples, True, out.metrics, error)


def main(directory: str) -> None:
    """`python -m kvcache.server.engine_core DIR`: run with the arguments EngineClient left in DIR/args.pickle
    (a private directory of the API process's)."""
    with open(os.path.join(directory, "args.pickle"), "rb") as f:
        run(**pickle.load(f))


if __name__ == "__main__":
    main(sys.argv[1])
