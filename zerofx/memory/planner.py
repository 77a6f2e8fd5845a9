"""Offsets for buffers of known lifetimes in one arena, so that buffers alive at the same time never share a byte.

This is static memory allocation (the offline "dynamic storage allocation" problem): NP-hard, but greedy placement
in a good order usually lands close to the bound that no plan can beat, the most bytes alive at once. A heuristic
is an order (largest first, earliest first, ...) and a placement rule: a block goes to the lowest gap among the
blocks already placed that overlap it in time ("first-fit"), or to the tightest such gap ("best-fit"). The first
heuristic runs alone (on a step's buffers it usually reaches the bound, and the run stops there), the others
together; the smallest arena wins, the first listed of equals. Given a time budget, a branch-and-bound search then
looks for a smaller arena (`zerofx.memory.search`).

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
# the ones that won on MiniMalloc's challenging instances and on random problems
DEFAULT_HEURISTICS = ("size/first-fit", "start/first-fit", "start/best-fit", "degree/first-fit",
                      "contention/first-fit")


def plan(blocks, alignment: int = 64, time_budget_s: float = 0.0,
         heuristics: Sequence[str] = DEFAULT_HEURISTICS) -> Plan:
    """Offsets for ``blocks``: `Block` objects, ``(size, start, end)`` tuples, or an array of such rows.

    The heuristics alone are deterministic. ``time_budget_s`` > 0 lets a branch-and-bound search improve on them
    (problems of up to `search.MAX_BLOCKS` blocks); a search that completes is deterministic too and proves the
    result optimal, one cut short by the clock keeps the best arena found so far.
    """
    heuristics = list(dict.fromkeys(heuristics))
    unknown = [h for h in heuristics if h not in HEURISTICS]
    if unknown or not heuristics:
        raise ValueError(f"heuristics must be among {HEURISTICS}, not {heuristics}")
    began = time.perf_counter()
    problem = Problem(_as_array(blocks), alignment)
    placed = problem.place(heuristics[:1])
    if problem.arena(placed[0]) > problem.lower_bound and len(heuristics) > 1:
        placed += problem.place(heuristics[1:])
    arenas = [problem.arena(offsets) for offsets in placed]
    best = arenas.index(min(arenas))  # the first of equals
    offsets, arena, name = placed[best], arenas[best], heuristics[best]
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
        if self.n and int(rows[:, 0].max()) >= _VALUES:  # (and rounding up below cannot overflow)
            raise ValueError(f"a block of {int(rows[:, 0].max()):,} bytes: the planner places fewer than "
                             f"{_VALUES:,} in all")
        self.size = -(-rows[:, 0] // alignment) * alignment
        self.start, self.end = rows[:, 1], rows[:, 2]
        # blocks that hold no byte at any time (empty size or lifetime) overlap nothing and sit at offset 0
        self.active = np.flatnonzero((self.size > 0) & (self.end > self.start))
        total = sum(self.size[self.active].tolist())  # Python integers: a sum that cannot overflow
        if total >= _VALUES:
            raise ValueError(f"the blocks total {total:,} bytes: the planner places fewer than {_VALUES:,}")
        self.ptr, self.adj = self._overlaps()
        self.degree = np.diff(self.ptr)  # neighbours per block
        self.live, self.first_slot, self.end_slot = self._profile()
        self.lower_bound = int(self.live.max()) if self.live.size else 0

    def _overlaps(self) -> tuple[np.ndarray, np.ndarray]:
        """Each block's neighbours (blocks overlapping it in time) as CSR: ``adj[ptr[i]:ptr[i + 1]]``, ascending.

        Sorted by start, block p overlaps exactly the later blocks that start before p ends: one contiguous run
        each, found by binary search instead of comparing all pairs. The pairs, both ways round, are grouped by
        block with one sort of ``block << 32 | neighbour`` (a plain integer sort is several times faster than an
        argsort; blocks number fewer than 2**31)."""
        by_start = self.active[np.argsort(self.start[self.active], kind="stable")]
        starts = self.start[by_start]
        after = np.searchsorted(starts, self.end[by_start], side="left")
        counts = after - np.arange(len(by_start)) - 1
        first = np.repeat(np.arange(len(by_start)), counts)
        run_base = np.repeat(np.cumsum(counts) - counts, counts)
        second = first + 1 + np.arange(counts.sum()) - run_base
        a, b = by_start[first], by_start[second]
        pairs = np.concatenate([a << 32 | b, b << 32 | a])
        pairs.sort()
        ptr = np.zeros(self.n + 1, np.int64)
        ptr[1:] = np.cumsum(np.bincount(pairs >> 32, minlength=self.n))
        return ptr, pairs & 0xFFFFFFFF

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
            "area": (-size, -(size * duration.astype(np.float64))),  # in int64 it overflows past 2**63
            "contention": (-size, -self._peak_over_lifetime()[a]),
            "degree": (-size, -self.degree[a]),
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

    def place(self, heuristics: Sequence[str]) -> list[np.ndarray]:
        """Offsets for each heuristic, from placing the blocks one by one in its order, each by its rule.

        A block's candidates are 0 and its placed neighbours' ends: the lowest free offset of a gap is one of them.
        [x, x + size) is free when every neighbour starting below x + size has ended by x; intervals being
        nonempty, those ended by x are among those starting below x + size, so comparing two counts is enough.

        The heuristics advance together, one block each per step, as packed keys (`_Keys`): placing a block costs
        about as much in numpy calls as in numpy work, and a step makes the same few calls however many blocks it
        places."""
        count, width = len(heuristics), self.n + 1  # per heuristic: the n blocks, then the interval [-1, 0)
        assert count < 1 << (62 - _VALUE_BITS), "packed keys must stay below _NOT_FREE"
        keys = _Keys(count, width)
        lo, hi = keys.lo, keys.hi
        orders = np.stack([self.order(name.split("/")[0]) for name in heuristics], axis=1)
        ranks = np.full((count, width), len(orders))
        ranks[:, -1] = -1  # [-1, 0) is there from the start
        ranks[np.arange(count)[:, None], orders.T] = np.arange(len(orders))
        best_fit = [h for h, name in enumerate(heuristics) if name.endswith("/best-fit")]
        padded = np.append(self.adj, self.n)
        for chunk, chunk_end in self._chunks(orders):
            rows = orders[chunk:chunk_end]
            neighbours, needs, bounds = self._placed_neighbours(rows, chunk, ranks, padded)
            run_starts = (bounds[:-1] - np.repeat(bounds[:-1:count], count)).reshape(len(rows), count)
            positions = np.arange(int(np.diff(bounds[::count]).max()) + 1)
            targets, sizes, run_bounds = rows + np.arange(count) * width, self.size[rows], bounds.tolist()
            for step in range(len(rows)):
                first, stop = run_bounds[step * count], run_bounds[step * count + count]
                index = neighbours[first:stop]
                starts, ends = lo[index], hi[index]
                starts.sort()
                ends.sort()
                # the k-th sorted end has k + 1 ends at or below it; of equal ends only the last counts them all,
                # and the ones before it, never free, repeat its offset
                free = starts.searchsorted(ends + needs[first:stop]) == positions[1:stop - first + 1]
                chosen = np.minimum.reduceat(np.where(free, positions[:stop - first], _NOT_FREE), run_starts[step])
                for h in best_fit:
                    a, z = run_bounds[step * count + h] - first, run_bounds[step * count + h + 1] - first
                    chosen[h] = a + _tightest(starts[a:z], ends[a:z], free[a:z])
                at = ends[chosen]
                lo[targets[step]], hi[targets[step]] = at, at + sizes[step]
        return [keys.offsets(h) for h in range(count)]

    def _chunks(self, orders: np.ndarray):
        """Runs of steps whose neighbour lists, before dropping the unplaced, hold about `_ENTRIES_PER_CHUNK`
        entries: the lists of a whole problem would hold every pair of overlapping blocks once per heuristic."""
        entries = np.cumsum((self.degree[orders] + 1).sum(axis=1))
        cuts = np.flatnonzero(np.diff(entries // _ENTRIES_PER_CHUNK)) + 1
        bounds = [0, *cuts.tolist(), len(orders)]
        return [(first, stop) for first, stop in zip(bounds[:-1], bounds[1:]) if stop > first]

    def _placed_neighbours(self, rows: np.ndarray, chunk: int, ranks: np.ndarray, padded: np.ndarray):
        """For the blocks ``rows[step, h]``, one run each, step by step: the places among the packed keys of
        heuristic h's placed neighbours (the interval [-1, 0) first), beside each the size of the block the run is
        for, and the runs' bounds."""
        count, width = ranks.shape
        blocks = rows.ravel()
        counts = self.degree[blocks] + 1
        starts = np.cumsum(counts) - counts
        within = np.arange(counts.sum()) - np.repeat(starts, counts)
        # a run's first entry reads the entry before the block's neighbours (for block 0, index -1: ``padded``'s
        # last, which is also there where no block has neighbours), then becomes [-1, 0)
        neighbours = padded[np.repeat(self.ptr[blocks] - 1, counts) + within]
        neighbours[starts] = self.n
        neighbours += np.repeat(np.tile(np.arange(count) * width, len(rows)), counts)
        steps = np.repeat(np.arange(chunk, chunk + len(rows)), count)
        placed = ranks.ravel()[neighbours] < np.repeat(steps, counts)
        bounds = np.zeros(len(blocks) + 1, np.int64)
        bounds[1:] = np.cumsum(np.add.reduceat(placed, starts))
        return neighbours[placed], np.repeat(self.size[blocks], counts)[placed], bounds


class _Keys:
    """Every heuristic's placed intervals as packed integer keys, which one sort orders by heuristic, then by place:
    ``h << _VALUE_BITS | offset + 1``, so that the interval [-1, 0), which every block neighbours to make 0 a
    candidate, has no negative end. ``lo[h * width + i]`` and ``hi[...]`` are block i's under heuristic h."""

    def __init__(self, count: int, width: int):
        segments = np.arange(count, dtype=np.int64) << _VALUE_BITS
        self.lo = np.repeat(segments + 1, width)  # offset 0 until placed: where a block that holds nothing stays
        self.hi = self.lo.copy()
        self.lo[width - 1::width] -= 1  # [-1, 0)
        self.width = width

    def offsets(self, h: int) -> np.ndarray:
        return (self.lo[h * self.width:(h + 1) * self.width - 1] & _VALUES) - 1


_VALUE_BITS = 58
_VALUES = (1 << _VALUE_BITS) - 1
_NOT_FREE = 1 << 62  # above every key and every position
_TOP = np.array([_NOT_FREE])
_ENTRIES_PER_CHUNK = 1 << 17  # a few megabytes of index arrays at once; larger runs place no faster


def _distinct(values: np.ndarray) -> np.ndarray:
    """``values`` sorted, each once: ``np.unique`` without its first call's import of ``numpy.ma`` (1.3 MB resident
    in a process that has no other use for it)."""
    ordered = np.sort(values)
    return ordered[np.concatenate(([True], ordered[1:] != ordered[:-1]))] if ordered.size else ordered


def _tightest(starts: np.ndarray, ends: np.ndarray, free: np.ndarray) -> int:
    """Of one block's sorted neighbour keys, the free end with the least room above it before the next start (the
    lowest of equals); the top end's room is endless."""
    above = np.concatenate((starts, _TOP))[starts.searchsorted(ends)]
    return int(np.where(free, above - ends, _NOT_FREE).argmin())
