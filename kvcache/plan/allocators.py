"""KV cache allocators for the simulator, in token units (the caller turns tokens into bytes).

Each allocator manages a pool of token slots and answers the same questions, so one trace can be
replayed through all of them: reserve-max and contiguous place each request in one run of slots;
paged ones hand out fixed-size blocks as sequences grow, optionally sharing prefix blocks.
A failed `admit` or `grow` returns False and changes nothing. No torch here.
"""
from __future__ import annotations

from bisect import bisect_left


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class Allocator:
    """The interface the simulator drives. All quantities are token slots."""

    name: str
    pool_tokens: int

    def admit(self, req_id: int, prompt_tokens: int, final_tokens: int, prefix_group: int | None = None,
              prefix_tokens: int = 0) -> bool:
        """Start a request that now holds `prompt_tokens` + 1 tokens and will end with `final_tokens`."""
        raise NotImplementedError

    def grow(self, req_id: int, live_tokens: int) -> bool:
        """The request now holds `live_tokens` tokens; False (nothing changed) if they do not fit."""
        raise NotImplementedError

    def release(self, req_id: int) -> None:
        raise NotImplementedError

    def allocated_tokens(self) -> int:
        """Slots reserved right now, filled or not."""
        raise NotImplementedError

    def live_tokens(self) -> int:
        """Distinct slots holding a token (a shared prefix token counts once)."""
        raise NotImplementedError

    def free_tokens(self) -> int:
        return self.pool_tokens - self.allocated_tokens()

    def largest_free_run(self) -> int:
        """The largest request, in tokens, that could be admitted now."""
        raise NotImplementedError

    def fits_ever(self, final_tokens: int) -> bool:
        """Whether a request ending with `final_tokens` tokens fits into the empty pool."""
        raise NotImplementedError


class ContiguousExact(Allocator):
    """One contiguous run per request of exactly prompt+output slots: an oracle that knows the output
    length, the best a contiguous allocator can do. First fit over sorted free intervals, coalesced on
    release; the holes between live runs are its external fragmentation."""

    def __init__(self, pool_tokens: int) -> None:
        if pool_tokens < 1:
            raise ValueError(f"pool must hold at least 1 token, got {pool_tokens}")
        self.name = "contiguous"
        self.pool_tokens = pool_tokens
        self._free: list[list[int]] = [[0, pool_tokens]]  # [start, end) sorted by start, never adjacent
        self._spans: dict[int, tuple[int, int]] = {}  # req -> (start, size)
        self._held: dict[int, int] = {}
        self._allocated = 0
        self._live = 0

    def _reservation(self, final_tokens: int) -> int:
        return final_tokens

    def fits_ever(self, final_tokens: int) -> bool:
        return final_tokens <= self._reservation(final_tokens) <= self.pool_tokens

    def admit(self, req_id: int, prompt_tokens: int, final_tokens: int, prefix_group: int | None = None,
              prefix_tokens: int = 0) -> bool:
        size = self._reservation(final_tokens)
        if prompt_tokens + 1 > size or final_tokens > size:
            return False
        for i, (start, end) in enumerate(self._free):
            if end - start >= size:
                if end - start == size:
                    del self._free[i]
                else:
                    self._free[i][0] = start + size
                self._spans[req_id] = (start, size)
                self._held[req_id] = prompt_tokens + 1
                self._allocated += size
                self._live += prompt_tokens + 1
                return True
        return False

    def grow(self, req_id: int, live_tokens: int) -> bool:
        if live_tokens > self._spans[req_id][1]:
            return False  # a contiguous run cannot be extended in place
        self._live += live_tokens - self._held[req_id]
        self._held[req_id] = live_tokens
        return True

    def release(self, req_id: int) -> None:
        start, size = self._spans.pop(req_id)
        self._allocated -= size
        self._live -= self._held.pop(req_id)
        end = start + size
        i = bisect_left(self._free, [start, end])
        if i < len(self._free) and self._free[i][0] == end:
            end = self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][1] == start:
            self._free[i - 1][1] = end
        else:
            self._free.insert(i, [start, end])

    def allocated_tokens(self) -> int:
        return self._allocated

    def live_tokens(self) -> int:
        return self._live

    def largest_free_run(self) -> int:
        return max((end - start for start, end in self._free), default=0)

    def span(self, req_id: int) -> tuple[int, int]:
        """[start, end) token offsets of a request's run."""
        start, size = self._spans[req_id]
        return start, start + size

    def holes(self) -> list[tuple[int, int]]:
        """Free [start, end) token ranges, in address order."""
        return [(start, end) for start, end in self._free]


class ReserveMax(ContiguousExact):
    """Contiguous, reserving `max_model_len` slots per request whatever its real length: what servers did
    before paging (FasterTransformer, static-batch HF serving). First-fit placement."""

    def __init__(self, pool_tokens: int, max_model_len: int) -> None:
        super().__init__(pool_tokens)
        self.name = "reserve-max"
        self.max_model_len = max_model_len

    def _reservation(self, final_tokens: int) -> int:
        return self.max_model_len


class Paged(Allocator):
    """Blocks of `block_size` tokens handed out as a sequence grows; they need not be adjacent, so there is
    no external fragmentation, only the unfilled tail of each request's last block. The pool is
    pool_tokens // block_size whole blocks."""

    def __init__(self, pool_tokens: int, block_size: int) -> None:
        if block_size < 1 or pool_tokens < block_size:
            raise ValueError(f"a pool of {pool_tokens} tokens holds no block of {block_size} tokens")
        self.name = f"paged-{block_size}"
        self.block_size = block_size
        self.num_blocks = pool_tokens // block_size
        self.pool_tokens = self.num_blocks * block_size
        self.free_blocks = self.num_blocks
        self._private: dict[int, int] = {}  # req -> blocks only it holds
        self._held: dict[int, int] = {}
        self._live = 0

    def fits_ever(self, final_tokens: int) -> bool:
        return _blocks(final_tokens, self.block_size) <= self.num_blocks

    def admit(self, req_id: int, prompt_tokens: int, final_tokens: int, prefix_group: int | None = None,
              prefix_tokens: int = 0) -> bool:
        need = _blocks(prompt_tokens + 1, self.block_size)
        if need > self.free_blocks:
            return False
        self.free_blocks -= need
        self._private[req_id] = need
        self._held[req_id] = prompt_tokens + 1
        self._live += prompt_tokens + 1
        return True

    def _shared_blocks(self, req_id: int) -> int:
        return 0

    def grow(self, req_id: int, live_tokens: int) -> bool:
        need = _blocks(live_tokens, self.block_size) - self._shared_blocks(req_id) - self._private[req_id]
        if need > self.free_blocks:
            return False
        if need > 0:
            self.free_blocks -= need
            self._private[req_id] += need
        self._live += live_tokens - self._held[req_id]
        self._held[req_id] = live_tokens
        return True

    def release(self, req_id: int) -> None:
        self.free_blocks += self._private.pop(req_id)
        self._live -= self._held.pop(req_id)

    def allocated_tokens(self) -> int:
        return (self.num_blocks - self.free_blocks) * self.block_size

    def live_tokens(self) -> int:
        return self._live

    def largest_free_run(self) -> int:
        return self.free_blocks * self.block_size


class PagedPrefixSharing(Paged):
    """Paged, plus requests of one prefix group share the full blocks of their common prefix
    (prefix_tokens // block_size of them) by reference count. The first holder allocates them, later ones
    reference them while any holder lives, the last release frees them. A partial prefix block stays
    private (a real engine copies it on write)."""

    def __init__(self, pool_tokens: int, block_size: int) -> None:
        super().__init__(pool_tokens, block_size)
        self.name = f"paged-{block_size}+prefix"
        # group -> holders of each shared block; non-increasing, since whoever holds block i holds 0..i-1
        self._refs: dict[int, list[int]] = {}
        self._sharing: dict[int, tuple[int, int]] = {}  # req -> (group, shared blocks it holds)

    def _shared_blocks(self, req_id: int) -> int:
        return self._sharing[req_id][1] if req_id in self._sharing else 0

    def admit(self, req_id: int, prompt_tokens: int, final_tokens: int, prefix_group: int | None = None,
              prefix_tokens: int = 0) -> bool:
        shared = prefix_tokens // self.block_size if prefix_group is not None else 0
        if not shared:
            return super().admit(req_id, prompt_tokens, final_tokens)
        refs = self._refs.get(prefix_group, [])
        new_shared = max(0, shared - len(refs))
        private = _blocks(prompt_tokens + 1, self.block_size) - shared
        if new_shared + private > self.free_blocks:
            return False
        self.free_blocks -= new_shared + private
        refs = self._refs.setdefault(prefix_group, [])
        for i in range(shared):
            if i < len(refs):
                refs[i] += 1
            else:
                refs.append(1)
        self._sharing[req_id] = (prefix_group, shared)
        self._private[req_id] = private
        self._held[req_id] = prompt_tokens + 1
        # the shared slots are already counted (once) in the group's blocks unless they are new
        self._live += prompt_tokens + 1 - (shared - new_shared) * self.block_size
        return True

    def release(self, req_id: int) -> None:
        sharing = self._sharing.pop(req_id, None)
        if sharing is None:
            return super().release(req_id)
        group, shared = sharing
        refs = self._refs[group]
        for i in range(shared):
            refs[i] -= 1
        unused = 0
        while refs and refs[-1] == 0:
            refs.pop()
            unused += 1
        if not refs:
            del self._refs[group]
        self.free_blocks += self._private.pop(req_id) + unused
        # its shared slots stay live for the other holders except those in blocks now freed
        self._live -= self._held.pop(req_id) - (shared - unused) * self.block_size
