"""What `GET /kv/snapshot` returns and the KV page draws: every block's state, the requests that hold them, the
prefix cache's largest subtrees (radix) or chains (hash), and the health figures `kvcache top` shows.

`capture` runs on the engine thread (it reads the block pool, the tables and the tree, which only that thread
changes) and copies: the pool's per-block lists, the tables, the radix tree's groups (O(blocks) list copies and
O(tree nodes)); `build` turns the copies into the schema below off that thread, as the health figures and the
JSON are; `SnapshotHub` takes at most one per interval, whatever the number of viewers.

Schema (version 1), every count in blocks unless named otherwise:
- `time` (Unix seconds), `took_ms` (how long `take` held the engine thread), `interval_s`, `model`;
- `pool`: `num_blocks` (block ids 0..num_blocks-1, 0 the null block), `block_size`, `prefix_caching` (null, "hash"
  or "radix"), `kv_format` (the storage format of every block: one per pool), and the count of each state;
- `states`: one character per block id: `n` null, `.` free, `u` held by one sequence, `s` shared by several,
  `c` cached and idle (findable by a prefix hit, evictable), `p` private (a KIVI key residual); `U` and `S` are `u`
  and `s` blocks that are also registered in the prefix cache; `P` pinned (`--kv-pin-prefix`: cached for ever,
  whether a request uses it now or not);
- `hashes`: {block id: the first 8 hex digits of its chain hash} for held blocks registered in the prefix cache
  (hash mode; the radix tree keys its nodes by tokens; an idle cached block is shown by its chain), `hits`: {block id: prefix-cache hits since it was last handed out}
  for blocks with any;
- `requests`: [{`id`, `status`, `prompt_tokens`, `prefix_hit_tokens` (found cached at admission), `text` (only with
  `--kv-page-show-text`, its first 2,000 characters), `seqs`: [{`index`, `blocks` (its table, 0 where a window gave a block back), `slots`
  (tokens in its cache: a block's fill is min(block_size, slots - i x block_size)), `tokens`, `private` (blocks),
  `eviction` (policy and tokens evicted, or null)}], `kv_degradation` (what memory pressure did to it so far:
  RequestOutput.kv_degradation's counts)};
- `prefix`: {`mode`, `groups`: the largest subtrees, each {`blocks`, `hits`, `age` (lookups since its last use, radix)
  or `lru` (free-list position of its first idle block: 0 is evicted first, hash), `held` (blocks a sequence holds),
  `nodes` (radix: [{`depth`, `blocks`, `hits`, `age`, `locked`}], the subtree's top nodes)}]};
- `health`: `kvcache top`'s figures (server/top.py `snapshot`) and `warnings`, `history`: their recent values.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque

import numpy as np

from kvcache.engine.outputs import kv_degradation
from kvcache.memory.block_pool import BlockPool

VERSION = 1
# by code: null, free, used, shared, cached idle, used and cached, shared and cached, private, pinned
STATES = "n.uscUSpP"
MAX_GROUPS = 16  # prefix subtrees or chains listed, the largest first
MAX_NODES = 24  # radix nodes listed per subtree
HISTORY = 600  # health samples kept (10 minutes at the default 1 s interval)
TEXT_CHARS = 2000  # of a prompt's text, with --kv-page-show-text


def take(engine, show_text: bool = False) -> dict:
    """The engine's KV state now, in one call (tests, benchmarks): `build(capture(engine))`."""
    return build(capture(engine, show_text))


def capture(engine, show_text: bool = False) -> dict:
    """What a snapshot needs, copied (call on the engine thread: only it changes these): the pool's per-block
    lists, its free list's order, the requests' tables, the radix tree's groups (walked here, as its nodes change).
    The per-block work of turning that into the schema is `build`'s, off the engine thread."""
    started = time.perf_counter()
    kv, pool = engine.kv, engine.kv.pool
    raw = {
        "time": time.time(), "num_blocks": pool.num_blocks, "block_size": kv.block_size,
        "prefix_caching": kv.prefix_caching, "kv_format": engine.kv_dtype,
        "pinned": sorted(pool.pinned),
        "keys": None if kv.radix else list(pool.keys),  # BlockKeys are immutable: a shallow copy is a snapshot
        "generation": None if kv.radix else list(pool.generation),
        "free_order": None if kv.radix else list(pool._free),
        "hits": list(pool.hits),
        "requests": _requests(engine, show_text),
    }
    # the radix tree's nodes change: its groups, and the blocks it holds, are taken in one walk here
    raw["prefix"], raw["tree_blocks"] = _radix_groups(kv) if kv.radix else (None, None)
    raw["took_ms"] = (time.perf_counter() - started) * 1000
    return raw


def build(raw: dict) -> dict:
    """The snapshot (the module docstring's schema) from `capture`'s copies; any thread."""
    n, keys = raw["num_blocks"], raw["keys"]
    tables = [q["blocks"] for r in raw["requests"] for q in r["seqs"]]
    held = np.bincount(np.fromiter((b for t in tables for b in t), dtype=np.int64), minlength=n)[:n] \
        if any(tables) else np.zeros(n, dtype=np.int64)
    held[BlockPool.NULL_BLOCK] = 0
    registered = np.zeros(n, dtype=bool)
    cached = raw["tree_blocks"] if keys is None else [b for b, k in enumerate(keys) if k is not None]
    if cached and raw["prefix_caching"]:
        registered[cached] = True
    state = np.full(n, 1, dtype=np.int8)  # free
    state[registered] = 4  # cached and idle: findable, held by nobody but the tree (or nobody)
    state[held == 1] = 2
    state[held > 1] = 3
    state[(held == 1) & registered] = 5
    state[(held > 1) & registered] = 6
    for r in raw["requests"]:
        for q in r["seqs"]:
            state[q["private"]] = 7
    state[raw["pinned"]] = 8
    state[BlockPool.NULL_BLOCK] = 0
    table = np.frombuffer(STATES.encode(), dtype=np.uint8)
    hits = np.asarray(raw["hits"], dtype=np.int64)
    names = ("null", "free", "used", "shared", "cached", "used_cached", "shared_cached", "private", "pinned")
    return {
        "version": VERSION, "time": raw["time"], "took_ms": raw["took_ms"],
        "pool": {"num_blocks": n, "block_size": raw["block_size"], "prefix_caching": raw["prefix_caching"],
                 "kv_format": raw["kv_format"],
                 **{name: int(c) for name, c in zip(names, np.bincount(state, minlength=len(names)))}},
        "states": table[state].tobytes().decode(),
        # held blocks' hashes (an idle cached block is shown by its chain in `prefix`): a few per request, not
        # one per cached block of a full pool
        "hashes": {} if keys is None else {str(b): f"{keys[b].hash & 0xFFFFFFFF:08x}"
                                           for b in np.flatnonzero(registered & (held > 0)).tolist()},
        "hits": {str(int(b)): int(hits[b]) for b in np.flatnonzero(hits)},
        "requests": raw["requests"],
        "prefix": raw["prefix"] if raw["prefix"] is not None else _hash_groups(raw, cached, held),
    }


def _requests(engine, show_text: bool) -> list[dict]:
    kv, out = engine.kv, []
    for rid, req in engine.requests.items():
        running = [s for s in req.seqs if not s.is_finished]
        if not running:
            continue
        item = {"id": rid, "status": running[0].status.value, "prompt_tokens": len(req.prompt_token_ids),
                "prefix_hit_tokens": req.seqs[0].num_cached_tokens, "kv_degradation": kv_degradation(req.seqs),
                "seqs": []}
        if show_text:  # bounded: this runs on the engine thread
            item["text"] = req.prompt[:TEXT_CHARS] if req.prompt is not None else \
                engine.tokenizer.decode(req.prompt_token_ids[:TEXT_CHARS // 4])[:TEXT_CHARS]
        for s in running:
            ev = s.eviction
            item["seqs"].append({
                "index": s.index, "blocks": [b for t in kv.tables(s.seq_id) for b in t],  # every layer group's
                "slots": s.num_computed_tokens - s.num_evicted, "tokens": s.num_tokens,
                "private": list(kv.private_blocks.get(s.seq_id, [])),
                "eviction": {"policy": ev.policy.name, "evicted": ev.num_evicted} if ev else None})
        out.append(item)
    return out


def _radix_groups(kv) -> tuple[dict, list[int]]:
    """The tree's largest subtrees (children of the roots), each with its top nodes, largest first; and every
    block the tree holds (the same walk)."""
    tree, pool = kv.radix, kv.pool
    # ages in lookups, counted from the latest one (reading the tree's clock would tick it)
    now = max((r.last_access for r in tree.roots.values()), default=0)
    size: dict[int, int] = {}
    held_blocks: list[int] = []

    def subtree(node) -> int:  # iterative post-order: the tree can be deep
        stack, order = [node], []
        while stack:
            x = stack.pop()
            order.append(x)
            held_blocks.extend(x.blocks)
            stack.extend(x.children.values())
        for x in reversed(order):
            size[id(x)] = len(x.blocks) + sum(size[id(c)] for c in x.children.values())
        return size[id(node)]

    groups = []
    for root in tree.roots.values():
        for child in root.children.values():
            groups.append((subtree(child), child))
    groups.sort(key=lambda g: -g[0])
    out = []
    for blocks, top in groups[:MAX_GROUPS]:
        nodes, stack = [], [(top, 0)]
        while stack and len(nodes) < MAX_NODES:
            node, depth = stack.pop()
            nodes.append({"depth": depth, "blocks": len(node.blocks), "subtree": size[id(node)],
                          "hits": pool.hits[node.blocks[0]] if node.blocks else 0, "age": now - node.last_access,
                          "locked": node.lock_ref > 0, "first_block": node.blocks[0] if node.blocks else None})
            kids = sorted(node.children.values(), key=lambda c: size[id(c)])
            stack.extend((c, depth + 1) for c in kids)
        out.append({"blocks": blocks, "hits": nodes[0]["hits"], "age": nodes[0]["age"],
                    "held": sum(pool.ref_counts[b] > 1 for b in top.blocks), "nodes": nodes})
    return {"mode": "radix", "num_groups": len(groups), "groups": out}, held_blocks


def _hash_groups(raw: dict, cached: list[int], held: np.ndarray) -> dict:
    """Cached blocks grouped by the first block of their chain (a parent link is followed while the parent
    still holds the block it held: same id, same generation), largest first. The roots come from pointer jumping
    over a parent array (log of the longest chain passes), not a walk per block."""
    keys, generation = raw["keys"], raw["generation"]
    if not raw["prefix_caching"] or not cached:
        return {"mode": "hash" if raw["prefix_caching"] else None, "num_groups": 0, "groups": []}
    n = len(keys)
    parent = np.arange(n)
    for b in cached:
        p = keys[b].parent
        if p is not None and keys[p[0]] is not None and generation[p[0]] == p[1]:
            parent[b] = p[0]
    while True:
        up = parent[parent]
        if np.array_equal(up, parent):
            break
        parent = up
    ids = np.asarray(cached)
    roots, sizes = np.unique(parent[ids], return_counts=True)
    order = np.argsort(-sizes, kind="stable")[:MAX_GROUPS]
    lru = np.full(n, -1)
    free = np.asarray(raw["free_order"], dtype=np.int64)
    if free.size:
        lru[free] = np.arange(free.size)
    hits = raw["hits"]
    out = []
    for i in order:
        first = int(roots[i])
        members = ids[parent[ids] == first]
        idle = lru[members]
        idle = idle[idle >= 0]
        out.append({"first_block": first, "hash": f"{keys[first].hash & 0xFFFFFFFF:08x}", "blocks": int(sizes[i]),
                    "hits": hits[first], "held": int((held[members] > 0).sum()),
                    "lru": int(idle.min()) if idle.size else None})
    return {"mode": "hash", "num_groups": len(roots), "groups": out}


class SnapshotHub:
    """Snapshots for every viewer, at most one taken per `interval_s`: `get()` (on the event loop) returns the
    latest if it is fresh, else asks the engine thread for one (`request` puts a command on its queue) and waits;
    concurrent callers share that one. The health figures are added here, off the engine thread, from the metrics
    (`health()`), and kept in a short history."""

    def __init__(self, request, health, interval_s: float = 1.0, build_raw=build) -> None:
        self.request = request  # (future, loop) -> None: the engine thread will take a snapshot and settle it
        self.build_raw = build_raw  # what the request settles with -> the snapshot (`build`; the engine process
        # sends its snapshots built)
        self.health = health  # () -> dict: kvcache top's figures and warnings now
        self.interval_s = interval_s
        self.latest: dict | None = None
        self.taken = 0  # snapshots the engine thread took (tests: viewers do not multiply them)
        self.json_text: tuple[dict, str] | None = None  # (snapshot, its JSON): serialized once for every viewer
        self._pending: asyncio.Task | None = None
        self.history: deque[dict] = deque(maxlen=HISTORY)
        self._lock = threading.Lock()

    async def get(self) -> dict:
        if self.latest is not None and time.time() - self.latest["time"] < self.interval_s:
            return self.latest
        if self._pending is None or self._pending.done():  # one task takes it, every caller awaits that task
            self._pending = asyncio.ensure_future(self._take())
        return await asyncio.shield(self._pending)

    async def _take(self) -> dict:
        """A snapshot from the engine thread, with the health figures and their history added off it."""
        loop = asyncio.get_running_loop()
        taken = loop.create_future()
        self.request(taken, loop)  # settled with capture()'s copies
        snap = dict(await asyncio.to_thread(self.build_raw, await taken), interval_s=self.interval_s)
        snap["health"] = await asyncio.to_thread(self.health)
        self.record(snap["health"])
        with self._lock:  # the history thread appends meanwhile: a deque cannot be iterated while it grows
            snap["history"] = list(self.history)
        self.latest = snap
        self.taken += 1
        return snap

    def record(self, health: dict) -> None:
        """One history sample of the figures the page charts."""
        with self._lock:
            self.history.append({k: health.get(k) for k in ("time", "kv_usage", "prefix_hit_rate", "fragmentation",
                                                             "running", "waiting", "generation_tps", "prompt_tps")})
