"""A GGUF file's metadata (config, tokenizer, tensor index) cached on disk as plain Hugging Face files.

Reading a GGUF's metadata goes through `gguf`'s reader, which parses every key and array element in Python:
on the demo model (a 49,152-token vocabulary and its merges) transformers' config took 3.3 s, its tokenizer 3.2 s
(each parses the file again) and the tensor index 2.5 s, most of the engine's start-up. The first load writes what
they produce to a directory (config.json, tokenizer.json and its config, the tensors' types, shapes and offsets);
later loads read those in ~0.15 s. The tensors themselves are still read from the GGUF, memory-mapped.

Entries are keyed by the file's path, size, modification time and first MiB, and by the versions of transformers
and gguf that produced them, so an edited or replaced file, or an upgrade, makes a new entry (and the path's old
one is removed). Each part is written to a temporary directory and renamed into place, so concurrent loads (test
workers, replicas) never see half an entry. Where the cache cannot be written (a read-only or full disk) loading
goes on without it and says so once; an entry that does not load is rebuilt.

KVCACHE_GGUF_CACHE: the cache's directory (default $KVCACHE_CACHE/gguf, $KVCACHE_CACHE defaulting to
~/.cache/kvcache), or 0 for none.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, TypeVar

import numpy as np

log = logging.getLogger(__name__)
T = TypeVar("T")

FORMAT = 1  # bump when what an entry holds changes
_HEAD_BYTES = 1 << 20
_warned: set[str] = set()


def root() -> Path | None:
    """The cache's directory, or None where KVCACHE_GGUF_CACHE=0."""
    value = os.environ.get("KVCACHE_GGUF_CACHE")
    if value == "0":
        return None
    if value:
        return Path(value).expanduser()
    return Path(os.environ.get("KVCACHE_CACHE") or Path.home() / ".cache" / "kvcache").expanduser() / "gguf"


def _key(path: str) -> str:
    st = os.stat(path)
    h = hashlib.sha256(f"{FORMAT}\0{os.path.realpath(path)}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    for package in ("transformers", "gguf"):
        h.update(f"{package} {importlib.metadata.version(package)}\0".encode())
    with open(path, "rb") as f:
        h.update(f.read(_HEAD_BYTES))
    return h.hexdigest()[:32]


def _entry(path: str) -> Path | None:
    """`path`'s entry directory (created), or None where there is no cache or it cannot be made."""
    base = root()
    if base is None:
        return None
    entry = base / _key(path)
    if entry.is_dir():
        return entry
    try:
        entry.mkdir(parents=True, exist_ok=True)
        _prune(base, entry, os.path.realpath(path))
        (entry / "source").write_text(os.path.realpath(path))
    except OSError as e:
        _warn(base, e)
        return None
    return entry


def _prune(base: Path, keep: Path, source: str) -> None:
    """Remove the entries made for `source` before it changed."""
    for other in base.iterdir():
        try:
            if other != keep and (other / "source").read_text() == source:
                shutil.rmtree(other, ignore_errors=True)
        except OSError:
            continue


def _warn(base: Path, error: Exception) -> None:
    if str(base) not in _warned:
        _warned.add(str(base))
        log.warning("cannot cache GGUF metadata under %s (%s): every load parses the file again "
                    "(KVCACHE_GGUF_CACHE names another directory, 0 turns the cache off)", base, error)


def cached(path: str, part: str, build: Callable[[], T], save: Callable[[T, str], None],
           load: Callable[[str], T]) -> T:
    """`load(dir)` of `path`'s cached `part`; on a miss (or an entry that does not load), `build()`, saved with
    `save(value, dir)` for the next load."""
    entry = _entry(path)
    if entry is None:
        return build()
    target = entry / part
    if target.is_dir():
        try:
            return load(str(target))
        except Exception as e:  # a damaged entry: rebuilt below
            log.warning("GGUF metadata cache entry %s does not load (%s); rebuilding it", target, e)
            shutil.rmtree(target, ignore_errors=True)
    value = build()
    tmp = None
    try:
        tmp = tempfile.mkdtemp(dir=entry, prefix=f".{part}-")
        save(value, tmp)
        os.rename(tmp, target)  # fails if another process put its copy there first: theirs stays
        tmp = None
    except OSError as e:
        if not target.is_dir():
            _warn(entry.parent, e)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return value


def tensor_index(path: str) -> list[SimpleNamespace]:
    """The GGUF's tensors as `gguf`'s reader lists them (name, tensor_type, shape, data: the memory-mapped array
    the reader would give), from the cache when it holds them."""
    import gguf

    def build():
        return [dict(name=t.name, type=int(t.tensor_type), shape=[int(n) for n in t.shape], offset=int(t.data_offset),
                     dtype=t.data.dtype.str, data_shape=list(t.data.shape)) for t in gguf.GGUFReader(path).tensors]

    def save(index, directory):
        with open(os.path.join(directory, "tensors.json"), "w") as f:
            json.dump(index, f)

    def load(directory):
        with open(os.path.join(directory, "tensors.json")) as f:
            return json.load(f)

    index = cached(path, "tensors", build, save, load)
    mapped = np.memmap(path, mode="r")
    out = []
    for t in index:
        dtype = np.dtype(t["dtype"])
        count = int(np.prod(t["data_shape"]))
        data = mapped[t["offset"]:t["offset"] + count * dtype.itemsize].view(dtype).reshape(t["data_shape"])
        out.append(SimpleNamespace(name=t["name"], tensor_type=gguf.GGMLQuantizationType(t["type"]),
                                   shape=np.array(t["shape"], dtype=np.uint64), data=data))
    return out
