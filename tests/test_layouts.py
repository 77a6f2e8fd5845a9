"""Parameters and buffers in layouts other than row-major train as under DDP, at every stage, planned or not."""

import pytest

import cases_layouts as cases


@pytest.mark.parametrize("memory_plan", [False, True])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_channels_last_and_transposed_parameters_and_buffers_match_ddp(ranks2, stage, memory_plan):
    assert all(ranks2.run(cases.strided_layouts_against_ddp, stage=stage, memory_plan=memory_plan))


@pytest.mark.parametrize("memory_plan", [False, True])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_batch_or_model_changing_layout_between_calls_re_traces_and_matches_eager(ranks2, stage, memory_plan):
    """A graph is traced for its inputs' strides: a channels-last batch after a contiguous one computed wrong
    gradients with the contiguous batch's graph. Alternating layouts trace one graph each (and, at stage 0, the
    model turning channels-last two more)."""
    assert ranks2.run(cases.layouts_changed_between_calls_against_eager, stage=stage,
                      memory_plan=memory_plan) == [2 if stage else 4] * 2
