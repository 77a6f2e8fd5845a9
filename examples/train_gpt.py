"""Train a small character-level GPT data-parallel with zerofx.

    torchrun --standalone --nproc_per_node 2 examples/train_gpt.py --stage 0
    torchrun ... --stage 3 --ckpt-dir ckpt --save-every 20        # sharded checkpoints ckpt/step-20, ckpt/step-40, ...
    python examples/train_gpt.py --stage 0 --resume ckpt/step-40   # continue anywhere: other world size, other stage

Each rank draws its own batches from examples/data/zero.txt; zerofx captures the train step once into one graph
(forward, backward, AdamW), adds the stage's communication, and runs it on every rank.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist

import zerofx
from nanogpt import GPT, GPTConfig, param_groups

parser = argparse.ArgumentParser()
parser.add_argument("--stage", type=int, default=0)
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--bucket-mb", type=float, default=None,
                    help="buckets of this size instead of the units zerofx finds in the model (one block each)")
parser.add_argument("--prefetch", type=int, default=1, help="stage 3: all-gathers issued this many units ahead")
parser.add_argument("--checkpoint", action="store_true", help="recompute each block's activations in backward")
parser.add_argument("--activation-budget", type=float, default=None,
                    help="with checkpointing: the fraction of the blocks' activations kept (the rest recomputed)")
parser.add_argument("--dump-dir", default=None, help="write the graph after capture and after each pass here")
parser.add_argument("--report", action="store_true", help="measure memory and print zerofx.report at the end")
parser.add_argument("--ckpt-dir", default=None, help="save a sharded checkpoint here every --save-every steps")
parser.add_argument("--save-every", type=int, default=20)
parser.add_argument("--resume", default=None, help="a checkpoint directory to continue from")
args = parser.parse_args()

# --- processes: torchrun sets the environment; one process needs no group ---------------------------------------
device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
if int(os.environ.get("WORLD_SIZE", 1)) > 1:
    # on CPU, gloo with one worker thread: with two, torch 2.13 can corrupt the heap (README)
    dist.init_process_group("nccl" if device.type == "cuda" else zerofx.collectives.gloo_one_worker())
    if device.type == "cuda":
        torch.cuda.set_device(device)
rank = dist.get_rank() if dist.is_initialized() else 0
world_size = dist.get_world_size() if dist.is_initialized() else 1

# --- data: characters of a small text ------------------------------------------------------------------------------
text = open(os.path.join(os.path.dirname(__file__), "data", "zero.txt")).read()
chars = sorted(set(text))
data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
cfg = GPTConfig(vocab_size=len(chars), block_size=64, n_layer=2, n_head=4, n_embd=64)


def get_batch(step: int):
    g = torch.Generator().manual_seed(world_size * step + rank)  # each rank its own samples
    starts = torch.randint(0, len(data) - cfg.block_size - 1, (args.batch_size,), generator=g)
    x = torch.stack([data[s:s + cfg.block_size] for s in starts])
    y = torch.stack([data[s + 1:s + 1 + cfg.block_size] for s in starts])
    return x.to(device), y.to(device)


# --- model, optimizer, schedule ------------------------------------------------------------------------------------
torch.manual_seed(0)
model = GPT(cfg).to(device)
optimizer = torch.optim.AdamW(param_groups(model, weight_decay=0.1), lr=args.lr)
warmup = 5
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))


# --- the train step: ordinary PyTorch, compiled once -------------------------------------------------------------
bucket_bytes = None if args.bucket_mb is None else int(args.bucket_mb * 2**20)  # None: units from the model


@zerofx.compile(stage=args.stage, bucket_bytes=bucket_bytes, prefetch=args.prefetch,
                checkpoint="blocks" if args.checkpoint else None, activation_budget=args.activation_budget,
                dump_dir=args.dump_dir, track_memory=args.report)
def train_step(model, optimizer, x, y):
    optimizer.zero_grad()
    loss = model(x, y)
    loss.backward()
    optimizer.step()
    return loss


# --- resume: bind the step (graph and sharded state, no training), then load into it --------------------------------
progress = {"next_step": torch.tensor(0)}  # saved beside the model: where the data and the loop continue
if args.resume:
    train_step.bind(model, optimizer, *get_batch(0))
    zerofx.checkpoint.load(train_step, args.resume, extra={"scheduler": scheduler, "progress": progress})

for step in range(int(progress["next_step"]), args.steps):
    start = time.perf_counter()
    loss = train_step(model, optimizer, *get_batch(step))
    scheduler.step()
    if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
        print(f"step {step:3d}  loss {loss.item():.4f}  lr {scheduler.get_last_lr()[0]:.2e}  "
              f"{(time.perf_counter() - start) * 1e3:7.1f} ms")
    if args.ckpt_dir and (step + 1) % args.save_every == 0:
        progress["next_step"].fill_(step + 1)
        zerofx.checkpoint.save(train_step, os.path.join(args.ckpt_dir, f"step-{step + 1}"),
                               extra={"scheduler": scheduler, "progress": progress})

stats = train_step.stats()
if rank == 0:
    print(f"stage {stats.stage} on {stats.world_size} rank(s): {stats.num_params} parameters, "
          f"{len(stats.data_collectives())} collectives, {stats.comm_volume_psi:.2f} Psi sent per step and rank")
    if args.report:
        zerofx.report(train_step)
if dist.is_initialized():
    dist.destroy_process_group()
