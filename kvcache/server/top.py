"""`kvcache top`: a live terminal view of a server's load and KV cache health, read from its KV page's API.

Each poll reads `GET /kv/snapshot?part=health` (server/kv_page.py: the samples of the Prometheus text that
`ServerMetrics` serves, which the KV page shows through this module's `snapshot` too), or /metrics itself where
the page is off (`--no-kv-page`) or the server predates it. Gauges are shown as read; token
rates and latency means come from the growth of counters and histogram sums/counts between two
polls (the first poll, and `--once`, show latency means since the server started and no rates).
Warnings name the likely cause and the flag that addresses it.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvcache.engine.spec_decode import mean_acceptance_length

PREFIX = "kvcache:"
# When a figure deserves a warning. Fractions are 0..1; lengths are tokens.
THRESHOLDS = {
    "kv_usage": 0.95,  # above: the pool is nearly full, preemptions follow
    "fragmentation": 0.10,  # above: a tenth of allocated token slots sit empty
    "seq_len_mean": 16384,  # above: long contexts dominate the cache
    "prefix_hit_rate": 0.10,  # below (once anything was looked up): prefix caching is not paying off
}
CLEAR_SCREEN = "\x1b[H\x1b[2J"  # cursor home, then erase the screen
REQUEST_TIMEOUT_S = 5.0


class MetricsUnreachableError(ConnectionError):
    """The server's /metrics could not be fetched (refused, timed out, bad address)."""


def add_args(p: argparse.ArgumentParser) -> None:
    """The flags of `kvcache top`."""
    p.add_argument("--url", default="http://127.0.0.1:8000",
                   help="the server's base URL (its /kv/snapshot?part=health is read, else its /metrics) "
                        "(default: %(default)s)")
    p.add_argument("--api-key", default=os.environ.get("KVCACHE_API_KEY"),
                   help="the server's --api-key, for its KV page's API (default: env KVCACHE_API_KEY)")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between polls (default: %(default)s)")
    p.add_argument("--once", action="store_true", help="print one snapshot and exit (no screen clearing)")


def fetch_samples(client: httpx.Client, url: str, api_key: str | None = None) -> dict[str, float]:
    """This poll's samples: from the KV page's API (with the key, where the server has one), else /metrics.
    Raises MetricsUnreachableError, or ValueError on an HTTP error (401: the key is missing or wrong)."""
    target = f"{url}/kv/snapshot?part=health"
    resp = _get(client, target, {"Authorization": f"Bearer {api_key}"} if api_key else {})
    if resp.status_code == 404:  # no KV page here: the Prometheus text has the same figures
        return read_samples(fetch_metrics(client, url))
    if resp.status_code == 401:
        if not api_key:  # /metrics is open: the figures are there too, as before the KV page
            return read_samples(fetch_metrics(client, url))
        raise ValueError(f"{target} refused the API key given (--api-key or KVCACHE_API_KEY)")
    if resp.status_code != 200:
        raise ValueError(f"{target} answered HTTP {resp.status_code}; is this a kvcache server?")
    try:
        samples = resp.json()["samples"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{target} did not answer a KV snapshot; is this a kvcache server?") from None
    if not samples:
        raise ValueError("the metrics hold no kvcache: series; is this a kvcache server?")
    return samples


def _get(client: httpx.Client, target: str, headers: dict | None = None) -> httpx.Response:
    """GET `target`; MetricsUnreachableError if it cannot be reached (refused, timed out, bad host or scheme)."""
    try:
        return client.get(target, headers=headers)
    except httpx.TransportError as e:
        raise MetricsUnreachableError(f"cannot reach {target}: {str(e) or type(e).__name__}") from e


def fetch_metrics(client: httpx.Client, url: str) -> str:
    """The Prometheus text at `url`/metrics. Raises MetricsUnreachableError, or ValueError on an HTTP error."""
    target = f"{url}/metrics"
    resp = _get(client, target)
    if resp.status_code != 200:
        raise ValueError(f"{target} answered HTTP {resp.status_code}; is this a kvcache server?")
    return resp.text


def read_samples(text: str) -> dict[str, float]:
    """Sample name -> value, summed over label sets; a `state`, `finished_reason` or `tier` label stays in the key,
    as in `kvcache:kv_blocks{state=free}`. Raises ValueError if no kvcache metric is there."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.startswith(PREFIX) or "le" in s.labels:
                continue
            key = s.name
            for label in ("state", "finished_reason", "tier"):
                if label in s.labels:
                    key += f"{{{label}={s.labels[label]}}}"
            out[key] = out.get(key, 0.0) + s.value
    if not out:
        raise ValueError("the metrics hold no kvcache: series; is this a kvcache server?")
    return out


def snapshot(cur: dict[str, float], prev: dict[str, float] | None = None, dt_s: float | None = None,
             url: str = "") -> dict:
    """The figures `kvcache top` shows, from this poll's samples and, for rates, the previous poll's `dt_s`
    seconds before. Fractions 0..1, lengths in tokens, sizes in bytes, rates per second, latencies in
    seconds; None where not known (no previous poll, nothing finished in the window, missing metric)."""
    window = prev is not None and dt_s is not None and dt_s > 0

    def get(name: str) -> float | None:
        return cur.get(PREFIX + name)

    def delta(name: str) -> float | None:
        now, before = cur.get(PREFIX + name), (prev or {}).get(PREFIX + name)
        if now is None or before is None:
            return None
        return now - before if now >= before else now  # the server restarted: its counters too

    def rate(name: str) -> float | None:
        d = delta(name) if window else None
        return d / dt_s if d is not None else None

    def mean(hist: str) -> float | None:
        if window:
            s, n = delta(hist + "_sum"), delta(hist + "_count")
        else:
            s, n = get(hist + "_sum"), get(hist + "_count")
        return s / n if s is not None and n else None

    hit_rate = get("prefix_cache_hit_rate")
    if window:  # the window's rate when anything was looked up in it, else the lifetime one
        hits, queries = delta("prefix_cache_hits_total"), delta("prefix_cache_queries_total")
        if hits is not None and queries:
            hit_rate = hits / queries
    return {
        "url": url,
        "window_s": dt_s if window else None,
        "running": get("num_requests_running"),
        "waiting": get("num_requests_waiting"),
        "kv_usage": get("kv_cache_usage_perc"),
        "blocks_used": get("kv_blocks{state=used}"),
        "blocks_cached": get("kv_blocks{state=cached}"),
        "blocks_free": get("kv_blocks{state=free}"),
        "kv_bytes_used": get("kv_cache_bytes_used"),
        "kv_bytes_total": get("kv_cache_bytes_total"),
        "fragmentation": get("kv_block_fragmentation"),
        "seq_len_mean": get("running_seq_len_mean"),
        "seq_len_max": get("running_seq_len_max"),
        "prefix_hit_rate": hit_rate,
        "prefix_queries": get("prefix_cache_queries_total"),
        "preemptions": get("num_preemptions_total"),
        "preemptions_delta": delta("num_preemptions_total") if window else None,
        "prompt_tps": rate("prompt_tokens_total"),
        "generation_tps": rate("generation_tokens_total"),
        "ttft_mean_s": mean("time_to_first_token_seconds"),
        "e2e_mean_s": mean("e2e_request_latency_seconds"),
        "swapped_out": get("kv_swap_out_total"),
        "swapped_in": get("kv_swap_in_total"),
        "swap_fallbacks": get("kv_swap_fallbacks_total"),
        "tiers": _tiers(get, delta if window else None),
        "offload_loaded_blocks": get("kv_offload_loaded_blocks_total"),
        "offload_load_mean_s": mean("kv_offload_load_seconds"),
        "pressure_evicted_tokens": get("kv_pressure_evicted_tokens_total"),
        "pressure_evicted_delta": delta("kv_pressure_evicted_tokens_total") if window else None,
        "spec_drafts": get("spec_decode_num_drafts_total"),
        "spec_draft_tokens": get("spec_decode_num_draft_tokens_total"),
        "spec_accepted_tokens": get("spec_decode_num_accepted_tokens_total"),
    }


def _tiers(get, delta) -> list[dict]:
    """Per offload tier (in the server's order: cpu, disk, redis): bytes held, swap bytes, the hit rate over the
    window when it had lookups (else since start-up), blocks stored and errors."""
    out = []
    for tier in ("cpu", "disk", "redis"):
        key = f"{{tier={tier}}}"
        if get("kv_offload_hits_total" + key) is None:
            continue
        hits, misses = get("kv_offload_hits_total" + key), get("kv_offload_misses_total" + key) or 0.0
        if delta is not None:
            dh, dm = delta("kv_offload_hits_total" + key), delta("kv_offload_misses_total" + key)
            if dh is not None and dm is not None and dh + dm:
                hits, misses = dh, dm
        out.append({"tier": tier, "bytes_used": get("kv_offload_bytes_used" + key),
                    "swap_bytes": get("kv_swap_bytes" + key), "stored_blocks": get("kv_offload_stored_blocks_total" + key),
                    "hit_rate": hits / (hits + misses) if hits + misses else None,
                    "errors": get("kv_offload_errors_total" + key) or 0.0})
    return out


def warnings_for(snapshot: dict) -> list[str]:
    """One line per figure past its THRESHOLDS entry: what it is, the likely cause, the flags that address it."""
    t, out = THRESHOLDS, []
    usage = snapshot.get("kv_usage")
    if usage is not None and usage > t["kv_usage"]:
        out.append(f"KV cache usage {usage:.1%} is above {t['kv_usage']:.0%}: too many or too long concurrent "
                   "requests for the pool (preemptions follow). Raise --kv-cache-memory or "
                   "--gpu-memory-utilization, lower --max-num-seqs, or quantize the KV cache with --kv-cache-dtype.")
    frag = snapshot.get("fragmentation")
    if frag is not None and frag > t["fragmentation"]:
        out.append(f"{frag:.1%} of allocated KV token slots are empty (above {t['fragmentation']:.0%}): blocks are "
                   "much larger than sequences grow. Lower --block-size.")
    seq = snapshot.get("seq_len_mean")
    if seq is not None and seq > t["seq_len_mean"]:
        out.append(f"running sequences average {seq:,.0f} tokens (above {t['seq_len_mean']:,}): long contexts "
                   "dominate the cache. Cap them with --max-model-len, evict tokens with --kv-eviction, or "
                   "quantize with --kv-cache-dtype.")
    evicted = snapshot.get("pressure_evicted_delta")
    if evicted is None and snapshot.get("window_s") is None:  # a single scrape: since start-up
        evicted = snapshot.get("pressure_evicted_tokens")
    if evicted:
        out.append(f"the memory-pressure ladder evicted {evicted:,.0f} cached tokens of running requests "
                   f"{'in this window' if snapshot.get('window_s') else 'since start-up'}: the pool is too small for "
                   "the load, and those requests' outputs are degraded (each response's kv_degradation says how "
                   "much). Raise --kv-cache-memory, lower --max-num-seqs, or send kv_pressure \"exact\" for requests "
                   "that must not degrade.")
    hit, queries = snapshot.get("prefix_hit_rate"), snapshot.get("prefix_queries")
    if hit is not None and queries and hit < t["prefix_hit_rate"]:
        out.append(f"prefix cache hit rate {hit:.1%} is below {t['prefix_hit_rate']:.0%}: prompts share no "
                   "prefix, or the cache thrashes. Check --enable-prefix-caching, try --scheduling-policy lpm, or "
                   "give the cache more memory with --kv-cache-memory.")
    return out


def _num(v: float | None, fmt: str = ",.0f", suffix: str = "") -> str:
    return "-" if v is None else f"{v:{fmt}}{suffix}"


def _bytes(v: float | None) -> str:
    if v is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if v >= size:
            return f"{v / size:.2f} {unit}"
    return f"{v:.0f} B"


def render_snapshot(snapshot: dict) -> str:
    """The snapshot as a small table, then its warnings (see warnings_for)."""
    s = snapshot
    window = f"rates over the last {s['window_s']:.1f} s" if s.get("window_s") else \
        "no rates yet; latency means since start-up"
    pre = _num(s.get("preemptions"))
    if s.get("preemptions_delta") is not None:
        pre += f" (+{s['preemptions_delta']:,.0f})"
    rows = [
        ("Requests", f"running {_num(s.get('running'))}   waiting {_num(s.get('waiting'))}   preemptions {pre}"),
        ("KV cache", f"usage {_num(s.get('kv_usage'), '.1%')}   bytes {_bytes(s.get('kv_bytes_used'))} / "
                     f"{_bytes(s.get('kv_bytes_total'))}"),
        ("Blocks", f"used {_num(s.get('blocks_used'))}   cached {_num(s.get('blocks_cached'))}   "
                   f"free {_num(s.get('blocks_free'))}"),
        ("Fragmentation", _num(s.get("fragmentation"), ".1%")),
        ("Seq length", f"mean {_num(s.get('seq_len_mean'))}   max {_num(s.get('seq_len_max'))} tokens"),
        ("Prefix cache", f"hit rate {_num(s.get('prefix_hit_rate'), '.1%')}"),
        ("Throughput", f"prompt {_num(s.get('prompt_tps'), ',.1f')}   generation "
                       f"{_num(s.get('generation_tps'), ',.1f')} tokens/s"),
        ("Latency", f"TTFT mean {_num(s.get('ttft_mean_s'), '.3f', ' s')}   e2e mean "
                    f"{_num(s.get('e2e_mean_s'), '.3f', ' s')}"),
    ]
    if s.get("tiers"):
        rows.append(("Offload", f"{_num(s.get('offload_loaded_blocks'))} blocks loaded instead of recomputed   "
                                f"load mean {_num(s.get('offload_load_mean_s'), '.4f', ' s')}"))
    for t in s.get("tiers") or ():
        rows.append((f"  tier {t['tier']}", f"{_bytes(t['bytes_used'])} held ({_bytes(t['swap_bytes'])} swap)   hit "
                     f"rate {_num(t['hit_rate'], '.1%')}   stored {_num(t['stored_blocks'])}   errors "
                     f"{_num(t['errors'])}"))
    if s.get("swapped_out"):
        rows.append(("Swap", f"out {_num(s['swapped_out'])}   in {_num(s.get('swapped_in'))}   fell back to "
                             f"recompute {_num(s.get('swap_fallbacks'))}"))
    if s.get("spec_drafts"):
        drafts, proposed, accepted = s["spec_drafts"], s.get("spec_draft_tokens") or 0, s.get("spec_accepted_tokens") or 0
        rows.append(("Speculation", f"{_num(drafts)} proposals   accepted {_num(accepted)} of {_num(proposed)} tokens   "
                                    f"mean acceptance length {mean_acceptance_length(drafts, accepted):.2f}"))
    lines = [f"kvcache top  {s.get('url', '')}  ({window})", ""]
    lines += [f"{name:<14} {value}" for name, value in rows]
    warns = warnings_for(s)
    lines += ["", "Warnings:" if warns else "Warnings: none"] + [f"  ! {w}" for w in warns]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Poll `args.url`/metrics every `args.interval` seconds and redraw; with `args.once`, print once.

    Raises MetricsUnreachableError (an OSError) when the first poll fails; later failures are shown
    and retried, so that the view survives a server restart. Returns 0 (also on Ctrl-C).
    """
    if not args.interval > 0:
        raise ValueError(f"--interval must be a positive number of seconds, got {args.interval}")
    url = args.url.rstrip("/")
    if "://" not in url:
        url = "http://" + url
    prev: dict[str, float] | None = None
    prev_t = 0.0
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        try:
            while True:
                t = time.monotonic()
                try:
                    cur = fetch_samples(client, url, args.api_key)
                except (MetricsUnreachableError, ValueError) as e:
                    if prev is None or args.once:
                        raise
                    sys.stdout.write(f"{CLEAR_SCREEN}kvcache top  {url}: {e}\nretrying every {args.interval:g} s\n")
                    sys.stdout.flush()
                    time.sleep(args.interval)
                    continue
                text = render_snapshot(snapshot(cur, prev, t - prev_t if prev is not None else None, url))
                if args.once:
                    print(text)
                    return 0
                sys.stdout.write(CLEAR_SCREEN + text + "\n")
                sys.stdout.flush()
                prev, prev_t = cur, t
                time.sleep(max(0.0, args.interval - (time.monotonic() - t)))
        except KeyboardInterrupt:
            return 0
