"""The live KV cache page: the snapshot's block states against the pool, the API's security (key, cookie, login,
404s, --no-kv-page, no text unless asked), one snapshot per interval whatever the number of viewers, and the page
itself in headless Chromium against a live server with running requests."""
from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import threading
import time

import httpx
import pytest
from live_server import API_KEY, start_server

from kvcache import LLM, SamplingParams
from kvcache.server import kv_snapshot

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _counts(states: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for ch in states:
        out[ch] = out.get(ch, 0) + 1
    return out


@pytest.mark.parametrize("algo", ["hash", "radix"])
def test_the_snapshot_accounts_for_every_block(tiny_llama, algo):
    """Mid-run, with n = 2 samples sharing their prompt's blocks and a finished request's blocks cached: each
    block has one state, the counts add up to the pool, held blocks are the tables' and cached ones the cache's."""
    llm = LLM(tiny_llama, kv_cache_memory="1MiB", prefix_caching_algo=algo)
    eng = llm.engine
    prompt = list(range(10, 74))  # 4 full blocks
    eng.add_request("done", prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    eng.run_to_completion()
    eng.add_request("pair", prompt + [5, 6], SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=40, ignore_eos=True))
    eng.add_request("solo", list(range(200, 240)), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    for _ in range(5):
        eng.step()
    snap = kv_snapshot.take(eng)
    kv, n = eng.kv, eng.kv.pool.num_blocks
    assert len(snap["states"]) == n and snap["states"][0] == "n"
    counts = _counts(snap["states"])
    assert sum(counts.values()) == n
    pool = snap["pool"]
    assert pool["free"] + pool["cached"] == kv.num_free_blocks  # what an allocation can take
    held = {b for t in kv.block_tables.values() for b in t if b}
    assert {b for b, ch in enumerate(snap["states"]) if ch in "uUsS"} == held
    shared = {b for b in held if sum(b in t for t in kv.block_tables.values()) > 1}
    assert {b for b, ch in enumerate(snap["states"]) if ch in "sS"} == shared and len(shared) >= 4  # the prompt's
    assert counts.get("c", 0) == kv.num_idle_cached_blocks
    assert pool["used"] + pool["used_cached"] + pool["shared"] + pool["shared_cached"] == len(held)
    reqs = {r["id"]: r for r in snap["requests"]}
    assert set(reqs) == {"pair", "solo"} and len(reqs["pair"]["seqs"]) == 2
    assert reqs["pair"]["prefix_hit_tokens"] == 64  # the finished request's four blocks
    assert all("text" not in r for r in snap["requests"])
    assert snap["prefix"]["mode"] == algo and snap["prefix"]["groups"][0]["hits"] >= 1
    if algo == "hash":
        assert set(snap["hashes"]) == {str(b) for b in held if kv.pool.keys[b] is not None} != set()
        groups = snap["prefix"]["groups"]
        assert sum(g["blocks"] for g in groups) == kv.pool.num_cached  # every cached block in one chain
        first = next(g for g in groups if g["first_block"] == 1)  # the shared prompt's chain, from block 1
        assert first["blocks"] >= 4 and first["held"] >= 4 and first["hits"] == 1
    assert kv_snapshot.take(eng, show_text=True)["requests"][0]["text"]


def test_the_snapshot_shows_pinned_blocks_the_format_and_what_pressure_did_to_each_request(tiny_llama):
    """A pinned prefix's blocks are `P` (in use or not), the pool names its one KV format, and a request the pool
    was too small for carries its preemption in `kv_degradation`, as its RequestOutput will."""
    system = " ".join(f"w{i}" for i in range(40, 72))  # 32 tokens: two blocks, pinned
    llm = LLM(tiny_llama, kv_cache_memory="40KiB", kv_pin_prefix=system, kv_cache_dtype="int8")  # 18 blocks
    eng = llm.engine
    pinned = set(eng.kv.pool.pinned)
    assert len(pinned) == 2
    for i in range(2):  # each grows to 12 blocks: two do not fit beside the pin
        eng.add_request(f"r{i}", eng.tokenize(system) + list(range(100 + 8 * i, 108 + 8 * i)),
                        SamplingParams(temperature=0, max_tokens=150, ignore_eos=True))
    snap = None
    for _ in range(400):
        eng.step()
        reqs = eng.requests
        if any(s.num_preemptions for r in reqs.values() for s in r.seqs if not s.is_finished):
            snap = kv_snapshot.take(eng)
            break
    assert snap is not None, "no preemption: the pool is not as small as the test thinks"
    assert {b for b, ch in enumerate(snap["states"]) if ch == "P"} == pinned
    assert snap["pool"]["pinned"] == 2 and snap["pool"]["kv_format"] == "int8"
    assert sum(v for k, v in snap["pool"].items() if k not in ("num_blocks", "block_size", "prefix_caching",
                                                               "kv_format")) == snap["pool"]["num_blocks"]
    degraded = {r["id"]: r["kv_degradation"] for r in snap["requests"]}
    assert sorted(d["preemptions"] for d in degraded.values()) == [0, 1]
    assert all(d["evicted_tokens"] == 0 and d["swapped_out"] == 0 for d in degraded.values())
    eng.run_to_completion()


@pytest.fixture(scope="module")
def slow_live(tiny_llama):
    """A live server whose engine steps at most every 20 ms, so that requests stay running while a test looks."""
    srv = start_server(tiny_llama)
    step = srv.loop.engine.step

    def slow_step():
        time.sleep(0.02)
        return step()
    srv.loop.engine.step = slow_step
    yield srv
    srv.stop()


def _run_requests(url: str, n: int = 3, max_tokens: int = 300) -> threading.Thread:
    def one(i: int) -> None:
        try:
            httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=120, json={
                "model": "tiny", "prompt": f"w{5 + i} w6 w7 w8 " * 10, "max_tokens": max_tokens, "ignore_eos": True,
                "n": 2 if i == 0 else 1})
        except httpx.HTTPError:  # the module's server stopped under it
            pass
    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads[0]


def _raw_post_status(url: str, path: str, declared: int) -> int:
    """The status a POST gets when its Content-Length declares `declared` bytes and none are sent."""
    import socket
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: {declared}\r\n\r\n".encode())
        return int(sock.recv(4096).split(b" ", 2)[1])


def test_the_api_needs_the_key_or_the_login_cookie(slow_live):
    url = slow_live.url
    with httpx.Client(timeout=10) as c:
        assert c.get(f"{url}/kv/snapshot").status_code == 401
        assert c.get(f"{url}/kv/stream").status_code == 401
        page = c.get(f"{url}/kv")
        assert page.status_code == 401 and 'action="/kv/login"' in page.text and "API key" in page.text
        assert c.get(f"{url}/kv/nothing", headers=AUTH).status_code == 404
        assert c.get(f"{url}/kv/snapshot?part=blocks", headers=AUTH).status_code == 400
        big = c.post(f"{url}/kv/login", content=b"key=" + b"x" * 10_000)  # the open form reads 4 KiB at most
        assert big.status_code == 413
        assert _raw_post_status(url, "/kv/login", 99_999_999_999) == 413  # refused on its header, before any read
        wrong = c.post(f"{url}/kv/login", data={"key": "nope"}, follow_redirects=False)
        assert wrong.status_code == 401 and "wrong key" in wrong.text and "set-cookie" not in wrong.headers
        ok = c.post(f"{url}/kv/login", data={"key": API_KEY}, follow_redirects=False)
        assert ok.status_code == 303 and ok.headers["location"] == "/kv"
        cookie = ok.headers["set-cookie"]
        assert API_KEY not in cookie and "HttpOnly" in cookie and "SameSite=strict" in cookie
    with httpx.Client(timeout=10, cookies=ok.cookies) as c:
        assert c.get(f"{url}/kv/snapshot").status_code == 200
        assert c.get(f"{url}/kv").text.count("blockmap") >= 1
        assert c.get(f"{url}/v1/models").status_code == 401  # the cookie opens /kv only
        health = c.get(f"{url}/kv/snapshot?part=health", headers=AUTH).json()["health"]
        assert {"kv_usage", "running", "waiting", "warnings"} <= set(health)


def test_no_kv_page_and_no_key(tiny_llama):
    srv = start_server(tiny_llama, kv_page_on=False)
    try:
        with httpx.Client(timeout=10) as c:
            for path in ("/kv", "/kv/snapshot", "/kv/stream"):
                assert c.get(srv.url + path, headers=AUTH).status_code == 404
    finally:
        srv.stop()
    srv = start_server(tiny_llama, api_key=None, kv_page_show_text=True)
    try:
        with httpx.Client(timeout=10) as c:
            assert c.get(srv.url + "/kv").status_code == 200  # no key: no login
            snap = c.get(srv.url + "/kv/snapshot").json()
            assert snap["version"] == 1 and snap["requests"] == []
    finally:
        srv.stop()


def test_twenty_viewers_share_one_snapshot_per_interval(slow_live):
    hub = slow_live.app.state.kv_hub
    _run_requests(slow_live.url)
    time.sleep(0.3)

    async def viewers(n: int, events: int) -> list[int]:
        async with httpx.AsyncClient(timeout=30) as c:
            async def one() -> int:
                got = 0
                async with c.stream("GET", f"{slow_live.url}/kv/stream", headers=AUTH) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            got += 1
                            if got == events:
                                return got
                return got
            return await asyncio.gather(*(one() for _ in range(n)))
    before, t = hub.taken, time.monotonic()
    assert asyncio.run(viewers(20, 3)) == [3] * 20
    elapsed = time.monotonic() - t
    taken = hub.taken - before
    assert 1 <= taken <= elapsed / hub.interval_s + 2, (taken, elapsed)  # not 60: one per interval for all 20


def test_the_page_in_a_headless_browser(slow_live, tmp_path):
    """Chromium loads /kv through its login form while requests run; the cells drawn, the request rows and the
    chart points are those of the snapshot the page holds; clicking a request highlights exactly its blocks. The
    page polls while the test reads it, so each comparison reads the page's snapshot and its DOM in one script (the
    page's timers cannot run in between), however loaded the machine."""
    webdriver = pytest.importorskip("selenium.webdriver")
    if not shutil.which("chromium") or not shutil.which("chromedriver"):
        pytest.skip("chromium and chromedriver are not installed (make services installs them)")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    _run_requests(slow_live.url, n=3, max_tokens=400)
    time.sleep(0.5)
    opts = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,1000"):
        opts.add_argument(arg)
    opts.binary_location = shutil.which("chromium")
    # Chromium's singleton socket folder (org.chromium.Chromium.*) goes under TMPDIR and was left in /tmp by each run;
    # a short folder of the test's own (tmp_path under xdist is too long for the socket's path: Chromium exits)
    scratch = tempfile.mkdtemp(prefix="kvc-chromium-")
    service = webdriver.ChromeService(executable_path=shutil.which("chromedriver"),
                                      env={**os.environ, "TMPDIR": scratch})
    driver = None
    try:
        driver = webdriver.Chrome(options=opts, service=service)
        driver.get(f"{slow_live.url}/kv")
        driver.find_element(By.ID, "key").send_keys(API_KEY)
        driver.find_element(By.ID, "login").submit()
        wait = WebDriverWait(driver, 20)
        # the login's redirect may still be loading (no body yet): wait through it for the page's first snapshot
        wait.until(lambda d: d.execute_script("return document.body && document.body.dataset.snapshotTime"))
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#requests tbody tr")) >= 2)
        page = driver.execute_script(_READ_PAGE)
        snap = page["snap"]
        assert page["time"] == str(snap["time"])
        assert page["cells"] == snap["pool"]["num_blocks"]
        assert page["counts"] == _counts(snap["states"])
        assert page["rows"] == [r["id"] for r in snap["requests"]] and len(page["rows"]) >= 2
        assert page["points"] == len(snap["history"]) >= 1
        assert page["usage"] == f"{100 * snap['health']['kv_usage']:.1f}%"
        assert f"of {snap['pool']['kv_format']} KV" in page["pool"]
        assert page["pressure"] == ["-"] * len(page["rows"])  # nothing degraded: the pool holds them all
        with httpx.Client(timeout=10) as c:  # the page draws what the API serves: the same document, the same pool
            api = c.get(f"{slow_live.url}/kv/snapshot", headers=AUTH).json()
        assert set(api) == set(snap) and api["pool"] == snap["pool"] and api["time"] >= snap["time"]
        # looked up and clicked in one script: the page redraws its rows on every snapshot, so a row found by one
        # WebDriver call could be gone (StaleElementReferenceException) by the next on a loaded machine
        driver.execute_script('document.querySelector("#requests tbody tr").click()')
        wait.until(lambda d: d.find_element(By.CSS_SELECTOR, "#requests tbody tr.selected"))
        picked = driver.execute_script(_READ_SELECTION)
        mine = [r for r in picked["snap"]["requests"] if r["id"] == picked["request"]]
        want = len({b for q in mine[0]["seqs"] for b in q["blocks"] + q["private"] if b}) if mine else 0
        assert picked["highlighted"] == picked["blocks"] == want > 0
        driver.save_screenshot(str(tmp_path / "kv_page.png"))
        assert (tmp_path / "kv_page.png").stat().st_size > 10_000
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        # the one expected: the first GET /kv, answered 401 with the login form
        assert [e for e in errors if not (e["source"] == "network" and "/kv - " in e["message"] and "401" in e["message"])] == []
    finally:
        if driver is not None:
            driver.quit()
        shutil.rmtree(scratch, ignore_errors=True)


# The page's snapshot and what it drew of it, read in one script (the page's polling cannot run in between)
_READ_PAGE = """
const canvas = document.getElementById("blockmap");
return {snap: snap, time: document.body.dataset.snapshotTime, cells: Number(canvas.dataset.cells),
        counts: JSON.parse(canvas.dataset.counts),
        rows: [...document.querySelectorAll("#requests tbody tr")].map(r => r.dataset.request),
        points: Number(document.getElementById("chart-usage").dataset.points),
        usage: document.querySelector('[data-figure="KV usage"] b').textContent,
        pool: document.getElementById("pool").textContent,
        pressure: [...document.querySelectorAll("#requests tbody tr")].map(r => r.children[7].textContent)};
"""
# The selected request, its blocks as the table and the block map give them, and the snapshot they were drawn from
_READ_SELECTION = """
const row = document.querySelector("#requests tbody tr.selected");
return {snap: snap, request: row ? row.dataset.request : null, blocks: row ? Number(row.dataset.blocks) : -1,
        highlighted: Number(document.getElementById("blockmap").dataset.highlighted)};
"""


def test_kvcache_top_reads_the_kv_api_and_needs_the_key(slow_live, capsys):
    """`kvcache top --once` against a live server with --api-key: the figures from /kv/snapshot?part=health (the
    page's numbers); without the key, one clear error."""
    import argparse

    from kvcache.server import top
    p = argparse.ArgumentParser()
    top.add_args(p)
    _run_requests(slow_live.url, n=2, max_tokens=200)
    time.sleep(0.3)
    assert top.run(p.parse_args(["--url", slow_live.url, "--once", "--api-key", API_KEY])) == 0
    out = capsys.readouterr().out
    assert "Requests       running " in out and "KV cache       usage " in out
    with pytest.raises(ValueError, match="refused the API key given"):
        top.run(p.parse_args(["--url", slow_live.url, "--once", "--api-key", "wrong"]))
    # no key: /metrics is open, and the figures are there too
    assert top.run(p.parse_args(["--url", slow_live.url, "--once", "--api-key", ""])) == 0
    assert "KV cache       usage " in capsys.readouterr().out


def test_a_dead_engine_answers_503_not_a_hang(tiny_llama):
    srv = start_server(tiny_llama)
    try:
        srv.loop.stop()  # the engine thread is gone: nobody can take a snapshot
        with httpx.Client(timeout=10) as c:
            for path in ("/kv/snapshot", "/kv/stream"):
                r = c.get(srv.url + path, headers=AUTH)
                assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", path
    finally:
        srv.stop()
