"""The error tensor parallelism raises, and the wrapper that turns a failed collective into it: the engine and the
parallel layer both import them from here."""
from __future__ import annotations


class RankDiedError(RuntimeError):
    """A tensor-parallel rank exited, or a collective failed or timed out."""


def checked(fn, *args):
    """fn(*args), a collective; RankDiedError where a peer is gone or the timeout passed."""
    try:
        return fn(*args)
    except RuntimeError as e:  # gloo/NCCL: a peer gone (connection closed) or the timeout
        raise RankDiedError(f"a tensor-parallel collective failed: {e}") from e
