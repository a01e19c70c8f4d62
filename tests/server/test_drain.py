"""`kvcache serve` stopped by SIGTERM or SIGINT as a deploy or a user stops it (server/drain.py): a real process, real
clients. New requests get 503 and /health 503 while it drains; requests that finish in time are answered whole;
the rest end with an error event naming the shutdown and [DONE] (a 503 when not streamed); the process exits 0
with no traceback, or 130 at once on a second signal."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from kvcache.bench.serve import wait_until_serving
from kvcache.server.drain import FLUSH_S

from drain_client import assert_clean_log, assert_refused_while_draining, draining, signal_while_open, \
    streams_started
from live_server import free_port

LONG = 500  # tokens (the tiny model's context is 512); with --max-num-seqs 1, a queue of them outlasts any drain here


def serve(model_dir: str, log_path, shutdown_timeout: float, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    with open(log_path, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvcache.cli", "serve", "--model", model_dir, "--port",
                                 str(port), "--kv-cache-memory", "16MiB", "--max-model-len", "512",
                                 "--served-model-name", "tiny", "--shutdown-timeout", str(shutdown_timeout), *extra],
                                stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(url, proc, 120)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, url


@pytest.mark.parametrize("where", ["thread", "process"])
def test_sigterm_aborts_what_the_timeout_leaves_with_an_error_event_and_done(tiny_llama, tmp_path, where):
    """The same with the engine on a thread of the server or in a process of its own (--engine-process)."""
    log_path = tmp_path / "serve.log"
    proc, url = serve(tiny_llama, log_path, 0.5, "--max-num-seqs", "2",
                      "--engine-process" if where == "process" else "--no-engine-process")
    try:
        events, wholes, new, health = asyncio.run(signal_while_open(proc, url, signal.SIGTERM, 8, LONG, 2, 2))
        assert proc.wait(timeout=0.5 + FLUSH_S + 20) == 0
        waited = time.monotonic() - proc.signalled_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert_refused_while_draining(new, health)
    aborted = 0
    for ev in events:  # each stream: whole, or its tokens so far (none if it was queued), the shutdown's error, [DONE]
        assert ev[-1] == "[DONE]"
        assert all("choices" in e for e in ev[:-2])
        if "error" in ev[-2]:
            assert ev[-2]["error"]["code"] == "server_shutting_down" and "0.5 s drain" in ev[-2]["error"]["message"]
            aborted += 1
        else:
            assert ev[-2]["choices"][0]["finish_reason"] == "length"
    assert aborted >= 4  # two run at a time, for 500 steps each
    for r in wholes:
        assert r.status_code == 200 or r.json()["error"]["code"] == "server_shutting_down"
    log = log_path.read_text()
    assert_clean_log(log)
    assert "SIGTERM: draining" in log and "aborting the" in log
    assert waited < 0.5 + FLUSH_S + 15, f"exit took {waited:.1f} s"  # a hang guard: the target is timeout + 5 s


def test_sigint_lets_requests_that_finish_in_time_finish(tiny_llama, tmp_path):
    log_path = tmp_path / "serve.log"
    proc, url = serve(tiny_llama, log_path, 120)
    try:
        events, wholes, new, health = asyncio.run(signal_while_open(proc, url, signal.SIGINT, 4, 300, 1, 4))
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert_refused_while_draining(new, health)
    for ev in events:
        assert ev[-1] == "[DONE]"
        assert ev[-2]["choices"][0]["finish_reason"] == "length"
        assert sum(len(e["choices"]) for e in ev[:-1]) >= 1 and not any("error" in e for e in ev[:-1])
    assert wholes[0].status_code == 200 and wholes[0].json()["usage"]["completion_tokens"] == 300
    log = log_path.read_text()
    assert_clean_log(log)
    assert "drained: every open request finished" in log


def test_a_second_signal_exits_at_once_with_130(tiny_llama, tmp_path):
    log_path = tmp_path / "serve.log"
    proc, url = serve(tiny_llama, log_path, 300, "--max-num-seqs", "1")

    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            tasks, ready = streams_started(client, url, 8, LONG, 1)
            await asyncio.wait_for(ready.wait(), 60)
            proc.send_signal(signal.SIGTERM)
            assert (await draining(client, url)).status_code == 503
            assert proc.poll() is None  # draining, for up to 300 s
            proc.send_signal(signal.SIGINT)
            status = await asyncio.to_thread(proc.wait, 30)
            await asyncio.gather(*tasks, return_exceptions=True)  # the connection dropped
            return status

    try:
        assert asyncio.run(run()) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = log_path.read_text()
    assert "SIGINT again: exiting now" in log and "Traceback" not in log


def test_a_signal_while_loading_stops_the_start_up_cleanly(monkeypatch, caplog):
    """SIGTERM while the engine loads (here: a stand-in that takes its time) ends `run` with status 0 and one log
    line, no traceback; the handlers in place before are back afterwards."""
    import argparse

    from kvcache.config import EngineConfig
    from kvcache.server import serve as serve_mod

    def slow_create(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
        raise AssertionError("the signal did not stop the start-up")

    monkeypatch.setattr(serve_mod, "create", slow_create)
    before = signal.getsignal(signal.SIGTERM)
    p = argparse.ArgumentParser()
    serve_mod.add_args(p)
    args = p.parse_args(["--port", "8000"])
    caplog.set_level("INFO", logger="kvcache.server")
    assert serve_mod.run(args, EngineConfig(model="unused")) == 0
    assert "SIGTERM while starting: stopped before serving" in caplog.text
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("bad", ["-1", "-0.5"])
def test_a_negative_shutdown_timeout_is_refused_before_loading(bad, monkeypatch):
    import argparse

    from kvcache.config import EngineConfig
    from kvcache.server import serve as serve_mod

    monkeypatch.setattr(serve_mod, "create", lambda *a, **k: pytest.fail("loaded a model for a bad argument"))
    p = argparse.ArgumentParser()
    serve_mod.add_args(p)
    with pytest.raises(ValueError, match="--shutdown-timeout must be >= 0 seconds"):
        serve_mod.run(p.parse_args(["--shutdown-timeout", bad]), EngineConfig(model="unused"))
