"""Stage 3 on 4 gloo ranks with a sharded checkpoint save, repeated in fresh processes.

    make stress                                               # or:
    .venv/bin/python benchmarks/stress_checkpoint.py --runs 50

Each run starts ``--world-size`` new processes on a new port: 6 steps, ``zerofx.checkpoint.save``, 4 more steps,
the mean loss over ranks. The group is gloo with one worker thread (``zerofx.collectives.gloo_one_worker``);
``--torch-gloo`` uses torch's gloo as it comes, with two. A run passes when every rank exits cleanly within
``--timeout`` seconds; a rank killed by a signal (heap corruption aborts) or a hang fails it. One line per run, then
``N passed, M failed``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def rank_main(rank: int, world_size: int, port: int, checkpoint_dir: str, torch_gloo: bool) -> None:
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import torch
    import torch.distributed as dist

    import zerofx
    from nanogpt import GPT, GPTConfig, param_groups

    torch.set_num_threads(1)
    backend = "gloo" if torch_gloo else zerofx.collectives.gloo_one_worker()
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    cfg = GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=30)  # sizes that need padding
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(param_groups(model, weight_decay=0.1), lr=3e-3)

    def train_step(model, optimizer, x, y):
        optimizer.zero_grad()
        loss = model(x, y)
        loss.backward()
        optimizer.step()
        return loss

    def batch(i: int):
        g = torch.Generator().manual_seed(1000 * i + rank)
        return [torch.randint(0, cfg.vocab_size, (4, cfg.block_size), generator=g) for _ in range(2)]

    step = zerofx.compile(train_step, stage=3, bucket_bytes=8 * 1024)
    for i in range(6):
        step(model, opt, *batch(i))
    zerofx.checkpoint.save(step, checkpoint_dir)
    losses = torch.tensor([step(model, opt, *batch(i)).item() for i in range(6, 10)], dtype=torch.float64)
    dist.all_reduce(losses)
    if rank == 0:
        print(f"mean losses {[round(v, 6) for v in (losses / world_size).tolist()]}", flush=True)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _describe(code: int | None) -> str:
    if code is None:
        return "hung"
    if code < 0:
        return signal.Signals(-code).name
    return f"exit {code}"


def one_run(world_size: int, timeout: float, torch_gloo: bool) -> tuple[bool, str]:
    """Launch the ranks, wait for all; (passed, what happened)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="zerofx-stress-") as scratch:
        port = _free_port()
        logs = [open(os.path.join(scratch, f"rank{r}.log"), "w+") for r in range(world_size)]
        procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--world-size", str(world_size),
                                   "--port", str(port), "--checkpoint-dir", os.path.join(scratch, "ckpt")]
                                  + (["--torch-gloo"] if torch_gloo else []),
                                  env=env, stdout=logs[r], stderr=subprocess.STDOUT) for r in range(world_size)]
        deadline = time.monotonic() + timeout
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read())
            log.close()
    if all(c == 0 for c in codes):
        return True, outputs[0].strip().splitlines()[-1] if outputs[0].strip() else "ok"
    failed = [f"rank {r}: {_describe(c)}" + (f" ({_last_line(outputs[r])})" if _last_line(outputs[r]) else "")
              for r, c in enumerate(codes) if c != 0]
    return False, "; ".join(failed)


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1][:200] if lines else ""


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a run may take before it counts as hung")
    parser.add_argument("--torch-gloo", action="store_true",
                        help="torch's gloo as it comes (two worker threads), not zerofx.collectives.gloo_one_worker()")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)  # set on the processes a run launches
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.world_size, args.port, args.checkpoint_dir, args.torch_gloo)
        return 0
    passed = 0
    started = time.monotonic()
    for run in range(1, args.runs + 1):
        t0 = time.monotonic()
        ok, what = one_run(args.world_size, args.timeout, args.torch_gloo)
        passed += ok
        print(f"run {run}/{args.runs}: {'pass' if ok else 'FAIL'} in {time.monotonic() - t0:.1f}s: {what}",
              flush=True)
    total = time.monotonic() - started
    print(f"{passed} passed, {args.runs - passed} failed ({total:.0f}s, {total / args.runs:.1f}s per run)", flush=True)
    return 0 if passed == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
