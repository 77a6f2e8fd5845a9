"""One world size: every rank builds every system, measures it once, then times all of them in interleaved rounds.

Each system takes the same batches in the same order: step 0 (capture, lazy state), steps 1-2 measured (bytes,
collectives), then per round ``warmup`` untimed and ``steps`` timed steps. Rounds rotate the order of the systems,
and each step time is compared with FSDP2's (resharding, same precision) from the same round, so that drift of the
machine falls on every system alike. DeepSpeed with its default buckets allocates gigabytes per rank, so it runs
last, one engine at a time, timed for one round beside FSDP2 again: its bytes are the point.
"""

from __future__ import annotations

import datetime
import os
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from nanogpt import GPTConfig
from peers import measure, systems
from peers.models import LlamaShape, build
from zerofx import formulas
from zerofx.collectives import gloo_one_worker

REFERENCE = "FSDP2 reshard"


@dataclass
class Settings:
    cfg: GPTConfig | LlamaShape
    batch_size: int
    bucket_elements: int  # zerofx's and DeepSpeed's buckets, whatever the precision
    rounds: int
    warmup: int
    steps: int
    precisions: tuple[str, ...]
    skip: tuple[str, ...]  # "deepspeed", "deepspeed-defaults"
    checkpoint: bool = False  # every system checkpoints each block's activations (zerofx: checkpoint="blocks")


@dataclass
class Result:
    name: str
    precision: str
    stage: int
    model_state_bytes: int = 0  # max over ranks: every storage alive between steps
    plan_bytes: int = 0  # of those, what zerofx's memory_plan keeps for the next step (its arena, its scalars)
    peak_bytes: int = 0  # max over ranks
    formula_bytes: float = 0.0
    collectives: int = 0
    comm_elements: float = 0.0
    comm_bytes: float = 0.0
    step_ms: list[float] = field(default_factory=list)  # median per round
    ratio: list[float] = field(default_factory=list)  # to the reference of the same precision, per round
    final_loss: float = float("nan")


def _batches(cfg: GPTConfig | LlamaShape, batch_size: int, rank: int, text: str):
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)

    def batch(step: int):
        g = torch.Generator().manual_seed(1000 * step + rank)
        starts = torch.randint(0, len(data) - cfg.block_size - 1, (batch_size,), generator=g)
        x = torch.stack([data[s:s + cfg.block_size] for s in starts])
        y = torch.stack([data[s + 1:s + 1 + cfg.block_size] for s in starts])
        return x, y

    return batch


def _builders(s: Settings) -> list:
    """(name, precision, build) in table order; build() returns a `systems.System`."""
    out = []
    for precision in s.precisions:
        bf16 = precision == "bf16"
        for stage in range(4):
            out.append((f"zerofx-{stage}", precision, lambda stage=stage, bf16=bf16: systems.zerofx_system(
                s.cfg, stage, bf16, checkpoint=s.checkpoint)))
        out.append(("zerofx-3 tuned buckets", precision, lambda bf16=bf16: systems.zerofx_system(
            s.cfg, 3, bf16, s.bucket_elements * (2 if bf16 else 4), checkpoint=s.checkpoint)))
        if not bf16:
            out.append(("DDP", precision, lambda: systems.ddp_system(s.cfg, s.checkpoint)))
        for reshard in (True, False):
            out.append(("FSDP2 reshard" if reshard else "FSDP2 no-reshard", precision,
                        lambda bf16=bf16, reshard=reshard: systems.fsdp2_system(s.cfg, bf16, reshard, s.checkpoint)))
        if "deepspeed" not in s.skip:
            for stage in (1, 2, 3):
                out.append((f"DeepSpeed-{stage}", precision, lambda stage=stage, bf16=bf16: systems.deepspeed_system(
                    s.cfg, stage, bf16, s.batch_size, s.bucket_elements)))
    return out


def _max_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _agree_on_failure(error: str | None) -> str | None:
    """A system that fails on one rank is skipped on all (the first rank's reason), so no rank waits alone."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, error)
    return next((e for e in gathered if e), None)


class Bench:
    def __init__(self, settings: Settings, rank: int, text: str):
        self.s = settings
        self.rank = rank
        self.batch = _batches(settings.cfg, settings.batch_size, rank, text)
        self.cfg = settings.cfg
        self.skipped: dict[str, str] = {}
        self.psi = sum(p.numel() for p in build(settings.cfg).parameters())  # Ψ: a tied embedding counts once
        self.next_step: dict[str, int] = {}
        self.started = time.perf_counter()

    def _formula(self, stage: int, precision: str) -> float:
        bytes_per = dict(b_param=2, b_grad=2, k_optimizer=12) if precision == "bf16" else {}
        f = formulas.formula(stage, **bytes_per)
        return f.evaluate(f.model_states, self.psi, dist.get_world_size())

    def _build(self, name: str, precision: str, build) -> tuple[systems.System | None, Result | None]:
        system, error = None, None
        try:
            system = build()
            system.step(*self.batch(0)).item()
        except Exception as e:  # noqa: BLE001 - reported in the table as the reason the system is missing
            error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            if self.rank == 0:
                traceback.print_exc()
        error = _agree_on_failure(error)
        if error:
            self.skipped[f"{name} ({precision})"] = error
            return None, None
        m = measure.measure(system.step, self.batch, 1)
        peak, state, plan = _max_over_ranks([m.peak_bytes, m.model_state_bytes, system.held_plan_bytes()])
        result = Result(system.name, precision, system.stage, int(state), int(plan), int(peak),
                        self._formula(system.stage, precision), m.collectives, m.comm_elements, m.comm_bytes)
        self.next_step[self._key(result)] = 3
        return system, result

    def _progress(self, what: str) -> None:
        if self.rank == 0:
            print(f"[{dist.get_world_size()} ranks, {time.perf_counter() - self.started:6.0f} s] {what}",
                  file=sys.stderr, flush=True)

    @staticmethod
    def _key(r: Result) -> str:
        return f"{r.name} ({r.precision})"

    def _time(self, system: systems.System, result: Result) -> tuple[float, float]:
        key = self._key(result)
        start = self.next_step[key]
        dist.barrier()
        measure.time_steps(system.step, self.batch, range(start, start + self.s.warmup))
        times, loss = measure.time_steps(system.step, self.batch,
                                         range(start + self.s.warmup, start + self.s.warmup + self.s.steps))
        self.next_step[key] = start + self.s.warmup + self.s.steps
        return statistics.median(_max_over_ranks(times)) * 1e3, loss

    def run(self) -> list[Result]:
        live = []
        for name, precision, build in _builders(self.s):
            system, result = self._build(name, precision, build)
            if system is not None:
                live.append((system, result))
            self._progress(f"built and measured {name} ({precision})")
        for r in range(self.s.rounds):
            order = live[r % len(live):] + live[:r % len(live)]
            times = {}
            for system, result in order:
                ms, result.final_loss = self._time(system, result)
                result.step_ms.append(ms)
                times[self._key(result)] = ms
            for _, result in live:
                reference = times.get(f"{REFERENCE} ({result.precision})")
                if reference:
                    result.ratio.append(times[self._key(result)] / reference)
            self._progress(f"round {r + 1} of {self.s.rounds}")
        results = [result for _, result in live]
        if "deepspeed" not in self.s.skip and "deepspeed-defaults" not in self.s.skip and "fp32" in self.s.precisions:
            reference = next((pair for pair in live if self._key(pair[1]) == f"{REFERENCE} (fp32)"), None)
            results += self._deepspeed_defaults(reference)
        return results

    def _deepspeed_defaults(self, reference) -> list[Result]:
        out = []
        for stage in (1, 2, 3):
            name = f"DeepSpeed-{stage} defaults"
            system, result = self._build(name, "fp32", lambda stage=stage: (
                systems.deepspeed_system(self.cfg, stage, False, self.s.batch_size, None)))
            if system is None:
                continue
            # as many steps as the others took, so that its final loss compares
            for _ in range(self.s.rounds - 1):
                self._time(system, result)
            ms, result.final_loss = self._time(system, result)
            result.step_ms.append(ms)
            if reference is not None:
                result.ratio.append(ms / self._time(*reference)[0])
            systems.release(system)
            self._progress(f"built, measured and timed {name}")
            out.append(result)
        return out


def worker(rank: int, world_size: int, port: int, settings: Settings, text: str, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
                      RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    # one gloo worker thread: torch 2.13's gloo with two corrupts its heap under concurrent collectives
    # (benchmarks/repro_gloo_heap_corruption.py); every system runs on the same group
    dist.init_process_group(gloo_one_worker(), rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=300))
    try:
        bench = Bench(settings, rank, text)
        measured = bench.run()
        if rank == 0:
            results.put({"world_size": world_size, "psi": bench.psi, "skipped": bench.skipped,
                         "results": [asdict(r) for r in measured]})
    except BaseException:
        results.put({"world_size": world_size, "error": f"rank {rank}:\n{traceback.format_exc()}"})
        raise
    finally:
        dist.destroy_process_group()
