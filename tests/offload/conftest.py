"""A real redis-server for the redis tier's tests (tests/redis_server.py), started per test, stopped after."""
from __future__ import annotations

import pytest

from redis_server import RedisServer


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(str(tmp_path))
    server.start()
    yield server
    server.stop()
