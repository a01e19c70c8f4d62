"""What a build of the C++ kernels was made from, so that a stale or damaged build is found before it is loaded.

setup.py writes `manifest.json` beside the modules it builds (kvcache/_native/, or in a source checkout
kvcache/_native/<environment>/): the torch it was built against, a digest of the sources (csrc/ and setup.py) and
each module's SHA-256. kvcache.native reads it before importing anything. Standard library only: setup.py loads this
file by its path, before the package can be imported.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys

MANIFEST = "manifest.json"
SOURCE_SUFFIXES = (".h", ".cpp")


def env_key(prefix: str | None = None) -> str:
    """A short name for this Python environment (its sys.prefix): a source checkout keeps one build per environment
    that installed it, so that two virtual environments never load, or rebuild over, each other's."""
    path = os.path.realpath(prefix or sys.prefix)
    return "env_" + hashlib.sha256(path.encode()).hexdigest()[:10]


def sources_digest(root: str) -> str:
    """SHA-256 over setup.py and every source under csrc/ (their paths and bytes), in a fixed order."""
    h = hashlib.sha256()
    files = [os.path.join(root, "setup.py")]
    for base, dirs, names in os.walk(os.path.join(root, "csrc")):
        dirs.sort()
        files += [os.path.join(base, n) for n in sorted(names) if n.endswith(SOURCE_SUFFIXES)]
    for path in files:
        h.update(os.path.relpath(path, root).encode() + b"\0")
        with open(path, "rb") as f:
            h.update(f.read())
        h.update(b"\0")
    return h.hexdigest()


def file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write(directory: str, torch_version: str, sources: str, modules: dict[str, str], flags: dict) -> str:
    """Record the build in `directory` (modules: name -> file name in it); returns the manifest's path."""
    data = {"torch": torch_version, "python": sys.version.split()[0], "sources": sources, "flags": flags,
            "modules": {name: {"file": f, "sha256": file_digest(os.path.join(directory, f))}
                        for name, f in modules.items()}}
    path = os.path.join(directory, MANIFEST)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as out:
        json.dump(data, out, indent=1)
    os.replace(tmp, path)  # whole or absent: a reader never sees half of it
    return path


def read(directory: str) -> dict | None:
    """The manifest in `directory`, or None where there is none (or it does not parse)."""
    try:
        with open(os.path.join(directory, MANIFEST)) as f:
            data = json.load(f)
        return data if isinstance(data, dict) and isinstance(data.get("modules"), dict) else None
    except (OSError, ValueError):
        return None
