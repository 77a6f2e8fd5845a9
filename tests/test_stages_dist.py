"""ZeRO stages 1-3 on gloo ranks: parity with DDP, and the paper's memory and communication, measured."""

import pytest

import cases_stages as cases


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stage_matches_ddp_on_two_ranks(ranks2, stage):
    results = ranks2.run(cases.parity_with_ddp, stage=stage)
    assert results[0]["released_numel"] == 0  # the module's parameter was released: the step owns the state
    assert results[0]["reduce_scatters"] > 3  # small buckets: the model spans several
