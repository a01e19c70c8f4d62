"""A real redis-server on a free port in a temporary directory (no persistence), for the Redis tier's tests and the
replicas' (`make test` installs Debian's redis-server when it is missing)."""
from __future__ import annotations

import shutil
import socket
import subprocess

import pytest

from kvcache.parallel.host import redis_answers


class RedisServer:
    def __init__(self, directory: str) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail("redis-server is not installed: `make test` installs it (apt-get install redis-server)")
        self.exe, self.dir = exe, directory
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen([self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir,
                                      "--save", "", "--appendonly", "no"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if redis_answers(self.port):
            return
        self.stop()
        pytest.fail(f"redis-server did not answer on port {self.port} within 10 s")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
