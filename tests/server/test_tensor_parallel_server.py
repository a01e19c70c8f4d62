"""`kvcache serve --tensor-parallel-size 2` as a user runs it: a real process and the OpenAI client; a rank killed
mid-service makes the server answer with an error and exit with the engine-dead status, not hang."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys

import openai
import pytest

from kvcache import LLM, SamplingParams
from kvcache.bench.serve import wait_until_serving
from kvcache.server.serve import ENGINE_DEAD_STATUS

from live_server import free_port


def test_a_two_rank_server_serves_one_ranks_tokens_and_exits_when_a_rank_dies(tiny_model_dirs, tmp_path):
    path = tiny_model_dirs["llama"]
    port = free_port()
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvcache.cli", "serve", "--model", path, "--port", str(port),
                                 "--tensor-parallel-size", "2", "--kv-cache-memory", "1MiB", "--max-model-len", "256",
                                 "--served-model-name", "tiny"], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    rank_logs = None  # the workers' log folder, once the server has said where
    try:
        wait_until_serving(url, proc, 120)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        prompt = [5, 17, 42, 99, 123, 7, 8]
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True})
        text = got.choices[0].text
        one = LLM(path, kv_cache_memory="1MiB", max_model_len=256)
        ref = one.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
        assert text == ref[0].outputs[0].text
        assert got.usage.completion_tokens == 12
        pid = int(re.search(r"ranks 1-1 are processes (\d+)", log_path.read_text()).group(1))
        rank_logs = re.search(r"\(logs in (\S+)\)", log_path.read_text()).group(1)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model="tiny", prompt=prompt, max_tokens=4)
        assert e.value.status_code == 503
        assert proc.wait(timeout=30) == ENGINE_DEAD_STATUS
        assert "tensor-parallel rank 1" in log_path.read_text()
        assert os.path.exists(os.path.join(rank_logs, "rank1.log"))  # the dead rank's log stays for its user
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if rank_logs is not None:  # this test's own litter
            shutil.rmtree(rank_logs, ignore_errors=True)
