"""Fixtures of the server tests: one live server per module, and an `openai` client for it."""
from __future__ import annotations

import pytest

from live_server import API_KEY, start_server


@pytest.fixture(scope="module")
def live(tiny_llama):
    srv = start_server(tiny_llama)
    yield srv
    srv.stop()


@pytest.fixture
def client(live):
    import openai
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
