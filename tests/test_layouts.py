"""Parameters and buffers in layouts other than row-major train as under DDP, at every stage, planned or not."""

import pytest

import cases_layouts as cases


@pytest.mark.parametrize("memory_plan", [False, True])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_channels_last_and_transposed_parameters_and_buffers_match_ddp(ranks2, stage, memory_plan):
    assert all(ranks2.run(cases.strided_layouts_against_ddp, stage=stage, memory_plan=memory_plan))
