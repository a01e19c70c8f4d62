"""Storage tiers below the engine's block pool: host memory, a directory, and a Redis (or Valkey) server.

A tier maps a key (bytes: a model fingerprint and a block's chain hash, see offloader.py) to a value (bytes: one
serialized block). Each has a capacity in bytes and drops its least recently used values to stay under it. I/O
faults never propagate: a failed put is dropped and a failed get is a miss, both counted by reason in `stats`.

The cpu and disk tiers also hold the KV of preempted sequences (`--preemption-mode swap`): `hold` keeps a value
outside the LRU, never dropped for room, until `take` hands it back; held bytes count against the capacity, and
the prefix values make room for them (least recently used first).
"""
from __future__ import annotations

import errno
import os
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class TierStats:
    hits: int = 0  # gets that found a value
    misses: int = 0  # gets that found none
    stored: int = 0  # values put
    bytes_in: int = 0  # bytes put
    bytes_out: int = 0  # bytes got
    errors: dict[str, int] = field(default_factory=dict)  # reason -> count (write, read, too_large, corrupt, ...)
    swapped_out: int = 0  # preempted sequences held (swap)
    swapped_in: int = 0  # of those, handed back
    swap_refused: int = 0  # holds refused for want of room (the sequence is recomputed instead)

    def error(self, reason: str) -> None:
        self.errors[reason] = self.errors.get(reason, 0) + 1

    @property
    def hit_rate(self) -> float:
        return self.hits / (self.hits + self.misses) if self.hits + self.misses else 0.0


class Tier:
    """What every tier offers. Methods are called from the engine thread and from the offloader's writer thread:
    each tier guards its own index."""

    name = "tier"
    medium = "TIER"  # what KV events call it

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"a {self.name} tier needs a positive capacity, got {capacity} bytes")
        self.capacity = capacity
        self.stats = TierStats()
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> value bytes, least recently used first
        self.used_bytes = 0  # of LRU values
        self._held: dict[bytes, int] = {}  # key -> bytes of values held for swap (outside the LRU)
        self.held_bytes = 0
        # Called with the keys dropped from the LRU to make room (the engine's KV events); None: nobody listens.
        self.on_drop: Callable[[list[bytes]], None] | None = None

    def get(self, key: bytes) -> bytes | None:
        raise NotImplementedError

    def put(self, key: bytes, value: bytes) -> bool:
        """Store `value` under `key`; True if this call stored it (False: already there, refused or failed)."""
        raise NotImplementedError

    def contains(self, key: bytes) -> bool:
        raise NotImplementedError

    def hold(self, key: bytes, value, size: int) -> bool:
        """Keep `value` (`size` bytes) under `key` until `take(key)`, outside the LRU; False (nothing kept) if the
        values already held leave no room for it. Only the cpu and disk tiers hold values."""
        raise NotImplementedError(f"the {self.name} tier does not hold swapped sequences")

    def take(self, key: bytes):
        """The value held under `key`, released from the tier; None if there is none (or it cannot be read)."""
        raise NotImplementedError(f"the {self.name} tier does not hold swapped sequences")

    def info(self) -> dict:
        s = self.stats
        return {"tier": self.name, "capacity_bytes": self.capacity, "used_bytes": self.used_bytes + self.held_bytes,
                "blocks": len(self._index), "hits": s.hits, "misses": s.misses, "hit_rate": s.hit_rate,
                "stored_blocks": s.stored, "bytes_in": s.bytes_in, "bytes_out": s.bytes_out, "errors": dict(s.errors),
                "swap_bytes": self.held_bytes, "swapped_sequences": len(self._held), "swapped_out": s.swapped_out,
                "swapped_in": s.swapped_in, "swap_refused": s.swap_refused}

    def _room(self, keep: int = 0) -> list[bytes]:
        """Drop LRU values (under the lock), leaving at least the `keep` newest, until they and the held ones fit;
        returns the keys dropped, oldest first."""
        dropped = []
        while self.used_bytes + self.held_bytes > self.capacity and len(self._index) > keep:
            old, n = self._index.popitem(last=False)
            self.used_bytes -= n
            dropped.append(old)
        return dropped

    def _admit(self, key: bytes, size: int) -> list[bytes]:
        """Account a new LRU value (under the lock); returns the keys dropped to make room, oldest first."""
        self._index[key] = size
        self.used_bytes += size
        return self._room(keep=1)

    def _fits(self, size: int) -> bool:
        """Whether a new LRU value of `size` bytes fits beside the held values (under the lock); counts it if not."""
        if size + self.held_bytes <= self.capacity:
            return True
        self.stats.error("too_large" if size > self.capacity else "full")
        return False

    def _hold_room(self, key: bytes, size: int) -> list[bytes] | None:
        """Account a held value (under the lock): the LRU keys dropped for it, or None if it cannot fit."""
        if self.held_bytes + size > self.capacity:
            self.stats.swap_refused += 1
            return None
        self._held[key] = size
        self.held_bytes += size
        return self._room()

    def _release(self, key: bytes) -> bool:
        """Forget a held value's accounting (under the lock); False if it was not held."""
        size = self._held.pop(key, None)
        if size is None:
            return False
        self.held_bytes -= size
        return True

    def _dropped(self, keys: list[bytes]) -> None:
        if keys and self.on_drop is not None:
            self.on_drop(keys)


class CpuTier(Tier):
    """Values in host memory (`--kv-offload-memory`)."""

    name = "cpu"
    medium = "CPU"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._values: dict[bytes, bytes] = {}

    def get(self, key: bytes) -> bytes | None:
        with self._lock:
            value = self._values.get(key)
            if value is None:
                self.stats.misses += 1
                return None
            self._index.move_to_end(key)
            self.stats.hits += 1
            self.stats.bytes_out += len(value)
            return value

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._values

    def put(self, key: bytes, value: bytes) -> bool:
        with self._lock:
            if key in self._values:
                self._index.move_to_end(key)
                return False
            if not self._fits(len(value)):
                return False
            self._values[key] = value
            dropped = self._admit(key, len(value))
            for old in dropped:
                del self._values[old]
            self.stats.stored += 1
            self.stats.bytes_in += len(value)
        self._dropped(dropped)
        return True

    def hold(self, key: bytes, value, size: int) -> bool:
        with self._lock:
            dropped = self._hold_room(key, size)
            if dropped is None:
                return False
            self._values[key] = value
            for old in dropped:
                del self._values[old]
            self.stats.swapped_out += 1
        self._dropped(dropped)
        return True

    def take(self, key: bytes):
        with self._lock:
            if not self._release(key):
                return None
            self.stats.swapped_in += 1
            return self._values.pop(key)


class DiskTier(Tier):
    """One file per block in a directory (`--kv-offload-dir`, `--kv-offload-disk-size`).

    Writes go to a temporary file in the same directory, renamed over the final name (atomic on POSIX), so
    processes sharing the directory never read a half-written block; a reader that loses a race with a deletion
    sees a miss. Each process accounts the capacity for the files it wrote or found at start-up (oldest
    modification first), so several writers may together exceed it by what each wrote since. Swapped sequences go
    to files of their own, named by the process; files of processes that no longer run are deleted at start-up."""

    name = "disk"
    medium = "DISK"
    SUFFIX = ".kvb"
    SWAP_PREFIX = ".swap-"  # + pid + key: a preempted sequence's KV, private to the process that swapped it out

    def __init__(self, path: str, capacity: int) -> None:
        super().__init__(capacity)
        self.path = os.path.abspath(os.path.expanduser(path))
        try:
            os.makedirs(self.path, exist_ok=True)
            fd, probe = tempfile.mkstemp(dir=self.path, prefix=".probe-")
            os.close(fd)
            os.remove(probe)
        except OSError as e:
            raise ValueError(f"kv_offload_dir {path!r} cannot be written: {e.strerror or e}") from None
        found = []
        for entry in os.scandir(self.path):
            if entry.name.endswith(self.SUFFIX) and entry.is_file():
                st = entry.stat()
                found.append((st.st_mtime, bytes.fromhex(entry.name[:-len(self.SUFFIX)]), st.st_size))
        for _, key, size in sorted(found):
            for old in self._admit(key, size):
                self._remove(old)
        self._remove_dead_swaps()

    def _file(self, key: bytes) -> str:
        return os.path.join(self.path, key.hex() + self.SUFFIX)

    def _remove(self, key: bytes) -> None:
        try:
            os.remove(self._file(key))
        except FileNotFoundError:
            pass
        except OSError:
            self.stats.error("delete")

    def contains(self, key: bytes) -> bool:
        return os.path.exists(self._file(key))

    def get(self, key: bytes) -> bytes | None:
        try:
            with open(self._file(key), "rb") as f:
                value = f.read()
        except FileNotFoundError:
            with self._lock:
                self.stats.misses += 1
            return None
        except OSError:
            with self._lock:
                self.stats.misses += 1
                self.stats.error("read")
            return None
        try:
            os.utime(self._file(key))  # least recently used is by modification time, for every process
        except OSError:
            pass
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
            self.stats.hits += 1
            self.stats.bytes_out += len(value)
        return value

    def _write(self, path: str, value) -> bool:
        """Write `value` to `path` through a temporary file renamed over it; False (counted) on an I/O error."""
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=self.path, prefix=".tmp-")
            with os.fdopen(fd, "wb") as f:
                f.write(value)
            os.replace(tmp, path)
        except OSError as e:
            if tmp is not None:
                try:
                    os.remove(tmp)
                except OSError:
                    pass
            with self._lock:
                self.stats.error("disk_full" if e.errno == errno.ENOSPC else "write")
            return False
        return True

    def put(self, key: bytes, value: bytes) -> bool:
        with self._lock:
            if not self._fits(len(value)):
                return False
        if self.contains(key) or not self._write(self._file(key), value):
            return False
        with self._lock:
            dropped = self._admit(key, len(value))
            self.stats.stored += 1
            self.stats.bytes_in += len(value)
        for old in dropped:
            self._remove(old)
        self._dropped(dropped)
        return True

    def _swap_file(self, key: bytes) -> str:
        return os.path.join(self.path, f"{self.SWAP_PREFIX}{os.getpid()}-{key.hex()}")

    def hold(self, key: bytes, value, size: int) -> bool:
        with self._lock:
            dropped = self._hold_room(key, size)
            if dropped is None:
                return False
        for old in dropped:
            self._remove(old)
        self._dropped(dropped)
        written = self._write(self._swap_file(key), value)
        with self._lock:
            if written:
                self.stats.swapped_out += 1
            else:
                self._release(key)
        return written

    def take(self, key: bytes):
        with self._lock:
            if not self._release(key):
                return None
        path = self._swap_file(key)
        try:
            with open(path, "rb") as f:
                value = f.read()
            os.remove(path)
        except OSError:
            with self._lock:
                self.stats.error("read")
            return None
        with self._lock:
            self.stats.swapped_in += 1
        return value

    def _remove_dead_swaps(self) -> None:
        """Delete swap files left by processes that no longer run (a crash or a kill skips their clean-up)."""
        for entry in os.scandir(self.path):
            if not entry.name.startswith(self.SWAP_PREFIX):
                continue
            pid = entry.name[len(self.SWAP_PREFIX):].split("-", 1)[0]
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                try:
                    os.remove(entry.path)
                except OSError:
                    pass
            except (ValueError, PermissionError):
                pass  # not a pid, or another user's live process


REMOTE_SCHEMES = ("redis://", "rediss://", "unix://")


class RedisTier(Tier):
    """Values in a Redis or Valkey server (`--kv-remote redis://host:port/db`), shared by every engine process and
    machine that uses it. Redis keeps its own size (maxmemory and its eviction policy); `capacity` here only bounds
    the one value a put may send.

    Every call has a timeout (`timeout` seconds, connect and socket). A failed call is counted, and the tier is
    then skipped for `backoff` seconds, so a server that is down costs a step at most one timeout per backoff
    interval, not one per block; after it, the next call tries again, and a server that came back is used again.
    `contains` answers from the keys this process put or found (no round trip on the engine thread); the writer
    sends SET NX, so a value another process stored is not sent twice."""

    name = "redis"
    medium = "REMOTE"
    PREFIX = b"kvcache:block:"

    def __init__(self, url: str, timeout: float = 0.5, backoff: float = 5.0, capacity: int = 512 * 2**20) -> None:
        super().__init__(capacity)
        if not url.startswith(REMOTE_SCHEMES):
            raise ValueError(f"kv_remote must be a redis://, rediss:// or unix:// URL; got {url!r}")
        import redis
        self._errors = (redis.RedisError, OSError)
        self.url, self.timeout, self.backoff = url, timeout, backoff
        self.client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        self._down_until = 0.0
        self._known: OrderedDict[bytes, None] = OrderedDict()  # keys seen present, most recent last

    def _up(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self) -> None:
        with self._lock:
            self.stats.error("unavailable")
            self._down_until = time.monotonic() + self.backoff

    def _know(self, key: bytes) -> None:
        with self._lock:
            self._known[key] = None
            self._known.move_to_end(key)
            while len(self._known) > 1_000_000:
                self._known.popitem(last=False)

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._known

    def get(self, key: bytes) -> bytes | None:
        if not self._up():
            with self._lock:
                self.stats.misses += 1
            return None
        try:
            value = self.client.get(self.PREFIX + key)
        except self._errors:
            self._failed()
            with self._lock:
                self.stats.misses += 1
            return None
        with self._lock:
            if value is None:
                self.stats.misses += 1
                self._known.pop(key, None)
                return None
            self.stats.hits += 1
            self.stats.bytes_out += len(value)
        self._know(key)
        return value

    def put(self, key: bytes, value: bytes) -> bool:
        if len(value) > self.capacity:
            with self._lock:
                self.stats.error("too_large")
            return False
        if self.contains(key):
            return False
        if not self._up():
            with self._lock:
                self.stats.error("skipped")
            return False
        try:
            new = self.client.set(self.PREFIX + key, value, nx=True)
        except self._errors:
            self._failed()
            return False
        with self._lock:
            if new:
                self.stats.stored += 1
                self.stats.bytes_in += len(value)
                self.used_bytes += len(value)
        self._know(key)
        return bool(new)

    def info(self) -> dict:
        out = super().info()
        out["blocks"] = len(self._known)
        out["url"] = self.url
        return out
