"""ZeRO over "dp" × tensor parallelism over "tp" on a 2 × 2 mesh of gloo ranks (cases in cases_tensor_parallel.py),
with activation checkpoints kept whole, partitioned across tp (P_a) and partitioned and offloaded (P_a+cpu)."""

import logging

import torch

import cases_tensor_parallel as cases
import zerofx
from models import gpt_and_adamw, token_batch, train_step

# stage 3, with P_a and with P_a+cpu, for 10 steps; stages 0-2 for 2
RUNS = (*((stage, "plain", 2) for stage in range(3)), *((3, v, 10) for v in ("plain", "P_a", "P_a+cpu")))
TP = 2
ACTIVATION = 4 * cases.CFG.block_size * cases.CFG.n_embd  # elements of one block input: batch 4 × T × C


def test_every_stage_and_p_a_match_fsdp2_with_the_same_tensor_parallel_plan(ranks4):
    """Stages 0-2 (2 steps), stage 3 plain, with P_a and with P_a+cpu (10 steps, blocks checkpointed): losses and every
    full parameter equal to FSDP2 (fully_shard over dp) with the same parallelize_module plan, within rtol 1e-5.
    Measured: P_a keeps 1/tp of the checkpoint bytes; P_a+cpu keeps one slice at a time on the device and the rest
    in the host pool."""
    runs = ranks4.run(cases.stages_match_fsdp2, runs=RUNS, timeout=600)
    for rank_runs in runs:
        assert len(rank_runs) == len(RUNS)
    figures = runs[0]
    split, offloaded = figures["stage 3 P_a"], figures["stage 3 P_a+cpu"]
    # per block, kept whole they would be: the block's input and its attention's all-reduced output (collectives
    # are kept, not recomputed)
    whole_bytes = cases.CFG.n_layer * 2 * ACTIVATION * 4
    assert split["checkpoint_bytes"] == whole_bytes
    assert split["resident"] == whole_bytes // TP
    slice_bytes = ACTIVATION * 4 // TP
    assert offloaded["resident"] == slice_bytes  # written to host as soon as it is cut
    assert offloaded["offloaded"] == split["resident"]
    # tp collectives: per block 2 all-reduces in forward and 4 in backward (the inputs of q, k, v and fc)
    assert split["tp_comm"] == cases.CFG.n_layer * 6 * ACTIVATION * 2 * (TP - 1) / TP
    assert figures["stage 3 plain"]["activation_comm"] == 0
    assert split["activation_comm"] == whole_bytes // 4 * (TP - 1) / TP
    assert "P_a's all-gathers of partitioned checkpoints" in split["report"]


def test_p_a_without_a_tensor_parallel_mesh_warns_and_changes_nothing(caplog):
    model, opt = gpt_and_adamw()
    with caplog.at_level(logging.WARNING, logger="zerofx"):
        step = zerofx.compile(train_step, partition_activations=True, keep_graphs=True)
    assert "partition_activations (P_a)" in caplog.text
    step(model, opt, *token_batch(0, 0))
    assert "needs a mesh with a 'tp' dimension" in zerofx.report(step, print_output=False)
    assert step.graph("partition_checkpoints").code == step.graph("checkpoint_activations").code
    torch.testing.assert_close(step.stats().activation_comm_volume, 0.0)


def test_tensor_parallel_gradients_kept_between_calls_match_fsdp2_at_every_stage(ranks4):
    """A step with no zero_grad(): an update every call (the next call adds to the gradient an update used), the
    same zeroed in place between calls, accumulation over two calls, set to None between calls, model.to() its own
    device between calls; stages 0-3 against FSDP2 with the same tensor-parallel plan. From stage 1 on the step
    keeps the gradient's shard, and .grad of a tensor-parallel parameter holds a DTensor marker that refuses to be
    read, by torch functions and by DTensor's own methods."""
    refusals = ranks4.run(cases.kept_gradients_match_fsdp2, timeout=600)[0]
    assert refusals[0] == {"norm": None, "to_local": None, "full_tensor": None}  # stage 0: the gradient is in .grad
    for stage in (1, 2, 3):
        for read, error in refusals[stage].items():
            assert f"the .grad of parameter 'blocks.0.attn.q.weight' is read between calls ({read})" in error
