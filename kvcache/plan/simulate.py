"""Replay a request trace through KV allocators and measure what each one wastes.

Time model: discrete decode iterations of `step_s` seconds. In each step
  1. requests whose arrival time has come join a FCFS waiting queue; one that could not fit even
     into the empty pool is counted as `oom` and dropped;
  2. every running request gains one token (paged allocators grow lazily). If the pool cannot
     hold it, the newest running request is preempted: released and put back at the front of the
     queue, to recompute from scratch later (vLLM's recompute preemption), and the grow is retried;
  3. unless something was preempted, requests are admitted from the head of the queue while the
     allocator accepts and fewer than `max_num_seqs` run (head-of-line blocking, as vLLM's FCFS).
     An admitted request holds prompt+1 tokens: prefill and first token happen in its first step;
  4. the step is measured; requests holding prompt+output tokens then finish and release.
Contiguous allocators reserve at admission and never grow past it. No torch here.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from kvcache.plan.allocators import Allocator, ContiguousExact, Paged, PagedPrefixSharing, ReserveMax
from kvcache.plan.trace import TraceRequest

MAX_TIMELINE_POINTS = 2000


@dataclass(slots=True)
class AllocatorResult:
    """What one allocator did with a trace. Utilization = live token slots / allocated slots, averaged
    over steps where something is allocated; pool usage = allocated / pool; fragmentations are fractions."""

    name: str
    pool_tokens: int
    peak_utilization: float
    mean_utilization: float
    mean_pool_usage: float
    peak_pool_usage: float
    internal_fragmentation: float  # mean (allocated - live) / allocated: reserved or block-tail slots
    external_fragmentation: float  # mean 1 - largest free run / free, over steps with free memory
    peak_concurrency: int
    mean_concurrency: float
    waited: int  # requests that could not start in the step they arrived
    oom: int  # requests that could never fit, dropped
    preemptions: int
    finished: int
    makespan_s: float  # seconds until the last request finished
    timeline: dict[str, list[float | None]] = field(default_factory=dict)  # time_s, utilization, pool_usage

    def to_json(self, timeline: bool = False) -> dict:
        """A JSON-ready dict; the per-step timeline only when asked (NaN utilization becomes null)."""
        out = {k: getattr(self, k) for k in self.__slots__ if k != "timeline"}
        if timeline:
            out["timeline"] = {k: [None if isinstance(v, float) and math.isnan(v) else v for v in vs]
                               for k, vs in self.timeline.items()}
        return out


def simulate(trace: list[TraceRequest], allocator: Allocator, *, step_s: float = 0.02,
             max_num_seqs: int = 256) -> AllocatorResult:
    """Replay `trace` through `allocator` (see the module docstring for the time model)."""
    if not step_s > 0 or max_num_seqs < 1:
        raise ValueError(f"need step_s > 0 and max_num_seqs >= 1, got step_s={step_s}, max_num_seqs={max_num_seqs}")
    replay = _Replay(trace, allocator, step_s, max_num_seqs)
    while replay.pending or replay.waiting or replay.running:
        replay.skip_idle_gap()
        replay.arrive()
        preempted = replay.grow()
        if not preempted:
            replay.admit()
        replay.measure()
        replay.finish()
        replay.step += 1
    return replay.result()


class _Replay:
    """The state of one simulate() run: the queues, what each running request holds, and the running sums."""

    def __init__(self, trace: list[TraceRequest], allocator: Allocator, step_s: float, max_num_seqs: int) -> None:
        self.trace, self.allocator, self.step_s, self.max_num_seqs = trace, allocator, step_s, max_num_seqs
        self.pending = deque(sorted(range(len(trace)), key=lambda i: trace[i].arrival_s))
        self.waiting: deque[int] = deque()
        self.running: list[int] = []  # admission order: newest last
        self.held: dict[int, int] = {}
        self.arrived_step: dict[int, int] = {}
        self.started: set[int] = set()
        self.waited = self.oom = self.preemptions = self.finished = 0
        self.makespan = 0.0
        self.step = self.steps = self.idle_steps = 0  # idle: skipped steps with nothing queued or running
        self.util_sum = self.util_n = self.util_peak = 0.0
        self.usage_sum = self.usage_peak = self.conc_sum = self.ext_sum = 0.0
        self.conc_peak = 0
        self.times: list[float] = []
        self.utils: list[float] = []
        self.usages: list[float] = []

    def skip_idle_gap(self) -> None:
        """With nothing queued or running, jump to the next arrival's step; the gap still counts as empty time."""
        if self.waiting or self.running:
            return
        first = math.ceil(self.trace[self.pending[0]].arrival_s / self.step_s - 1e-9)
        if first > self.step:
            self.idle_steps += first - self.step
            self.times.append(self.step * self.step_s)
            self.utils.append(math.nan)
            self.usages.append(0.0)
            self.step = first

    def arrive(self) -> None:
        """Queue the requests whose arrival time has come; drop (as oom) one that would not fit the empty pool."""
        now = self.step * self.step_s
        while self.pending and self.trace[self.pending[0]].arrival_s <= now + 1e-9:
            rid = self.pending.popleft()
            r = self.trace[rid]
            if self.allocator.fits_ever(r.prompt_tokens + r.output_tokens):
                self.waiting.append(rid)
                self.arrived_step[rid] = self.step
            else:
                self.oom += 1

    def grow(self) -> bool:
        """Give every running request one more token, preempting the newest while the pool cannot; whether any
        request was preempted."""
        preempted = False
        i = 0
        while i < len(self.running):
            rid = self.running[i]
            while not self.allocator.grow(rid, self.held[rid] + 1):
                victim = self.running.pop()
                self.allocator.release(victim)
                del self.held[victim]
                self.waiting.appendleft(victim)
                self.preemptions += 1
                preempted = True
                if victim == rid:
                    break
            else:
                self.held[rid] += 1
                i += 1
        return preempted

    def admit(self) -> None:
        """Admit from the head of the queue while the allocator accepts and fewer than max_num_seqs run."""
        while self.waiting and len(self.running) < self.max_num_seqs:
            r = self.trace[self.waiting[0]]
            if not self.allocator.admit(self.waiting[0], r.prompt_tokens, r.prompt_tokens + r.output_tokens,
                                        r.prefix_group, r.prefix_tokens):
                break
            rid = self.waiting.popleft()
            self.running.append(rid)
            self.held[rid] = r.prompt_tokens + 1
            if rid not in self.started:
                self.started.add(rid)
                self.waited += self.arrived_step[rid] != self.step
        if not self.running and self.waiting:
            raise RuntimeError(f"request {self.waiting[0]} fits the empty pool but {self.allocator.name} refused it")

    def measure(self) -> None:
        """Add this step's utilization, pool usage, concurrency and external fragmentation to the sums."""
        allocated, live = self.allocator.allocated_tokens(), self.allocator.live_tokens()
        free, pool = self.allocator.free_tokens(), self.allocator.pool_tokens
        util = live / allocated if allocated else math.nan
        if allocated:
            self.util_sum += util
            self.util_n += 1
            self.util_peak = max(self.util_peak, util)
        self.usage_sum += allocated / pool
        self.usage_peak = max(self.usage_peak, allocated / pool)
        self.conc_sum += len(self.running)
        self.conc_peak = max(self.conc_peak, len(self.running))
        if free:
            self.ext_sum += 1 - self.allocator.largest_free_run() / free
        self.times.append(self.step * self.step_s)
        self.utils.append(util)
        self.usages.append(allocated / pool)
        self.steps += 1

    def finish(self) -> None:
        """Release the requests that hold their prompt and all their output tokens."""
        still = []
        for rid in self.running:
            r = self.trace[rid]
            if self.held[rid] >= r.prompt_tokens + r.output_tokens:
                self.allocator.release(rid)
                del self.held[rid]
                self.finished += 1
                self.makespan = self.step * self.step_s + self.step_s
            else:
                still.append(rid)
        self.running = still

    def result(self) -> AllocatorResult:
        total = self.steps + self.idle_steps
        stride = max(1, math.ceil(len(self.times) / MAX_TIMELINE_POINTS))
        mean_util = self.util_sum / self.util_n if self.util_n else 0.0
        return AllocatorResult(
            name=self.allocator.name, pool_tokens=self.allocator.pool_tokens, peak_utilization=self.util_peak,
            mean_utilization=mean_util, mean_pool_usage=self.usage_sum / total if total else 0.0,
            peak_pool_usage=self.usage_peak, internal_fragmentation=1 - mean_util if self.util_n else 0.0,
            external_fragmentation=self.ext_sum / total if total else 0.0,
            peak_concurrency=self.conc_peak, mean_concurrency=self.conc_sum / total if total else 0.0,
            waited=self.waited, oom=self.oom, preemptions=self.preemptions, finished=self.finished,
            makespan_s=self.makespan,
            timeline={"time_s": self.times[::stride], "utilization": self.utils[::stride],
                      "pool_usage": self.usages[::stride]})


def compare(trace: list[TraceRequest], pool_tokens: int, *, block_sizes: tuple[int, ...] = (1, 16, 64, 256),
            max_model_len: int = 4096, step_s: float = 0.02, max_num_seqs: int = 256,
            prefix_sharing: bool = True) -> list[AllocatorResult]:
    """Run reserve-max, contiguous, paged at each block size and (if `prefix_sharing`) paged-16+prefix
    over a pool of `pool_tokens` token slots."""
    allocators: list[Allocator] = [ReserveMax(pool_tokens, max_model_len), ContiguousExact(pool_tokens)]
    allocators += [Paged(pool_tokens, bs) for bs in block_sizes]
    if prefix_sharing:
        allocators.append(PagedPrefixSharing(pool_tokens, 16))
    return [simulate(trace, a, step_s=step_s, max_num_seqs=max_num_seqs) for a in allocators]


def format_table(results: list[AllocatorResult], bytes_per_token: int) -> str:
    """A plain aligned text table, one row per allocator; percentages of slots, makespan in seconds."""
    head = ["allocator", "mean util %", "peak util %", "internal frag %", "external frag %", "peak conc",
            "mean conc", "waited", "preempted", "oom", "makespan s"]
    rows = [[r.name, f"{100 * r.mean_utilization:.1f}", f"{100 * r.peak_utilization:.1f}",
             f"{100 * r.internal_fragmentation:.1f}", f"{100 * r.external_fragmentation:.1f}",
             str(r.peak_concurrency), f"{r.mean_concurrency:.1f}", str(r.waited), str(r.preemptions),
             str(r.oom), f"{r.makespan_s:.2f}"] for r in results]
    widths = [max(len(row[c]) for row in [head] + rows) for c in range(len(head))]
    lines = ["  ".join(cell.ljust(w) if c == 0 else cell.rjust(w) for c, (cell, w) in enumerate(zip(row, widths)))
             for row in [head] + rows]
    lines.insert(1, "-" * len(lines[0]))
    if results:
        # paged pools round down to whole blocks, so the largest pool is the one asked for
        pool = max(r.pool_tokens for r in results)
        lines.insert(0, f"KV pool: {pool:,} token slots x {bytes_per_token:,} bytes/token = "
                        f"{pool * bytes_per_token / 2**30:.2f} GiB")
    return "\n".join(lines)


def plot(results: list[AllocatorResult], path: str) -> None:
    """One PNG at `path`: utilization (top) and pool usage (bottom) over time, one line per allocator."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(10, 7))
    for r in results:
        top.plot(r.timeline["time_s"], [100 * u for u in r.timeline["utilization"]], label=r.name, lw=1.2)
        bottom.plot(r.timeline["time_s"], [100 * u for u in r.timeline["pool_usage"]], label=r.name, lw=1.2)
    top.set_ylabel("utilization %\n(live tokens / allocated slots)")
    bottom.set_ylabel("pool usage %\n(allocated / pool)")
    bottom.set_xlabel("time (s)")
    top.set_ylim(0, 105)
    bottom.set_ylim(0, 105)
    top.legend(loc="lower right", fontsize=8)
    top.set_title("KV cache utilization by allocator")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


GIB = 2**30


@dataclass(slots=True)
class ScenarioPlacement:
    """Where one request of the seed scenario landed. Byte offsets for contiguous allocators; paged ones
    report blocks, which may sit anywhere in the pool."""

    size_gb: float
    placed: bool
    range_bytes: tuple[int, int] | None = None  # [start, end) of its run, contiguous allocators only
    blocks: int | None = None  # paged allocators only
    freed: bool = False


@dataclass(slots=True)
class ScenarioOutcome:
    """One allocator's run of the seed scenario; holes and free space are measured before the new request."""

    allocator: str
    placements: list[ScenarioPlacement]  # the initial requests in order, then the new one
    holes_bytes: list[tuple[int, int]]  # free [start, end) runs, contiguous allocators only
    free_bytes: int
    largest_free_run_bytes: int
    new_fits: bool
    why: str


@dataclass(slots=True)
class SeedScenario:
    """The allocate-free-allocate story behind paging, with one outcome per allocator and a readable account."""

    pool_bytes: int
    bytes_per_token: int
    block_size: int
    outcomes: list[ScenarioOutcome]
    explanation: str


def _gb(nbytes: int) -> str:
    return f"{nbytes / GIB:.1f} GiB"


def _span(r: tuple[int, int]) -> str:
    return f"[{r[0] / GIB:.1f}, {r[1] / GIB:.1f}) GiB"


def _seed_why(a: Allocator, out: ScenarioOutcome, new_bytes: int, reserve_bytes: int) -> str:
    new = out.placements[-1]
    free, largest = out.free_bytes, out.largest_free_run_bytes
    if isinstance(a, Paged):
        if new.placed:
            return (f"fits: its {new.blocks:,} blocks of {a.block_size} tokens need not be adjacent, "
                    f"so all {_gb(free)} free is usable")
        return f"refused: needs {_gb(new_bytes)} of blocks, only {_gb(free)} free in total"
    need = reserve_bytes if isinstance(a, ReserveMax) else new_bytes
    what = f"its {_gb(need)} reservation" if isinstance(a, ReserveMax) else "it"
    if new.placed:
        why = f"fits at {_span(new.range_bytes)}"
        small = [h for h in out.holes_bytes if h[1] - h[0] < need and h[0] < new.range_bytes[0]]
        if small:
            why += (f"; the {', '.join(_gb(e - s) for s, e in small)} hole{'s' if len(small) > 1 else ''} before "
                    f"it {'are' if len(small) > 1 else 'is'} too small for {what} and stay{'' if len(small) > 1 else 's'}"
                    f" unused (external fragmentation)")
        if isinstance(a, ReserveMax):
            why += (f"; every request reserves {_gb(need)} whatever its size, "
                    f"so {_gb(need - new_bytes)} of this one holds no token")
        return why
    if free >= need:
        return (f"refused: {_gb(free)} free in total is enough, but the largest hole is {_gb(largest)} "
                f"and {what} must be one contiguous run (external fragmentation)")
    why = f"refused: needs {_gb(need)}, only {_gb(free)} free in total"
    return why + (" (every request reserves that much whatever its size)" if isinstance(a, ReserveMax) else "")


def seed_scenario(pool_gb: float = 80.0, sizes_gb: tuple[float, ...] = (3.0, 2.3, 4.5), free_index: int = 1,
                  new_gb: float = 7.5, *, bytes_per_token: int = 131_072, block_size: int = 16,
                  reserve_gb: float = 8.0) -> SeedScenario:
    """Allocate `sizes_gb` in order, free request `free_index`, then try a `new_gb` request, on a contiguous
    first-fit allocator, a paged one and reserve-max (each request reserves `reserve_gb`, i.e.
    max_model_len x bytes_per_token). Sizes are GiB (2**30 bytes; the `_gb` names are the seeds'): at Llama-3-8B's
    131,072 bytes/token (bf16) 1 GiB is 8,192 tokens, whole blocks of 16, so the numbers add up exactly."""
    if not 0 <= free_index < len(sizes_gb):
        raise ValueError(f"free_index {free_index} is not one of the {len(sizes_gb)} requests")
    pool = int(pool_gb * GIB) // bytes_per_token

    def tokens(gb: float) -> int:
        return max(1, math.ceil(gb * GIB / bytes_per_token - 1e-6))

    allocators: list[Allocator] = [ContiguousExact(pool), Paged(pool, block_size),
                                   ReserveMax(pool, tokens(reserve_gb))]
    outcomes = []
    lines = [f"Pool {pool_gb:g} GiB = {pool:,} tokens x {bytes_per_token:,} bytes/token. Allocate "
             f"{', '.join(f'{g:g}' for g in sizes_gb)} GiB, free the {sizes_gb[free_index]:g} GiB one, "
             f"then ask for {new_gb:g} GiB."]
    for a in allocators:
        placements = []
        for i, gb in enumerate([*sizes_gb, new_gb]):
            if i == len(sizes_gb):  # the state the new request meets
                if placements[free_index].placed:
                    a.release(free_index)
                    placements[free_index].freed = True
                holes = [(s * bytes_per_token, e * bytes_per_token) for s, e in a.holes()] \
                    if isinstance(a, ContiguousExact) else []
                free, largest = a.free_tokens() * bytes_per_token, a.largest_free_run() * bytes_per_token
            t = tokens(gb)
            p = ScenarioPlacement(gb, a.admit(i, t - 1, t))
            if p.placed and isinstance(a, ContiguousExact):
                s, e = a.span(i)
                p.range_bytes = (s * bytes_per_token, e * bytes_per_token)
            elif p.placed:
                p.blocks = -(-t // block_size)
            placements.append(p)
        out = ScenarioOutcome(a.name, placements, holes, free, largest, placements[-1].placed, "")
        out.why = _seed_why(a, out, tokens(new_gb) * bytes_per_token, tokens(reserve_gb) * bytes_per_token)
        outcomes.append(out)
        lines.append(f"{a.name}:")
        for p in placements:
            where = (_span(p.range_bytes) if p.range_bytes else
                     f"{p.blocks:,} blocks" if p.blocks else "refused")
            lines.append(f"  {p.size_gb:g} GiB -> {where}{' (freed)' if p.freed else ''}")
        if holes:
            lines.append("  holes: " + ", ".join(_span(h) for h in holes))
        lines.append(f"  free {_gb(free)}, largest free run {_gb(largest)}")
        lines.append(f"  {new_gb:g} GiB request: {out.why}")
    return SeedScenario(pool * bytes_per_token, bytes_per_token, block_size, outcomes, "\n".join(lines))
