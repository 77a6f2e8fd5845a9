"""Training loops as users write them, at every stage and precision, against DDP, FSDP2 and GradScaler."""

import pytest

import cases_loops as cases


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_grad_before_or_after_the_update_matches_ddp(ranks2, stage):
    result = ranks2.run(cases.zero_grad_anywhere, stage=stage)[0]
    peaks = result["peaks"]
    if stage == 0:
        # gradients of the last step are not fed back as zeros: no more memory than zeroing first
        assert peaks["zero_grad last"] == peaks["model.zero_grad() last"] == peaks["zero_grad first"]
    # zero tensors left in .grad by set_to_none=False are read by the next step: one graph for that, at stage 0
    expected = {name: 1 for name in cases.LOOPS}
    if stage == 0:
        expected["zero_grad last, set_to_none=False"] = 2
    assert result["traces"] == expected


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_short_batch_eval_step_and_weight_decay_change_retrace_once_each(ranks2, stage, precision):
    result = ranks2.run(cases.changes_between_steps, stage=stage, precision=precision)[0]
    assert result["traces"] == 4  # the first, the short batch, eval; back in train mode the first graph again; wd
    reasons = result["retraces"]
    assert len(reasons) == 3 and "batch" in reasons[0] and "training" in reasons[1] and "weight_decay" in reasons[2]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp16_clipping_reads_unscaled_gradients_as_grad_scaler_unscale(ranks2, stage):
    result = ranks2.run(cases.fp16_clip_against_grad_scaler, stage=stage)[0]
    assert all(0.1 < n < 100 for n in result["norms"])  # a scaled norm would be about 65536 times larger
    assert result["scale"] == result["ref_scale"]
