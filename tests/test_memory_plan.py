"""`zerofx.memory.plan`: plans are valid for any lifetimes, deterministic, optimal where the optimum is known, and
the command line solves a file the planner wrote."""

import itertools
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import torch
from zerofx.memory import HEURISTICS, Block, plan, read_csv, write_csv
from zerofx.memory.lifetimes import Lifetime
from zerofx.memory import planner
from zerofx.memory.planner import Problem
from zerofx.memory.pools import BY_CLASS, JOINT, place, slot_place, slot_views

DATA = Path(__file__).parent / "data"

lifetimes = st.lists(st.tuples(st.integers(0, 300), st.integers(0, 40), st.integers(0, 12))
                     .map(lambda t: (t[0], t[1], t[1] + t[2])), max_size=40)


def aligned(size, alignment):
    return -(-size // alignment) * alignment


def most_alive(blocks, alignment=1):
    times = {t for _, start, _ in blocks for t in (start,)}
    return max((sum(aligned(s, alignment) for s, a, b in blocks if a <= t < b) for t in times), default=0)


def assert_valid(blocks, result, alignment):
    offsets = result.offsets
    assert len(offsets) == len(blocks)
    assert all(o >= 0 and o % alignment == 0 for o in offsets)
    held = [(o, o + aligned(s, alignment), a, b) for o, (s, a, b) in zip(offsets, blocks) if s and b > a]
    for (lo1, hi1, a1, b1), (lo2, hi2, a2, b2) in itertools.combinations(held, 2):
        assert not (a1 < b2 and a2 < b1 and lo1 < hi2 and lo2 < hi1), "blocks alive together share bytes"
    assert result.arena_bytes == max((hi for _, hi, _, _ in held), default=0)
    assert result.lower_bound_bytes == most_alive(blocks, alignment)
    assert result.arena_bytes >= result.lower_bound_bytes


def best_over_all_orders(blocks):
    """The optimum: some order of lowest-gap placements reaches it (exhaustive, for a handful of blocks)."""
    best = None
    for order in itertools.permutations(range(len(blocks))):
        offsets = {}
        for i in order:
            size, start, end = blocks[i]
            taken = sorted((offsets[j], offsets[j] + blocks[j][0]) for j in offsets
                           if blocks[j][1] < end and start < blocks[j][2])
            at = 0
            for lo, hi in taken:
                if lo >= at + size:
                    break
                at = max(at, hi)
            offsets[i] = at
        height = max((offsets[i] + blocks[i][0] for i in offsets), default=0)
        best = height if best is None else min(best, height)
    return best


@settings(max_examples=150, deadline=None)
@given(lifetimes, st.sampled_from([1, 8, 64]), st.sampled_from(HEURISTICS))
def test_plan_is_valid_and_deterministic(blocks, alignment, heuristic):
    result = plan(blocks, alignment=alignment, heuristics=[heuristic])
    assert_valid(blocks, result, alignment)
    assert plan(blocks, alignment=alignment, heuristics=[heuristic]) == result
    assert plan(np.array(blocks, dtype=np.int64).reshape(-1, 3), alignment, heuristics=[heuristic]) == result
    assert plan([Block(*b, id=str(i)) for i, b in enumerate(blocks)], alignment, heuristics=[heuristic]) == result


def greedy(blocks, order, alignment, rule):
    """Blocks placed one by one in ``order`` the textbook way: scan the placed blocks that overlap in time, bottom
    up, for the lowest gap that fits (first-fit) or the smallest one (best-fit, the lowest of equals), else the top."""
    offsets = [0] * len(blocks)
    placed = []
    for i in order:
        size, start, end = aligned(blocks[i][0], alignment), blocks[i][1], blocks[i][2]
        taken = sorted((offsets[j], offsets[j] + aligned(blocks[j][0], alignment)) for j in placed
                       if blocks[j][1] < end and start < blocks[j][2])
        gaps, top = [], 0
        for lo, hi in taken:
            if lo - top >= size:
                gaps.append((lo - top, top))
            top = max(top, hi)
        fitting = gaps if rule == "first-fit" else sorted(gaps)
        offsets[i] = fitting[0][1] if fitting else top
        placed.append(i)
    return tuple(offsets)


@settings(max_examples=150, deadline=None)
@given(lifetimes, st.sampled_from([1, 8, 64]))
def test_every_heuristic_places_as_the_textbook_greedy_and_the_smallest_wins(blocks, alignment):
    """The heuristics run together (`Problem.place`); each must place exactly as it would alone, scanning gaps."""
    problem = Problem(np.array(blocks, dtype=np.int64).reshape(-1, 3), alignment)
    arenas = []
    for name in HEURISTICS:
        alone = plan(blocks, alignment, heuristics=[name])
        assert alone.offsets == greedy(blocks, problem.order(name.split("/")[0]).tolist(), alignment,
                                       name.split("/")[1]), name
        arenas.append(alone.arena_bytes)
    together = plan(blocks, alignment, heuristics=HEURISTICS)
    assert_valid(blocks, together, alignment)
    assert together.arena_bytes == min(arenas)
    assert together.heuristic == HEURISTICS[arenas.index(min(arenas))]


def test_placement_across_many_runs_of_steps_and_far_apart_times(monkeypatch):
    """The neighbour lists are built a run of steps at a time (`Problem._chunks`): with runs of a few steps, 250
    blocks, times around ±10**12 and all heuristics together, each places as it does alone and as the greedy scan."""
    monkeypatch.setattr(planner, "_ENTRIES_PER_CHUNK", 50)
    rng = np.random.default_rng(7)
    start = rng.integers(-40, 40, 250) * 10**10
    blocks = [(int(s), int(a), int(a + d)) for s, a, d in
              zip(rng.integers(0, 5000, 250), start, rng.integers(0, 30, 250) * 10**10)]
    problem = Problem(np.array(blocks, dtype=np.int64), 8)
    assert len(problem._chunks(np.stack([problem.order("size")] * 2, axis=1))) > 100
    together = problem.place(list(HEURISTICS))
    for name, offsets in zip(HEURISTICS, together):
        order_key, rule = name.split("/")
        assert tuple(offsets.tolist()) == greedy(blocks, problem.order(order_key).tolist(), 8, rule), name


def _lifetimes_of(blocks, classes):
    device = torch.device("cpu")
    return [Lifetime(f"b{i}", None, size, start, end, category, device, False)
            for i, ((size, start, end), category) in enumerate(zip(blocks, classes))]


@settings(max_examples=60, deadline=None)
@given(lifetimes.flatmap(lambda b: st.tuples(st.just(b), st.lists(st.sampled_from(["activations", "grads", "comm"]),
                                                                   min_size=len(b), max_size=len(b)))),
       st.sampled_from([None, BY_CLASS]))
def test_pools_by_class_keep_each_class_apart_and_the_smaller_layout_wins(blocks_and_classes, layout):
    """Pooled, each class's blocks lie in its own pool and the pools do not overlap; either way blocks alive together
    share no byte; unforced, the arena is the smaller of the two layouts, both reported."""
    blocks, classes = blocks_and_classes
    placed = place(_lifetimes_of(blocks, classes), 64, layout)
    assert_valid(blocks, placed, 64)
    assert set(placed.arena_bytes_by_layout) == {JOINT, BY_CLASS}
    if layout is None:
        assert placed.arena_bytes == min(placed.arena_bytes_by_layout.values())
        return
    assert placed.layout == BY_CLASS and placed.arena_bytes == placed.arena_bytes_by_layout[BY_CLASS]
    pools = sorted(placed.pools.values())
    assert all(a + size <= b for (a, size), (b, _) in zip(pools, pools[1:]))
    for offset, (size, start, end), category in zip(placed.offsets, blocks, classes):
        low, pool_bytes = placed.pools[category]
        assert size == 0 or end <= start or low <= offset and offset + aligned(size, 64) <= low + pool_bytes


@settings(max_examples=40, deadline=None)
@given(lifetimes.filter(lambda b: len(b) <= 6))
def test_search_reaches_the_optimum(blocks):
    result = plan(blocks, alignment=1, time_budget_s=5)
    assert_valid(blocks, result, 1)
    assert result.optimal
    assert result.arena_bytes == best_over_all_orders([b for b in blocks if b[0] and b[2] > b[1]])


def test_optimum_at_the_lower_bound():
    blocks, _ = read_csv(DATA / "plan_at_bound.csv")
    greedy = plan(blocks, alignment=1)
    searched = plan(blocks, alignment=1, time_budget_s=5)
    assert (greedy.arena_bytes, greedy.lower_bound_bytes, greedy.optimal) == (8, 7, False)
    assert (searched.arena_bytes, searched.heuristic, searched.optimal) == (7, "search", True)


def test_optimum_above_the_lower_bound():
    blocks, _ = read_csv(DATA / "plan_above_bound.csv")
    rows = [(b.size, b.start, b.end) for b in blocks]
    result = plan(blocks, alignment=1, time_budget_s=5)
    assert (result.lower_bound_bytes, result.arena_bytes, result.optimal) == (4, 5, True)
    assert best_over_all_orders(rows) == 5


def test_invalid_blocks_are_refused():
    with pytest.raises(ValueError):
        plan([(-1, 0, 1)])
    with pytest.raises(ValueError):
        plan([(8, 3, 2)])
    with pytest.raises(ValueError):
        plan([(8, 0, 1)], alignment=0)
    with pytest.raises(ValueError):
        plan([(8, 0, 1)], heuristics=["largest/first-fit"])
    with pytest.raises(ValueError, match="the planner places fewer than"):
        plan([(1 << 57, 0, 2), (1 << 57, 1, 3)])
    with pytest.raises(ValueError, match="a block of"):  # rounded up to 64, it would wrap round to a negative size
        plan([(2**63 - 60, 0, 2), (5, 1, 3)])


def test_command_line_solves_a_file_the_planner_wrote(tmp_path):
    rng = np.random.default_rng(0)
    starts = rng.integers(0, 500, 300)
    rows = np.stack([rng.integers(1, 5000, 300), starts, starts + rng.integers(1, 60, 300)], axis=1)
    blocks = [Block(int(s), int(a), int(b), f"t{i}") for i, (s, a, b) in enumerate(rows)]
    expected = plan(blocks, alignment=1)
    problem, solution = tmp_path / "problem.csv", tmp_path / "solution.csv"
    write_csv(problem, blocks, expected.offsets)  # the offset column is ignored on input
    out = subprocess.run([sys.executable, "-m", "zerofx.memory", "plan", str(problem), "--out", str(solution)],
                         capture_output=True, text=True, check=True).stdout
    printed = dict(line.split(": ", 1) for line in out.strip().splitlines())
    assert int(printed["arena_bytes"]) == expected.arena_bytes
    assert int(printed["lower_bound_bytes"]) == expected.lower_bound_bytes
    assert float(printed["ratio"]) == pytest.approx(expected.ratio, abs=1e-4)
    solved, offsets = read_csv(solution)
    assert solved == blocks and offsets == list(expected.offsets)
    assert_valid([(b.size, b.start, b.end) for b in solved], expected, 1)


def test_area_order_with_products_past_int64():
    """Sizes and durations of 2**40 and more: ``area`` orders by the true product, which int64 would wrap."""
    blocks = [(2**40, 0, 2**41), (2**42, 0, 2**40), (2**41, 0, 2**43), (2**30, 0, 2**50)]
    order = Problem(np.array(blocks, dtype=np.int64), 1).order("area").tolist()
    assert order == sorted(range(4), key=lambda i: (-blocks[i][0] * (blocks[i][2] - blocks[i][1]), -blocks[i][0]))


def test_slot_views_are_contiguous_tensors_at_their_offsets_in_the_arena():
    """Each slot views its own bytes of the arena, as the ops writing into it need: contiguous, of its dtype and
    shape, starting at its byte offset, in the arena's storage (zero-size dimensions included), and writing one
    leaves every other byte as it was; an arena that starts inside its storage counts offsets from its own start."""
    storage = torch.zeros(64 + 1024, dtype=torch.uint8)
    raw = storage[64:]
    places = [(0, torch.float32, (4, 8)), (128, torch.bfloat16, (3, 0, 5)), (192, torch.int64, ()),
              (256, torch.float16, (2, 3, 4)), (512, torch.complex64, (7,)), (576, torch.bool, (64,))]
    views = slot_views(raw, places)
    for view, (offset, dtype, shape) in zip(views, places):
        assert view.dtype == dtype and view.shape == shape and view.is_contiguous()
        assert view.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr()
        assert slot_place(view) == (64 + offset, dtype, shape)  # counted in the storage
        view.fill_(1)
        end = offset + view.numel() * view.element_size()
        assert bool((raw[offset:end] != 0).any()) == (view.numel() > 0)
        assert not storage[:64].any() and not raw[:offset].any() and not raw[end:].any()
        raw.zero_()
