"""Communication units chosen from the model: one repeated block each, a constant size as the model deepens,
size-capped where the model repeats nothing, overridable; gathered bytes bounded by the units in flight."""

import pytest
import torch
import torch.nn as nn

import cases_units as cases
import zerofx
from models import GPT, GPTConfig, token_batch, train_step


def _gather_units(model, **compile_kwargs):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = zerofx.compile(train_step, stage=3, **compile_kwargs)
    step(model, opt, *token_batch(0, 0, cfg=model.cfg))
    return step._last.ctx.artifacts["gather_buckets"]


def _gpt(n_layer):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=65, block_size=16, n_layer=n_layer, n_head=2, n_embd=32))


def test_units_are_the_blocks_and_keep_their_size_as_the_model_deepens():
    shallow, deep = _gather_units(_gpt(2)), _gather_units(_gpt(8))
    for buckets, n_layer in ((shallow, 2), (deep, 8)):
        assert [b.unit for b in buckets] == [f"blocks.{i}" for i in range(n_layer)]
        block = 4 * (32 * 96 + 96 + 32 * 32 + 32 + 32 * 128 + 128 + 128 * 32 + 32 + 4 * 32)  # fp32 bytes
        assert all(b.nbytes == block and b.reason == "unit" for b in buckets[1:-1])
        # the embeddings (10,368 bytes, under a quarter of a block) ride with the first block, ln_f with the last
        assert buckets[0].names[:2] == ["wte.weight", "wpe.weight"] and buckets[0].nbytes == block + 4 * (65 + 16) * 32
        assert buckets[-1].names[-2:] == ["ln_f.weight", "ln_f.bias"] and buckets[-1].nbytes == block + 4 * 64
    assert max(b.nbytes for b in deep) == max(b.nbytes for b in shallow)


class _Tower(nn.Module):
    """No repeated structure: layers of different widths as plain attributes."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 64), nn.Linear(64, 32), nn.Linear(32, 8)

    def forward(self, x, y):
        return ((self.c(torch.relu(self.b(torch.relu(self.a(x))))) - y) ** 2).mean()


def _tower_units(**compile_kwargs):
    torch.manual_seed(0)
    model = _Tower()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = zerofx.compile(train_step, stage=3, **compile_kwargs)
    step(model, opt, torch.randn(4, 16), torch.randn(4, 8))
    return step._last.ctx.artifacts["gather_buckets"]


def test_a_model_without_repeated_blocks_gets_size_capped_units():
    buckets = _tower_units(unit_cap_bytes=4096)
    # a.weight 4 KiB, a.bias 256 B, b.weight 8 KiB (alone: larger than the cap), b.bias + c.weight + c.bias 1,184 B
    assert [b.names for b in buckets] == [["a.weight"], ["a.bias"], ["b.weight"], ["b.bias", "c.weight", "c.bias"]]
    assert [b.reason for b in buckets] == ["between units", "cap", "cap", "cap"]
    assert all(b.nbytes <= 4096 for b in buckets if len(b.names) > 1)


def test_units_and_bucket_bytes_override():
    by_class = _tower_units(units=nn.Linear)
    assert [b.unit for b in by_class] == ["a", "b", "c"]
    picked = _tower_units(units=lambda path, module: path in ("a", "c"))
    assert [(b.unit, b.names) for b in picked] == [("a", ["a.weight", "a.bias"]), (None, ["b.weight", "b.bias"]),
                                                 ("c", ["c.weight", "c.bias"])]
    sized = _tower_units(bucket_bytes=9000)  # filled in order up to 9,000 bytes, units ignored
    assert [b.names for b in sized] == [["a.weight", "a.bias"], ["b.weight", "b.bias"], ["c.weight", "c.bias"]]
    assert {b.reason for b in sized} == {"bucket_bytes"}


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_gathered_bytes_stay_within_the_units_in_flight(ranks2, prefetch):
    r = ranks2.run(cases.gathered_high_water, prefetch=prefetch)[0]
    assert r["n_units"] == 6
    bound = (prefetch + 1) * r["largest_unit"] + r["largest_param"]
    assert r["gathered_high_water"] <= bound, r


def test_stats_and_dumps_name_every_unit(tmp_path):
    model = _gpt(2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = zerofx.compile(train_step, stage=3, dump_dir=str(tmp_path))
    step(model, opt, *token_batch(0, 0, cfg=model.cfg))
    assert step.stats().units == ["blocks.0: 61,184 bytes (unit)", "blocks.1: 51,072 bytes (unit)"]
    text = (tmp_path / "units.txt").read_text()
    assert "  blocks.0: 61,184 bytes, unit; wte.weight, wpe.weight, blocks.0.ln1.weight, ... 11 more" in text
    # the tied embedding, read again by the head, is smaller than a block: it stays gathered until then; ln_f,
    # whose output backward recomputes at the head, stays gathered across the head's read of wte until its backward
    assert "kept gathered until a later read (no larger than the largest unit): ln_f.bias, ln_f.weight, wte.weight" \
        in text
    assert "read again later" not in text


def test_a_tied_parameter_larger_than_any_unit_is_gathered_again():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=2048, block_size=16, n_layer=2, n_head=2, n_embd=32))  # wte: 262,144 bytes
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = zerofx.compile(train_step, stage=3)
    step(model, opt, *token_batch(0, 0, cfg=GPTConfig(vocab_size=2048, block_size=16)))
    artifacts = step._last.ctx.artifacts
    again = [(phase.value, b.names) for phase, b in artifacts["gathers"] if b.reason == "read again later"]
    assert again == [("forward", ["wte.weight"])] and "wte.weight" not in artifacts["kept_gathered"]
