"""`kvcache bench serve`: load any OpenAI-compatible server and measure TTFT, TPOT, ITL and throughput.

The metrics are vLLM's `benchmark_serving.py` ones, measured on the client: every request
streams; TTFT is the time from sending to the first chunk with content, ITL the gaps between
successive content chunks, TPOT (latency - TTFT) / (output tokens - 1) for requests with more
than one output token, E2E the time from sending to `data: [DONE]`. Token counts come from the
final `usage` chunk (content chunks, and prompt words, when the server sends none).

Prompts are random words from a fixed list of short common English words (about one token
each), seeded. Workloads: random (optionally behind a shared prefix), shared-prefix (G groups,
request i in group i % G) and multi-turn (each conversation sends turn t+1, with its whole
history, only after turn t finished). Arrivals are Poisson at `--request-rate` (conversation
starts, for multi-turn) and/or capped at `--max-concurrency` requests in flight.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from kvcache.bench.conversations import (Conversation, arrival_offsets, multi_turn_conversations,
                                         random_conversations, shared_prefix_conversations)
from kvcache.bench.report import write_json
from kvcache.bench.workload import parse_range

Endpoint = Literal["completions", "chat"]
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}

@dataclass(slots=True)
class RequestResult:
    """What the client saw of one request; times are time.perf_counter() seconds."""

    conversation: int
    turn: int
    max_tokens: int
    ok: bool = False
    error: str = ""
    sent: float = 0.0
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk with content
    text: str = ""
    input_tokens: int = 0
    output_tokens: int = 0
    usage_reported: bool = False

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.sent if self.chunk_times else None

    @property
    def latency(self) -> float:
        return self.end - self.sent


class _Failed(Exception):
    """A request failed in a way the server told us about (status, error chunk, truncated stream)."""


def request_body(endpoint: Endpoint, model: str, conv: Conversation, turn: int, replies: list[str],
                 ignore_eos: bool) -> dict:
    """The JSON body of `conv`'s turn `turn`, its history holding `replies` (the server's earlier answers)."""
    body: dict = {"model": model, "max_tokens": conv.output_lens[turn], "temperature": 0.0, "stream": True,
                  "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    if endpoint == "chat":
        messages = [{"role": "system", "content": conv.system}] if conv.system else []
        for user, reply in zip(conv.turns[:turn], replies):
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        body["messages"] = messages + [{"role": "user", "content": conv.turns[turn]}]
    else:
        # Each turn's prompt extends the previous one's text, so a prefix cache can reuse it.
        parts = [conv.system] if conv.system else []
        for user, reply in zip(conv.turns[:turn], replies):
            parts += [user, reply]
        body["prompt"] = " ".join(parts + [conv.turns[turn]])
    return body


def _prompt_words(body: dict) -> int:
    if "prompt" in body:
        return len(body["prompt"].split())
    return sum(len(m["content"].split()) for m in body["messages"])


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


async def _read_stream(resp, endpoint: Endpoint, res: RequestResult) -> dict | None:
    """Read SSE `data:` lines up to `[DONE]`, timing content chunks; the last usage seen, if any."""
    usage = None
    parts = []
    async for line in resp.aiter_lines():
        now = time.perf_counter()
        if not line.startswith("data:"):
            continue  # blank separators, comments, `event:` lines
        data = line[5:].strip()
        if data == "[DONE]":
            res.text = "".join(parts)
            return usage
        chunk = json.loads(data)
        if "error" in chunk:
            err = chunk["error"]
            message = err.get("message", err) if isinstance(err, dict) else err
            raise _Failed("error in stream: " + _one_line(str(message)))
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or []:
            text = choice.get("text") if endpoint == "completions" else (choice.get("delta") or {}).get("content")
            if text:
                res.chunk_times.append(now)
                parts.append(text)
    raise _Failed(f"stream ended after {len(parts)} content chunks without data: [DONE]")


async def send_request(client, url: str, headers: dict, body: dict, endpoint: Endpoint, timeout: float,
                       res: RequestResult) -> RequestResult:
    """POST one streaming request and fill `res`; every failure is recorded in `res.error`, never raised."""
    res.sent = time.perf_counter()
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", url, json=body, headers=headers) as resp:
                if resp.status_code != 200:
                    detail = (await resp.aread()).decode(errors="replace")
                    raise _Failed(f"HTTP {resp.status_code}: {_one_line(detail)}")
                usage = await _read_stream(resp, endpoint, res)
        res.usage_reported = bool(usage and "completion_tokens" in usage)
        # Without usage a content chunk counts as one token, as vLLM's benchmark does.
        res.output_tokens = int(usage["completion_tokens"]) if res.usage_reported else len(res.chunk_times)
        res.input_tokens = int(usage.get("prompt_tokens", 0)) if res.usage_reported else _prompt_words(body)
        res.ok = True
    except TimeoutError:
        res.error = f"no complete response within --timeout {timeout:g} s"
    except _Failed as e:
        res.error = str(e)
    except Exception as e:  # a broken connection or a malformed chunk fails this request, not the run
        res.error = _one_line(f"{type(e).__name__}: {e}")
    res.end = time.perf_counter()
    return res


async def _first_model(client, base: str, headers: dict, model: str | None) -> str:
    """`model`, or the first id GET /v1/models lists; the request also tells us whether the server is up."""
    import httpx
    try:
        resp = await client.get(base + "/v1/models", headers=headers)
    except httpx.TransportError as e:
        raise OSError(f"cannot reach {base} (GET /v1/models: {type(e).__name__}: {e}); is the server running?") from e
    if model:
        return model  # a server without /v1/models can still be benchmarked when told the name
    if resp.status_code != 200:
        raise ValueError(f"GET {base}/v1/models returned HTTP {resp.status_code}: {_one_line(resp.text)}; "
                         f"pass --model NAME")
    ids = [m.get("id") for m in resp.json().get("data") or [] if m.get("id")]
    if not ids:
        raise ValueError(f"GET {base}/v1/models lists no models; pass --model NAME")
    return ids[0]


def _raise_fd_limit(sockets: int) -> None:
    # Every request in flight holds a socket; the default soft limit (often 1,024) would fail
    # large all-at-once runs with "too many open files".
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = sockets + 256
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(want, hard),
                                                        hard))
    except (ImportError, ValueError, OSError):
        pass


async def benchmark(base: str, endpoint: Endpoint, model: str | None, api_key: str | None,
                    convs: list[Conversation], request_rate: float, max_concurrency: int | None, timeout: float,
                    seed: int, ignore_eos: bool = True) -> tuple[str, list[RequestResult], float]:
    """Run every conversation against the server; (model, results in conversation/turn order, duration s)."""
    import httpx
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # At most one request per conversation is in flight, so this many connections never queue in the pool.
    cap = min(max_concurrency or len(convs), len(convs))
    _raise_fd_limit(cap)
    limits = httpx.Limits(max_connections=cap, max_keepalive_connections=cap)
    results = [[RequestResult(i, t, c.output_lens[t]) for t in range(len(c.turns))] for i, c in enumerate(convs)]
    async with httpx.AsyncClient(http1=True, http2=False, limits=limits, timeout=httpx.Timeout(timeout)) as client:
        model = await _first_model(client, base, headers, model)
        url = base + PATHS[endpoint]
        gate = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
        offsets = arrival_offsets(len(convs), request_rate, seed)
        progress = _progress(sum(len(c.turns) for c in convs))

        async def converse(i: int, conv: Conversation) -> None:
            await asyncio.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
            replies: list[str] = []
            for t, res in enumerate(results[i]):
                body = request_body(endpoint, model, conv, t, replies, ignore_eos)
                async with gate:
                    await send_request(client, url, headers, body, endpoint, timeout, res)
                progress.update(1)
                if not res.ok:
                    for later in results[i][t + 1:]:  # a history with a hole in it is not worth sending
                        later.error = f"not sent: turn {t + 1} of this conversation failed"
                        later.sent = later.end = res.end
                    progress.update(len(results[i]) - t - 1)
                    return
                replies.append(res.text)

        start = time.perf_counter()
        await asyncio.gather(*(converse(i, c) for i, c in enumerate(convs)))
        duration = time.perf_counter() - start
        progress.close()
    return model, [r for conv in results for r in conv], duration


def _progress(total: int):
    from tqdm import tqdm
    return tqdm(total=total, desc="requests", disable=None)  # None: only on a terminal


def _stats(seconds: list[float], name: str) -> dict:
    """mean / median / p99 of `seconds`, in milliseconds; None when there is nothing to measure."""
    if not seconds:
        return {f"mean_{name}_ms": None, f"median_{name}_ms": None, f"p99_{name}_ms": None}
    ms = np.asarray(seconds) * 1000
    return {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
            f"p99_{name}_ms": float(np.percentile(ms, 99))}


def summarize(results: list[RequestResult], duration: float) -> dict:
    """Counts, throughputs (per second of `duration`) and latency statistics (ms) over the completed requests."""
    ok = [r for r in results if r.ok]
    failed = sorted((r for r in results if not r.ok), key=lambda r: r.end)
    inp, out = sum(r.input_tokens for r in ok), sum(r.output_tokens for r in ok)
    return {
        "completed": len(ok), "failed": len(failed), "first_error": failed[0].error if failed else None,
        "duration_s": duration, "total_input_tokens": inp, "total_output_tokens": out,
        "request_throughput": len(ok) / duration, "output_throughput": out / duration,
        "total_token_throughput": (inp + out) / duration,
        "usage_reported": sum(r.usage_reported for r in ok),
        # Servers that ignore `ignore_eos` stop early; the throughput is then not the requested work.
        "output_len_mismatches": sum(r.output_tokens != r.max_tokens for r in ok),
        **_stats([r.ttft for r in ok if r.chunk_times], "ttft"),
        **_stats([(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.chunk_times and r.output_tokens > 1],
                 "tpot"),
        **_stats([b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])], "itl"),
        **_stats([r.latency for r in ok], "e2el"),
    }


def _per_request(r: RequestResult) -> dict:
    ms = lambda s: None if s is None else s * 1000  # noqa: E731
    return {"conversation": r.conversation, "turn": r.turn, "ok": r.ok, "error": r.error or None,
            "max_tokens": r.max_tokens, "input_tokens": r.input_tokens, "output_tokens": r.output_tokens,
            "content_chunks": len(r.chunk_times), "ttft_ms": ms(r.ttft), "e2el_ms": ms(r.latency) if r.ok else None}


def wait_until_serving(url: str, proc, timeout: float = 300, path: str = "/health", ready=None) -> None:
    """Poll GET url + path until `ready(response)` holds (default: status 200), for a server started as `proc` (a
    Popen). RuntimeError if the process exits first or `timeout` seconds pass; a response `ready` cannot read (not
    up yet, half up) counts as not ready."""
    import httpx
    ready = ready or (lambda r: r.status_code == 200)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} before it was ready")
        try:
            if ready(httpx.get(f"{url}{path}", timeout=5)):
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server at {url} was not ready after {timeout:.0f} s")


def add_args(p: argparse.ArgumentParser) -> None:
    """The flags of `kvcache bench serve` (all of them; it needs no engine flags)."""
    p.add_argument("--url", default="http://127.0.0.1:8000",
                   help="server base URL (a trailing /v1 is fine) (default: %(default)s)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="completions: POST /v1/completions with prompt text; chat: /v1/chat/completions with messages "
                        "(default: %(default)s)")
    p.add_argument("--model", default=None, help="model name sent in requests (default: first of GET /v1/models)")
    p.add_argument("--api-key", default=None, help="sent as a Bearer token (default: $OPENAI_API_KEY)")
    p.add_argument("--workload", choices=["random", "shared-prefix", "multi-turn"], default="random",
                   help="random prompts; groups of prompts sharing a prefix; or conversations whose turns resend the "
                        "history (default: %(default)s)")
    p.add_argument("--num-prompts", type=int, default=64, help="random: requests (default: %(default)s)")
    p.add_argument("--input-len", default="64:512",
                   help="random: prompt length range A:B (words, about tokens) (default: %(default)s)")
    p.add_argument("--output-len", default=None, help="max_tokens; random: a range A:B (default 32:256); "
                   "shared-prefix / multi-turn: one number (default 64)")
    p.add_argument("--shared-prefix-len", type=int, default=0,
                   help="random: words prepended identically to every prompt (default: %(default)s)")
    p.add_argument("--num-groups", type=int, default=4,
                   help="shared-prefix: groups sharing a prefix (default: %(default)s)")
    p.add_argument("--requests-per-group", type=int, default=16,
                   help="shared-prefix: requests per group (default: %(default)s)")
    p.add_argument("--prefix-len", type=int, default=512,
                   help="shared-prefix: prefix words; multi-turn: system prompt words (default: %(default)s)")
    p.add_argument("--suffix-len", type=int, default=64, help="shared-prefix: words of each request's own suffix; "
                   "multi-turn: words of each user message (default: %(default)s)")
    p.add_argument("--shuffle", action="store_true", help="shared-prefix: send the requests in a seeded random "
                   "order (default: request i of group i %% G, the groups in a cycle); multi-turn: the conversations "
                   "start in such an order")
    p.add_argument("--num-conversations", type=int, default=8,
                   help="multi-turn: conversations (default: %(default)s)")
    p.add_argument("--num-system-prompts", type=int, default=1, help="multi-turn: conversation i is behind system "
                   "prompt i %% S (default 1: one shared by all)")
    p.add_argument("--num-turns", type=int, default=4,
                   help="multi-turn: turns per conversation (default: %(default)s)")
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (multi-turn: "
                   "conversation starts); default inf: all at once")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="at most this many requests in flight (default: no limit)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds one request may take, start to [DONE] (default: %(default)s)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="send ignore_eos so output lengths are exact (vLLM, kvcache); off for servers that refuse it "
                        "(default: on)")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the prompts, lengths and arrival times (default: %(default)s)")
    p.add_argument("--json", default=None, help="write the results here (default: not written)")


def _conversations(args: argparse.Namespace) -> tuple[list[Conversation], dict]:
    """The workload's conversations and its description for the report."""
    if args.workload == "random":
        inp, out = parse_range(args.input_len), parse_range(args.output_len or "32:256")
        convs = random_conversations(args.num_prompts, inp, out, args.shared_prefix_len, args.seed)
        return convs, {"name": "random", "num_prompts": args.num_prompts, "input_len": args.input_len,
                       "output_len": args.output_len or "32:256", "shared_prefix_len": args.shared_prefix_len}
    lo, hi = parse_range(args.output_len or "64")
    if lo != hi:
        raise ValueError(f"--workload {args.workload} takes one --output-len, not a range; got {args.output_len!r}")
    if args.workload == "shared-prefix":
        convs = shared_prefix_conversations(args.num_groups, args.requests_per_group, args.prefix_len, args.suffix_len,
                                            lo, args.seed, args.shuffle)
        return convs, {"name": "shared-prefix", "groups": args.num_groups,
                       "requests_per_group": args.requests_per_group, "shuffle": args.shuffle,
                       "prefix_len": args.prefix_len, "suffix_len": args.suffix_len, "output_len": lo}
    convs = multi_turn_conversations(args.num_conversations, args.num_turns, args.prefix_len, args.suffix_len, lo,
                                     args.seed, args.num_system_prompts, args.shuffle)
    return convs, {"name": "multi-turn", "conversations": args.num_conversations, "turns": args.num_turns,
                   "system_prompts": args.num_system_prompts, "shuffle": args.shuffle,
                   "system_prompt_len": args.prefix_len, "user_len": args.suffix_len, "output_len": lo}


def run(args: argparse.Namespace) -> int:
    """Benchmark the server, print the table, write JSON. 0 if any request completed, 1 if none did."""
    report = measure(args)
    if args.json:
        write_json(args.json, report)
    return 0 if report["completed"] else 1


def measure(args: argparse.Namespace) -> dict:
    """Benchmark the server and print the table; the report (what --json writes)."""
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 requests/s (inf: all at once), got {args.request_rate}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if not args.timeout > 0:
        raise ValueError(f"--timeout must be > 0 seconds, got {args.timeout}")
    base = args.url.rstrip("/")
    base = base[:-3] if base.endswith("/v1") else base
    if not base.startswith(("http://", "https://")):
        raise ValueError(f"--url must start with http:// or https://, got {args.url!r}")
    convs, workload = _conversations(args)
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    model, results, duration = asyncio.run(benchmark(base, args.endpoint, args.model, api_key, convs,
                                                     args.request_rate, args.max_concurrency, args.timeout, args.seed,
                                                     args.ignore_eos))
    report = {
        "config": {"url": base, "endpoint": args.endpoint, "model": model, "workload": workload, "seed": args.seed,
                   # JSON has no infinity; vLLM writes "inf" too
                   "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
                   "max_concurrency": args.max_concurrency, "timeout_s": args.timeout, "ignore_eos": args.ignore_eos},
        **summarize(results, duration),
        "requests": [_per_request(r) for r in results],
    }
    _print_table(report)
    return report


def _print_table(r: dict) -> None:
    c = r["config"]
    print("\nworkload: " + ", ".join(f"{k} {v}" for k, v in c["workload"].items()) + f", seed {c['seed']}")
    print(f"server: {c['url']}{PATHS[c['endpoint']]}, model {c['model']}; request rate {c['request_rate']}/s, "
          f"max concurrency {c['max_concurrency'] or 'none'}")
    rows = [("completed / failed requests", f"{r['completed']:,} / {r['failed']:,}"),
            ("duration s", f"{r['duration_s']:.2f}"),
            ("input / output tokens", f"{r['total_input_tokens']:,} / {r['total_output_tokens']:,}"),
            ("request throughput req/s", f"{r['request_throughput']:.2f}"),
            ("output token throughput tok/s", f"{r['output_throughput']:.1f}"),
            ("total token throughput tok/s", f"{r['total_token_throughput']:.1f}")]
    for name, value in rows:
        print(f"{name:<32}{value:>16}")
    head = f"{'ms':<8}{'mean':>12}{'median':>12}{'p99':>12}"
    print(head)
    print("-" * len(head))
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    for label, key in (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2E", "e2el")):
        print(f"{label:<8}{fmt(r[f'mean_{key}_ms']):>12}{fmt(r[f'median_{key}_ms']):>12}{fmt(r[f'p99_{key}_ms']):>12}")
    if r["failed"]:
        print(f"\n{r['failed']:,} requests failed; first error: {r['first_error']}")
    if r["completed"] and r["usage_reported"] < r["completed"]:
        print(f"note: {r['completed'] - r['usage_reported']:,} responses had no usage; their output tokens are "
              f"content chunks and their input tokens prompt words")
    if r["output_len_mismatches"]:
        print(f"note: {r['output_len_mismatches']:,} completed requests returned other than max_tokens tokens "
              f"(does the server honour ignore_eos?)")
