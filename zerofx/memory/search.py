"""Branch and bound over placement orders: a smaller arena than the heuristics found, or a proof there is none.

Placing blocks one by one, each at the lowest offset where it fits, reaches an optimal plan in some order: take an
optimal plan and place its blocks by ascending offset; none lands above its optimal offset. Repeating with the
offsets found converges to an order whose offsets never decrease, so the search only places blocks in
non-decreasing offset, as MiniMalloc's canonical solutions do. In that order a gap wholly below the latest offset
never closes, which prunes hard: once an unplaced block fits wholly below it, the branch is dead.

The search asks "is there a plan within ``cap`` bytes?" for a cap one byte below the best arena known, again and
again, until the answer is no (the best is optimal), the cap reaches the lower bound, or the deadline passes.
"""

from __future__ import annotations

import time

import numpy as np

MAX_BLOCKS = 500  # the search recurses once per block, within Python's default limit of 1000 frames
_CLOCK_EVERY = 256  # nodes between looks at the clock


class _OutOfTime(Exception):
    pass


def search(problem, best_arena: int, deadline: float) -> tuple[np.ndarray | None, bool]:
    """Offsets with an arena below ``best_arena`` (None if none was found) and whether the arena is proven
    optimal (the best found, or ``best_arena`` itself when nothing smaller exists)."""
    if len(problem.active) > MAX_BLOCKS:
        return None, False
    found, cap = None, best_arena - 1
    try:
        while cap >= problem.lower_bound:
            offsets = _Decision(problem, cap, deadline).solve()
            if offsets is None:
                break
            found, cap = offsets, problem.arena(offsets) - 1
    except _OutOfTime:
        return found, False
    return found, True


class _Decision:
    """Depth-first search for a plan whose arena is at most ``cap``."""

    def __init__(self, problem, cap: int, deadline: float):
        self.cap, self.deadline, self.nodes = cap, deadline, 0
        self.index = problem.active.tolist()  # search positions -> block numbers
        position = {b: k for k, b in enumerate(self.index)}
        self.size = problem.size[problem.active].tolist()
        self.neighbours = [[position[int(j)] for j in problem.adj[problem.ptr[b]:problem.ptr[b + 1]]]
                           for b in self.index]
        self.slots = [(int(problem.first_slot[b]), int(problem.end_slot[b])) for b in self.index]
        self.unplaced_live = problem.live.copy()  # per time slot, bytes of the blocks not yet placed
        self.offset: list[int | None] = [None] * len(self.index)
        self.lowest = [0] * len(self.index)  # where each unplaced block fits now; it only rises
        self.unplaced = set(range(len(self.index)))
        self.problem = problem

    def solve(self) -> np.ndarray | None:
        if not self._descend(0):
            return None
        offsets = np.zeros(self.problem.n, np.int64)
        offsets[self.problem.active] = self.offset
        return offsets

    def _descend(self, floor: int) -> bool:
        if not self.unplaced:
            return True
        if floor + int(self.unplaced_live.max()) > self.cap:
            return False
        # a block placed at or above the top of another's slot would leave that one a gap below the new floor
        ceiling = min(self.lowest[u] + self.size[u] for u in self.unplaced)
        candidates = sorted((self.lowest[k], -self.size[k], k) for k in self.unplaced
                            if floor <= self.lowest[k] < ceiling)
        for at, _, k in candidates:
            self._tick()
            moved = self._place(k, at)
            if self._consistent(at) and self._descend(at):
                return True
            self._unplace(k, moved)
        return False

    def _place(self, k: int, at: int) -> list[tuple[int, int]]:
        """Places block ``k`` and returns the neighbours it pushed up, with where they fitted before."""
        self.offset[k] = at
        self.unplaced.discard(k)
        first, stop = self.slots[k]
        self.unplaced_live[first:stop] -= self.size[k]
        moved = []
        for u in self.neighbours[k]:
            if u in self.unplaced and self.lowest[u] < at + self.size[k] and at < self.lowest[u] + self.size[u]:
                moved.append((u, self.lowest[u]))
                self.lowest[u] = self._lowest_fit(u, self.lowest[u])
        return moved

    def _unplace(self, k: int, moved: list[tuple[int, int]]) -> None:
        for u, lowest in moved:
            self.lowest[u] = lowest
        first, stop = self.slots[k]
        self.unplaced_live[first:stop] += self.size[k]
        self.unplaced.add(k)
        self.offset[k] = None

    def _lowest_fit(self, k: int, above: int) -> int:
        """The lowest offset at or above ``above`` where block ``k`` fits among its placed neighbours (it fitted
        nowhere lower before, and placing blocks only closes gaps)."""
        taken = sorted((self.offset[j], self.offset[j] + self.size[j]) for j in self.neighbours[k]
                       if self.offset[j] is not None and self.offset[j] + self.size[j] > above)
        at = above
        for lo, hi in taken:
            if lo >= at + self.size[k]:
                break
            at = max(at, hi)
        return at

    def _consistent(self, floor: int) -> bool:
        """No unplaced block fits wholly below the floor (it would have to go there, out of order) and each fits
        under the cap."""
        return all(floor < self.lowest[u] + self.size[u] <= self.cap for u in self.unplaced)

    def _tick(self) -> None:
        self.nodes += 1
        if self.nodes % _CLOCK_EVERY == 0 and time.perf_counter() > self.deadline:
            raise _OutOfTime
