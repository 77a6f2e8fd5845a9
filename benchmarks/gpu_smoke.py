"""GPU smoke check, for a machine with one CUDA device: the compiled step runs on the GPU and matches eager.

    python benchmarks/gpu_smoke.py

World size 1 (NCCL refuses two ranks on one device); the multi-rank paths are the ones the gloo tests cover.
Prints one line per check and exits non-zero on the first mismatch.
"""

import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import zerofx  # noqa: E402
from nanogpt import GPT, GPTConfig, param_groups  # noqa: E402


def train_step(model, optimizer, x, y):
    optimizer.zero_grad()
    loss = model(x, y)
    loss.backward()
    optimizer.step()
    return loss


def main() -> None:
    assert torch.cuda.is_available(), "no CUDA device"
    device = torch.device("cuda")
    cfg = GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=256)
    runs = {}
    for name in ("eager", "zerofx"):
        torch.manual_seed(0)
        model = GPT(cfg).to(device)
        opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3)
        step = zerofx.compile(train_step) if name == "zerofx" else train_step
        losses, start = [], None
        for i in range(20):
            g = torch.Generator(device="cpu").manual_seed(i)
            x = torch.randint(0, cfg.vocab_size, (8, cfg.block_size), generator=g).to(device)
            y = torch.randint(0, cfg.vocab_size, (8, cfg.block_size), generator=g).to(device)
            if i == 5:
                torch.cuda.synchronize()
                start = time.perf_counter()
            losses.append(step(model, opt, x, y).item())
        torch.cuda.synchronize()
        runs[name] = (losses, (time.perf_counter() - start) / 15 * 1e3, model)
        print(f"{name:7s} final loss {losses[-1]:.5f}  {runs[name][1]:.2f} ms/step")
    torch.testing.assert_close(runs["zerofx"][0], runs["eager"][0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(runs["zerofx"][2].state_dict(), runs["eager"][2].state_dict(), rtol=1e-4, atol=1e-5)
    print("gpu smoke: OK")


if __name__ == "__main__":
    main()
