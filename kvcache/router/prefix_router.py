"""Which replica a request goes to: PrefixRouter (SGLang's cache-aware rule over the replicas' KV events and what
was sent to each), and prefix_keys, the approximate keys of a request the engine's block hashes cannot key."""
from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import OrderedDict

from kvcache.memory.kv_events import MEDIUM_POOL

log = logging.getLogger("kvcache")
Key = bytes | int  # a prefix key: the engine's block hash (EngineKeys), or prefix_keys' approximation
TOKEN_BLOCK, CHAR_BLOCK = 16, 64
INDEX_ENTRIES = 200_000  # chain hashes the router remembers (least recently routed forgotten first)


def prefix_keys(body: dict) -> list[bytes]:
    """An approximate chain of block hashes of a request's prompt, for requests EngineKeys cannot hash as the engine
    does: key i covers the first i + 1 blocks (16 token ids, or 64 characters of text or of the chat messages'
    JSON)."""
    prompt = body.get("prompt", body.get("messages"))
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        prompt = prompt[0]  # a batch of prompts: route by the first
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        blocks = [",".join(map(str, prompt[i:i + TOKEN_BLOCK])).encode() for i in range(0, len(prompt), TOKEN_BLOCK)]
    else:
        text = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)
        blocks = [text[i:i + CHAR_BLOCK].encode() for i in range(0, len(text), CHAR_BLOCK)]
    keys, h = [], hashlib.sha256(str(body.get("model")).encode()).digest()
    for b in blocks:
        h = hashlib.sha256(h + b).digest()
        keys.append(h)
    return keys


class PrefixRouter:
    """Which replica a request goes to (no I/O: the ingress keeps the in-flight counts and KV usage it reads, and
    feeds each replica's KV events to `apply`; one thread calls every method).

    KV-aware, SGLang's cache-aware rule (its router's and vllm-router's default) at this scale:
    - a request whose longest prefix some replica holds (at least CACHE_SHARE of its blocks) goes to that replica,
      unless it has more than `balance` requests in flight above the least-loaded one: then to the least loaded;
    - any other request (a new prefix) goes to the replica holding the fewest prefix blocks (its "smallest tree"),
      so that distinct prefixes spread evenly over the replicas' caches instead of piling where load last dipped;
    - ties go to the least loaded, then the least KV usage.
    A prefix every replica holds (a common system prompt) matches everywhere alike, so those requests spread by load.

    What a replica holds is the union of two records, disjoint per replica:
    - `stored`: the block hashes its pool ("GPU" medium; the offload tiers' media are not counted) holds, from its
      KV events (BlockStored adds, BlockRemoved removes, AllBlocksCleared clears). A batch whose sequence number
      does not follow the last one (batches were lost, and the replay could not give them back) clears it, to be
      rebuilt from that batch on.
    - `recent`: keys sent to it that its events have not confirmed yet (a prefill takes time), or that can never be
      (the text keys of `prefix_keys`, for requests the ingress cannot hash as the engine does). An event for a key
      settles it: BlockStored moves it to `stored`, BlockRemoved drops it. What stays is bounded by the replica's
      pool (`set_pool`; SGLang's router bounds its trees alike): past it the least recently sent keys are dropped, a
      chain's last blocks first, as the replica's own LRU gives them back. A gap leaves it as it is.
    `forget` (the replica restarted, or could not be reached) clears both."""

    CACHE_SHARE = 0.5  # SGLang's --cache-threshold default

    def __init__(self, num_replicas: int, policy: str = "kv-aware", balance: float = 4,
                 block_size: int = TOKEN_BLOCK) -> None:
        check_routing(policy, balance)
        self.n, self.policy, self.balance, self.block_size = num_replicas, policy, balance, block_size
        self.index: OrderedDict[Key, int] = OrderedDict()  # key sent -> bit mask of the replicas `recent` holds it in
        self.recent: list[OrderedDict[Key, None]] = [OrderedDict() for _ in range(num_replicas)]  # LRU per replica
        self.stored: list[set[int]] = [set() for _ in range(num_replicas)]  # per replica, from its KV events
        self.next_seq: list[int | None] = [None] * num_replicas  # the sequence number each one's next batch carries
        self.capacity: list[int | None] = [None] * num_replicas  # blocks each replica's pool holds (None: unknown)
        self.inflight = [0] * num_replicas
        self.kv_usage = [0.0] * num_replicas
        self.down_until = [0.0] * num_replicas
        self.next = 0
        self.decisions = {"prefix": 0, "least_loaded": 0, "smallest_cache": 0, "round_robin": 0}
        self.resets = 0  # forget() calls that cleared something
        self.gaps = 0  # event batches that did not follow the last one

    @property
    def held(self) -> list[int]:
        """Prefix blocks recorded per replica (stored and sent, not yet confirmed)."""
        return [len(s) + len(r) for s, r in zip(self.stored, self.recent)]

    def up(self) -> list[int]:
        now = time.monotonic()
        live = [i for i in range(self.n) if self.down_until[i] <= now]
        return live or list(range(self.n))

    def holders(self, key: Key) -> int:
        """Bit mask of the replicas holding `key`, in either record."""
        mask = self.index.get(key, 0)
        for r, stored in enumerate(self.stored):
            if key in stored:
                mask |= 1 << r
        return mask

    def matched(self, keys: list[Key]) -> list[int]:
        """Per replica, how many leading blocks of `keys` it holds."""
        depth = [0] * self.n
        open_ = (1 << self.n) - 1  # replicas still matching
        for k in keys:
            open_ &= self.holders(k)
            if not open_:
                break
            for r in range(self.n):
                if open_ >> r & 1:
                    depth[r] += 1
        return depth

    def choose(self, keys: list[Key], exclude: set[int] = frozenset()) -> int:
        live = [i for i in self.up() if i not in exclude] or [i for i in range(self.n) if i not in exclude]
        if not live:
            raise RuntimeError("no replica left to try")
        if self.policy == "round-robin":
            for _ in range(self.n):
                i, self.next = self.next, (self.next + 1) % self.n
                if i in live:
                    self.decisions["round_robin"] += 1
                    return i
        depth = self.matched(keys)
        least = min(self.inflight[r] for r in live)
        deepest = max(depth[r] for r in live)
        if keys and deepest >= self.CACHE_SHARE * len(keys):
            holders = [r for r in live if depth[r] == deepest]
            near = [r for r in holders if self.inflight[r] - least <= self.balance]
            if near:
                self.decisions["prefix"] += 1
                return min(near, key=lambda r: (self.inflight[r], self.kv_usage[r]))
            self.decisions["least_loaded"] += 1
            return min(live, key=lambda r: (self.inflight[r], self.kv_usage[r]))
        self.decisions["smallest_cache"] += 1
        held = self.held
        return min(live, key=lambda r: (held[r], self.inflight[r], self.kv_usage[r]))

    def routed(self, keys: list[Key], replica: int) -> None:
        """Remember that `replica` was sent these prefixes (the most recently used of its blocks, the chain's first
        ones most of all), those its events have not shown it holding, forgetting what its pool can no longer hold."""
        bit, recent, stored = 1 << replica, self.recent[replica], self.stored[replica]
        for k in reversed(keys):
            if k in stored:
                continue
            self.index[k] = self.index.get(k, 0) | bit
            self.index.move_to_end(k)
            recent[k] = None
            recent.move_to_end(k)
        self._trim(replica)
        while len(self.index) > INDEX_ENTRIES:
            k, mask = self.index.popitem(last=False)
            for r in range(self.n):
                if mask >> r & 1:
                    del self.recent[r][k]

    def apply(self, replica: int, seq: int, events: list) -> None:
        """One batch of `replica`'s KV events, numbered `seq`, as kv_index.decode_batch gives them."""
        if self.next_seq[replica] not in (None, seq):
            log.info("replica %d's KV events jumped from batch %d to %d: rebuilding its %d stored blocks from here",
                     replica, self.next_seq[replica], seq, len(self.stored[replica]))
            self.stored[replica].clear()
            self.gaps += 1
        self.next_seq[replica] = seq + 1
        stored = self.stored[replica]
        for event in events:
            if event[0] == "AllBlocksCleared":
                stored.clear()
            elif event[-1] == MEDIUM_POOL:  # BlockStored or BlockRemoved, of the pool
                (stored.update if event[0] == "BlockStored" else stored.difference_update)(event[1])
                for h in event[1]:
                    self._unsend(replica, h)

    def set_pool(self, replica: int, tokens: int) -> None:
        """`replica`'s KV pool holds `tokens` tokens: its record of keys sent keeps at most that many blocks' worth
        (a text key covers CHAR_BLOCK characters: about TOKEN_BLOCK tokens of English text)."""
        self.capacity[replica] = max(1, tokens // self.block_size)
        self._trim(replica)

    def _trim(self, replica: int) -> None:
        cap, recent = self.capacity[replica], self.recent[replica]
        while cap is not None and len(recent) > cap:
            k, _ = recent.popitem(last=False)
            self._unmask(replica, k)

    def _unsend(self, replica: int, key: Key) -> None:
        """Drop `key` from `replica`'s record of keys sent, if it is there."""
        if key in self.recent[replica]:
            del self.recent[replica][key]
            self._unmask(replica, key)

    def _unmask(self, replica: int, key: Key) -> None:
        mask = self.index[key] & ~(1 << replica)
        if mask:
            self.index[key] = mask
        else:
            del self.index[key]

    def forget(self, replica: int) -> int:
        """Drop everything recorded of `replica` (it lost its cache: restarted, or unreachable and so restarting),
        and expect its events afresh; returns how many blocks it held. Keys no other replica was sent leave the
        index."""
        held = self.held[replica]
        for k in self.recent[replica]:
            self._unmask(replica, k)
        self.recent[replica].clear()
        self.stored[replica].clear()
        self.next_seq[replica] = None
        if held:
            self.resets += 1
        return held


def check_routing(policy: str, balance: float) -> None:
    """ValueError unless the router can take this policy and balance."""
    if policy not in ("kv-aware", "round-robin"):
        raise ValueError(f"routing must be kv-aware or round-robin, got {policy!r}")
    if not balance >= 0:  # NaN too
        raise ValueError(f"routing balance must be >= 0, got {balance}")

