"""Activation checkpointing: the pass at every stage, bitwise the step without it, with dropout on; the user's own
torch.utils.checkpoint in both modes against DDP."""

import pytest

import cases_checkpointing as cases


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_checkpointed_blocks_train_bitwise_as_without_and_hold_fewer_activations(ranks2, stage):
    figures = ranks2.run(cases.rules_against_no_checkpointing, stage=stage)[0]
    activations, peak, regions, flops = figures["none"]
    assert regions == 0 and flops == 0
    for name in ("blocks", "class", "predicate"):
        got_activations, got_peak, got_regions, got_flops = figures[name]
        assert got_regions == 2 and got_flops > 0, name  # one region per block, recomputed in backward
        assert got_activations < 0.75 * activations, (name, got_activations, activations)
        assert got_peak < peak, (name, got_peak, peak)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_users_own_checkpoint_matches_ddp(ranks2, use_reentrant):
    ranks2.run(cases.users_checkpoint_against_ddp, stage=3, use_reentrant=use_reentrant)
