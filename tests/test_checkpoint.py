"""Sharded checkpoints: exact resume, another world size and stage, consolidation, FSDP2, bad checkpoints."""

import subprocess
import sys

import pytest
import torch

import cases_checkpoint as cases
import zerofx
from conftest import ROOT, _pool
from dist_pool import _free_port
from models import bn_and_sgd, bn_batch, gpt_and_adamw, train_step
from nanogpt import GPT


@pytest.mark.parametrize("stage, precision", [(0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32"),
                                              (2, "bf16"), (3, "fp16")])
def test_resume_is_bitwise_identical(ranks2, tmp_path, stage, precision):
    # bf16 at stage 2 rebuilds the gathered compute copies from loaded master shards; fp16 restores the loss scale
    results = ranks2.run(cases.resume_is_bitwise, stage=stage, checkpoint_dir=str(tmp_path / "ckpt"),
                         port=_free_port(), precision=precision)
    assert results[0]["position"] == 6  # the user's data position came back with the state
    assert results[0]["lr"] == pytest.approx(3e-3)  # the scheduler came back: a fresh one would be at 5/8 of it
    assert results[0]["traces"] == 1  # bound before loading: the loaded step runs the graph bind captured
    assert results[0]["scale"] == (2.0**12 if precision == "fp16" else None)  # a fresh scale would be at 2^11


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_resume_with_batchnorm_goes_on_from_rank_0s_running_statistics(ranks2, tmp_path, stage, precision):
    """Each rank's running statistics differ after a step; the next step's forward broadcasts rank 0's. A checkpoint
    holds rank 0's whichever rank it takes the replicated buffers from, so the resumed run's statistics, weights and
    losses are the uninterrupted run's, bit for bit, on every rank."""
    ranks2.run(cases.resume_is_bitwise, stage=stage, checkpoint_dir=str(tmp_path / "ckpt"), port=_free_port(),
               precision=precision, model="batchnorm")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_resume_with_nadam_restores_both_of_its_counters(ranks2, tmp_path, stage):
    ranks2.run(cases.resume_is_bitwise, stage=stage, checkpoint_dir=str(tmp_path / "ckpt"), port=_free_port(),
               model="nadam")


def test_a_full_state_dict_is_a_snapshot_buffers_included():
    """Kept as the best model so far, it does not change as training goes on: buffers are copies too."""
    model, opt = bn_and_sgd()
    step = zerofx.compile(train_step)
    step(model, opt, *bn_batch(0, 0))
    snapshot = zerofx.full_state_dict(step)
    kept = {k: v.clone() for k, v in snapshot["model"].items()}
    step(model, opt, *bn_batch(1, 0))
    assert all(torch.equal(snapshot["model"][k], v) for k, v in kept.items())
    assert not torch.equal(model.bn.running_mean, kept["bn.running_mean"])


@pytest.fixture(scope="module")
def four_rank_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("four") / "ckpt"
    losses = _pool(4).run(cases.save_at_four_ranks, checkpoint_dir=str(directory))[0]
    return directory, losses


def test_resume_on_two_ranks_at_stage_two(ranks2, four_rank_checkpoint):
    directory, reference = four_rank_checkpoint
    losses = ranks2.run(cases.resume_elsewhere, checkpoint_dir=str(directory), stage=2)[0]
    torch.testing.assert_close(losses, reference, rtol=1e-5, atol=0)


@pytest.mark.parametrize("stage", [0, 3])
def test_resume_on_one_process(four_rank_checkpoint, stage):
    directory, reference = four_rank_checkpoint
    losses = cases.resume_elsewhere(0, 1, checkpoint_dir=str(directory), stage=stage)
    torch.testing.assert_close(losses, reference, rtol=1e-5, atol=0)


def test_consolidate_loads_into_an_eager_model(four_rank_checkpoint, tmp_path):
    directory, reference = four_rank_checkpoint
    out = tmp_path / "full.pt"
    done = subprocess.run([sys.executable, "-m", "zerofx.checkpoint", "consolidate", str(directory), str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    model = GPT(cases.ODD_GPT)
    model.load_state_dict(torch.load(out), strict=True)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    x, y = cases._global_batch(6, 0, 1)
    with torch.no_grad():
        loss = model(x, y).item()
    torch.testing.assert_close(loss, reference[0], rtol=1e-5, atol=0)  # the first step after the save


def test_consolidate_refuses_an_unfinished_checkpoint(tmp_path):
    (tmp_path / "__0_0.distcp").write_bytes(b"")
    done = subprocess.run([sys.executable, "-m", "zerofx.checkpoint", "consolidate", str(tmp_path),
                           str(tmp_path / "out.pt")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "has no .metadata" in done.stderr
    assert not (tmp_path / "out.pt").exists()


def test_round_trip_with_fsdp2(ranks2, tmp_path):
    results = ranks2.run(cases.round_trip_with_fsdp2, from_fsdp2_dir=str(tmp_path / "fsdp2"),
                         from_zerofx_dir=str(tmp_path / "zerofx"))
    assert "head.weight" in results[0]["keys"] and "wte.weight" in results[0]["keys"]  # tied: both names


def test_bad_checkpoints_are_named_and_change_nothing(ranks2, tmp_path):
    results = ranks2.run(cases.bad_checkpoints, checkpoint_dir=str(tmp_path / "ckpt"))
    assert results[0]["errors"] == results[1]["errors"]  # every rank raises the same error
    errors = results[0]["errors"]
    assert "missing from the checkpoint: model.blocks.2.attn.proj.bias" in errors["deeper"]
    assert "optimizer.state.blocks.2.attn.proj.bias.exp_avg," in errors["deeper"]
    assert "... and 8 more" in errors["deeper"]  # 12 model + 36 optimizer keys: the first 40 named
    assert "in the checkpoint but not in this run: model.blocks.1.attn.proj.bias" in errors["shallower"]
    assert "model.wte.weight: shape (65, 32) in the checkpoint, (65, 16) here" in errors["narrower"]
    assert "__1_0.distcp missing" in errors["rank_file_missing"]
    assert "truncated __0_0.distcp" in errors["truncated"]
    assert "has no .metadata" in errors["unfinished"]
    assert results[0]["files_unchanged"] and results[1]["files_unchanged"]


def test_state_dict_needs_a_bound_step():
    step = zerofx.compile(train_step, stage=2)
    with pytest.raises(RuntimeError, match=r"step.bind\(model, optimizer"):
        zerofx.state_dict(step)


def test_load_state_dict_names_missing_keys_before_changing_anything():
    model, opt = gpt_and_adamw()
    x = torch.zeros(2, 16, dtype=torch.long)
    step = zerofx.compile(train_step, stage=3).bind(model, opt, x, x)
    full = zerofx.full_state_dict(step)
    broken = {**full, "model": {k: v + 1 for k, v in full["model"].items() if k != "ln_f.weight"}}
    with pytest.raises(KeyError, match=r"missing \['model.ln_f.weight'\]"):
        zerofx.load_state_dict(step, broken)
    after = zerofx.full_state_dict(step)
    assert all(torch.equal(full["model"][k], after["model"][k]) for k in full["model"])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP's note on single-process use
def test_the_step_is_a_dcp_stateful(tmp_path):
    import torch.distributed.checkpoint as dcp

    from models import token_batch

    model, opt = gpt_and_adamw()
    step = zerofx.compile(train_step, stage=3)
    for i in range(2):
        step(model, opt, *token_batch(i, 0))
    dcp.save({"train": step}, checkpoint_id=str(tmp_path), no_dist=True)
    expected = [step(model, opt, *token_batch(i, 0)).item() for i in (2, 3)]
    model, opt = gpt_and_adamw(seed=7)
    step = zerofx.compile(train_step, stage=3).bind(model, opt, *token_batch(2, 0))
    dcp.load({"train": step}, checkpoint_id=str(tmp_path), no_dist=True)
    assert [step(model, opt, *token_batch(i, 0)).item() for i in (2, 3)] == expected
