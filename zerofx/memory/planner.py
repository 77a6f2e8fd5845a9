"""Offsets for buffers of known lifetimes in one arena, so that buffers alive at the same time never share a byte.

This is static memory allocation (the offline "dynamic storage allocation" problem): NP-hard, but greedy placement
in a good order usually lands close to the bound that no plan can beat, the most bytes alive at once. A heuristic
is an order (largest first, earliest first, ...) and a placement rule: a block goes to the lowest gap among the
blocks already placed that overlap it in time ("first-fit"), or to the tightest such gap ("best-fit"). Each
heuristic runs and the smallest arena wins; the run stops as soon as one reaches the bound. Given a time budget, a
branch-and-bound search then looks for a smaller arena (`zerofx.memory.search`).

Lifetimes are half-open, [start, end): a block freed at t and one allocated at t may share bytes. Times are any
integers (node positions in a graph, say). Sizes are rounded up to ``alignment`` before placement, so every offset
is a multiple of it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Block:
    """A buffer of ``size`` bytes alive over [start, end); ``id`` names it (a CSV row, a graph node)."""

    size: int
    start: int
    end: int
    id: object = None


@dataclass(frozen=True)
class Plan:
    offsets: tuple[int, ...]  # per block, in input order
    arena_bytes: int
    lower_bound_bytes: int  # the most aligned bytes alive at one time: no plan is smaller
    heuristic: str  # what found the winning plan: a name from HEURISTICS, or "search"
    optimal: bool  # proven: the arena equals the lower bound, or the search ran to completion
    elapsed_s: float = field(compare=False)

    @property
    def ratio(self) -> float:
        return self.arena_bytes / self.lower_bound_bytes if self.lower_bound_bytes else 1.0


ORDERS = ("size", "contention", "area", "duration", "degree", "start")
HEURISTICS = tuple(f"{order}/{rule}" for order in ORDERS for rule in ("first-fit", "best-fit"))
# the ones that won on MiniMalloc's challenging instances and on random problems; each costs about 0.12 s per
# 10,000 blocks
DEFAULT_HEURISTICS = ("size/first-fit", "start/first-fit", "start/best-fit", "degree/first-fit",
                      "contention/first-fit")


def plan(blocks, alignment: int = 64, time_budget_s: float = 0.0,
         heuristics: Sequence[str] = DEFAULT_HEURISTICS) -> Plan:
    """Offsets for ``blocks``: `Block` objects, ``(size, start, end)`` tuples, or an array of such rows.

    The heuristics alone are deterministic. ``time_budget_s`` > 0 lets a branch-and-bound search improve on them
    (problems of up to `search.MAX_BLOCKS` blocks); a search that completes is deterministic too and proves the
    result optimal, one cut short by the clock keeps the best arena found so far.
    """
    unknown = [h for h in heuristics if h not in HEURISTICS]
    if unknown or not heuristics:
        raise ValueError(f"heuristics must be among {HEURISTICS}, not {list(heuristics)}")
    began = time.perf_counter()
    problem = Problem(_as_array(blocks), alignment)
    best = None
    for name in heuristics:
        offsets = problem.place(name)
        arena = problem.arena(offsets)
        if best is None or arena < best[1]:
            best = (offsets, arena, name)
        if arena == problem.lower_bound:
            break
    offsets, arena, name = best
    optimal = arena == problem.lower_bound
    if time_budget_s > 0 and not optimal:
        from zerofx.memory.search import search  # the search needs the problem, which this module defines
        found, optimal = search(problem, arena, began + time_budget_s)
        if found is not None:
            offsets, arena, name = found, problem.arena(found), "search"
    return Plan(tuple(int(o) for o in offsets), int(arena), int(problem.lower_bound), name, bool(optimal),
                time.perf_counter() - began)


def _as_array(blocks) -> np.ndarray:
    """Rows of (size, start, end) as int64."""
    if isinstance(blocks, np.ndarray):
        rows = blocks
    else:
        rows = [(b.size, b.start, b.end) if isinstance(b, Block) else tuple(b) for b in blocks]
    rows = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
    if (rows[:, 0] < 0).any():
        raise ValueError("a block's size is negative")
    if (rows[:, 2] < rows[:, 1]).any():
        raise ValueError("a block ends before it starts")
    return rows


class Problem:
    """Blocks with aligned sizes, the blocks each overlaps in time, and what every order needs."""

    def __init__(self, rows: np.ndarray, alignment: int):
        if alignment < 1:
            raise ValueError("alignment must be at least 1")
        self.n = len(rows)
        self.size = -(-rows[:, 0] // alignment) * alignment
        self.start, self.end = rows[:, 1], rows[:, 2]
        # blocks that hold no byte at any time (empty size or lifetime) overlap nothing and sit at offset 0
        self.active = np.flatnonzero((self.size > 0) & (self.end > self.start))
        self.ptr, self.adj = self._overlaps()
        self.live, self.first_slot, self.end_slot = self._profile()
        self.lower_bound = int(self.live.max()) if self.live.size else 0

    def _overlaps(self) -> tuple[np.ndarray, np.ndarray]:
        """Each block's neighbours (blocks overlapping it in time) as CSR: ``adj[ptr[i]:ptr[i + 1]]``.

        Sorted by start, block p overlaps exactly the later blocks that start before p ends: one contiguous run
        each, found by binary search instead of comparing all pairs."""
        by_start = self.active[np.argsort(self.start[self.active], kind="stable")]
        starts = self.start[by_start]
        after = np.searchsorted(starts, self.end[by_start], side="left")
        counts = after - np.arange(len(by_start)) - 1
        first = np.repeat(np.arange(len(by_start)), counts)
        run_base = np.repeat(np.cumsum(counts) - counts, counts)
        second = first + 1 + np.arange(counts.sum()) - run_base
        rows = np.concatenate([by_start[first], by_start[second]])
        cols = np.concatenate([by_start[second], by_start[first]])
        grouped = np.argsort(rows)  # a neighbour's place in its row changes no gap, so no stable sort is needed
        ptr = np.zeros(self.n + 1, np.int64)
        ptr[1:] = np.cumsum(np.bincount(rows, minlength=self.n))
        return ptr, cols[grouped]

    def _profile(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Bytes alive in each slot between consecutive distinct times, and each block's slots [first, end)."""
        a = self.active
        times = _distinct(np.concatenate([self.start[a], self.end[a]]))
        first = np.searchsorted(times, self.start)
        stop = np.searchsorted(times, self.end)
        delta = np.zeros(len(times) + 1, np.int64)
        np.add.at(delta, first[a], self.size[a])
        np.add.at(delta, stop[a], -self.size[a])
        return np.cumsum(delta)[:max(len(times) - 1, 0)], first, stop

    def arena(self, offsets: np.ndarray) -> int:
        return int((offsets + self.size)[self.active].max()) if self.active.size else 0

    def order(self, key: str) -> np.ndarray:
        """Active blocks in the order ``key`` names; ties go to the earlier block, so orders are deterministic."""
        a = self.active
        size, duration = self.size[a], self.end[a] - self.start[a]
        keys = {
            "size": (-duration, -size),
            "duration": (-size, -duration),
            "area": (-size, -(size * duration)),
            "contention": (-size, -self._peak_over_lifetime()[a]),
            "degree": (-size, -np.diff(self.ptr)[a]),
            "start": (-size, self.start[a]),
        }[key]
        return a[np.lexsort(keys)]  # lexsort sorts by the last key first

    def _peak_over_lifetime(self) -> np.ndarray:
        """The most bytes alive at once while each block lives (blocks alive at the peak are hardest to fit)."""
        levels = [self.live]
        while 2 ** len(levels) <= len(self.live):  # sparse table: levels[k][i] = max of live[i : i + 2**k]
            prev, half = levels[-1], 2 ** (len(levels) - 1)
            levels.append(np.maximum(prev[:-half], prev[half:]))
        first, stop = self.first_slot, np.maximum(self.end_slot, self.first_slot + 1)
        k = np.floor(np.log2(stop - first)).astype(np.int64)
        peak = np.zeros(self.n, np.int64)
        for level in _distinct(k[self.active]).tolist():
            sel = self.active[k[self.active] == level]
            table = levels[level]
            peak[sel] = np.maximum(table[first[sel]], table[stop[sel] - 2 ** level])
        return peak

    def place(self, heuristic: str) -> np.ndarray:
        """Offsets from placing the blocks one by one in the heuristic's order, each by its rule."""
        order_key, rule = heuristic.split("/")
        fits = {"first-fit": _lowest_gap, "best-fit": _tightest_gap}[rule]
        # an unplaced block reads as the interval [-1, 0), below every gap, so no mask is needed
        lo = np.full(self.n, -1, np.int64)
        hi = np.zeros(self.n, np.int64)
        ptr, adj, size = self.ptr, self.adj, self.size
        for i in self.order(order_key).tolist():
            neighbours = adj[ptr[i]:ptr[i + 1]]
            x = fits(lo[neighbours], hi[neighbours], size[i]) if neighbours.size else 0
            lo[i], hi[i] = x, x + size[i]
        return np.maximum(lo, 0)


def _distinct(values: np.ndarray) -> np.ndarray:
    """``values`` sorted, each once: ``np.unique`` without its first call's import of ``numpy.ma`` (1.3 MB resident
    in a process that has no other use for it)."""
    ordered = np.sort(values)
    return ordered[np.concatenate(([True], ordered[1:] != ordered[:-1]))] if ordered.size else ordered


def _gaps(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Free stretches between the intervals [lo, hi), bottom up: their starts and their lengths (the one above
    everything is left out: it is unbounded), and where that one starts. Intervals with the same ``lo`` change no
    stretch of positive length whichever comes first, so any sort does."""
    by_lo = np.argsort(lo)
    lo, top = lo[by_lo], np.maximum.accumulate(hi[by_lo])
    starts = np.empty_like(top)
    starts[0], starts[1:] = 0, top[:-1]
    return starts, lo - starts, int(top[-1])


def _lowest_gap(lo: np.ndarray, hi: np.ndarray, size: int) -> int:
    starts, lengths, top = _gaps(lo, hi)
    fits = lengths >= size
    first = int(fits.argmax())
    return int(starts[first]) if fits[first] else top


def _tightest_gap(lo: np.ndarray, hi: np.ndarray, size: int) -> int:
    starts, lengths, top = _gaps(lo, hi)
    spare = np.where(lengths >= size, lengths, np.iinfo(np.int64).max)
    tightest = int(spare.argmin())
    return int(starts[tightest]) if lengths[tightest] >= size else top
