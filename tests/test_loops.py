"""Training loops as users write them, at every stage and precision, against DDP, FSDP2 and GradScaler."""

import pytest

import cases_loops as cases


@pytest.mark.parametrize("stage, memory_plan", [(0, None), (0, False), (1, None), (2, None), (3, None)])
def test_zero_grad_before_or_after_the_update_matches_ddp(ranks2, stage, memory_plan):
    """At the defaults (stage 0 planned); stage 0 unplanned too, where the peaks compare byte for byte (planned,
    each loop's graph places its buffers in an arena of its own plan)."""
    result = ranks2.run(cases.zero_grad_anywhere, stage=stage, memory_plan=memory_plan)[0]
    peaks = result["peaks"]
    if memory_plan is False:
        # gradients of the last step are not fed back as zeros: no more memory than zeroing first
        assert peaks["zero_grad last"] == peaks["model.zero_grad() last"] == peaks["zero_grad first"]
    # zero tensors left in .grad by set_to_none=False are read by the next step: one graph for that, at stage 0
    expected = {name: 1 for name in cases.LOOPS}
    if stage == 0:
        expected["zero_grad last, set_to_none=False"] = expected["zero_grad(set_to_none=False) first"] = 2
    assert result["traces"] == expected


# every stage and every precision, each precision twice, not every pair: the suite stays under ten minutes
@pytest.mark.parametrize("stage, precision", [(1, "fp32"), (2, "bf16"), (3, "fp16"), (1, "fp16"), (3, "bf16")])
def test_short_batch_eval_step_and_weight_decay_change_retrace_once_each(ranks2, stage, precision):
    result = ranks2.run(cases.changes_between_steps, stage=stage, precision=precision)[0]
    assert result["traces"] == 4  # the first, the short batch, eval; back in train mode the first graph again; wd
    reasons = result["retraces"]
    assert len(reasons) == 3 and "batch" in reasons[0] and "training" in reasons[1] and "weight_decay" in reasons[2]
    assert reasons[1].endswith(", training: True -> False"), reasons  # once, not once per module


@pytest.mark.parametrize("stage, precision", [(0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32"), (1, "bf16"),
                                              (3, "bf16"), (2, "fp16")])
def test_evaluating_through_the_step_under_no_grad_matches_the_referee(ranks2, stage, precision):
    """From stage 1 on the step takes the parameters on its first call, an evaluation's too, and a graph that trains
    nothing reads them where the step keeps them."""
    result = ranks2.run(cases.evaluate_between_steps, stage=stage, precision=precision)[0]
    # eval and train; at stage 0 the eval and train graphs again once .grad exists (the first graph read none)
    assert result["traces"] == (4 if stage == 0 else 2)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_float_batch_in_bf16_matches_fsdp2(ranks2, stage):
    """The case compares every step's loss with FSDP2's; the batch is cast to bf16 as it enters the model."""
    ranks2.run(cases.float_batch_in_bf16_against_fsdp2, stage=stage)


@pytest.mark.parametrize("stage, cast_at_gather", [(0, True), (1, True), (2, True), (3, True), (3, False)])
def test_fp16_clipping_reads_unscaled_gradients_as_grad_scaler_unscale(ranks2, stage, cast_at_gather):
    """Stage 3 at its default units (one block each), the others with small buckets; stage 3 also with its fp16
    shards kept."""
    result = ranks2.run(cases.fp16_clip_against_grad_scaler, stage=stage, cast_at_gather=cast_at_gather,
                        bucket_bytes=None if stage == 3 else 8 * 1024)[0]
    assert all(0.1 < n < 100 for n in result["norms"])  # a scaled norm would be 1024 times larger
    assert result["scale"] == result["ref_scale"] == 2.0**10  # no overflow, no growth within 2000 steps


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_frozen_parameters_in_bf16_match_fsdp2(ranks2, stage):
    result = ranks2.run(cases.frozen_bf16_against_fsdp2, stage=stage)[0]
    assert result["num_params"] == 23392  # Ψ counts the trainable parameters: 28,064 less the 4,672 frozen


def test_unfreezing_retraces_and_trains_as_under_ddp(ranks2):
    result = ranks2.run(cases.unfreeze_against_ddp, stage=2)[0]
    assert result["traces"] == 2 and result["moved"]
    assert result["released"] == 0  # the step took the parameter when it began to train


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_two_optimizers_match_ddp(ranks2, stage):
    result = ranks2.run(cases.two_optimizers_against_ddp, stage=stage)[0]
    model = cases.gpt_and_adamw()[0]
    matrices = sum(p.numel() for p in model.parameters() if p.dim() >= 2)
    assert result["num_params"] == 28064
    # AdamW keeps 8 bytes per element of the matrices, SGD with momentum 4 per element of the rest
    assert result["k"] == pytest.approx((8 * matrices + 4 * (28064 - matrices)) / 28064)


@pytest.mark.parametrize("stage", [0, 3])
def test_two_optimizers_in_fp16_scale_once_and_skip_together(ranks2, stage):
    for result in ranks2.run(cases.two_optimizers_fp16_overflow, stage=stage):
        assert result["scales"] == [2.0**11, 2.0**12, 2.0**13, 2.0**14]  # grown once per step, not per optimizer
        assert result["after_overflow"] == 2.0**13


@pytest.mark.parametrize("stage, precision, memory_plan", [(0, "fp32", None), (1, "fp32", None), (2, "fp32", True),
                                                        (3, "fp32", None), (0, "bf16", None), (1, "bf16", None),
                                                        (2, "bf16", None), (3, "bf16", None)])
def test_gradients_accumulated_across_calls_match_the_referee(ranks2, stage, precision, memory_plan):
    """An update every k-th call with an evaluation inside a window; zero_grad() outside the step after an update
    and to drop a window (set to None, or zeroed); zero_grad() opening each window; one optimizer of two stepping
    every call; no zero_grad() at all (each update steps with every gradient so far); against DDP in fp32 and FSDP2
    in bf16. From stage 1 on, between calls the step keeps this rank's shard of each gradient eager would still hold
    (the fp32 master's in bf16): one an optimizer has not stepped with yet, and one it stepped with when the step
    adds to the gradients it finds (no zero_grad() before backward), until zero_grad() sets .grad to None. Stage 2
    planned: the shards a call leaves in its arena move out before the next call writes there."""
    result = ranks2.run(cases.accumulate_across_calls_against_the_referee, stage=stage, precision=precision,
                        memory_plan=memory_plan)[0]
    # in bf16 the parameters' updates: FSDP2's, to within 1% (a call's gradients left out: 94% off; the gradients
    # an update used dropped where no zero_grad() comes: 30% off at stage 3)
    assert all(error < 1e-2 for error in result["update_error"].values()), result["update_error"]
    model = cases.gpt_and_adamw()[0]
    # this rank's half of every parameter (each numel is even: no padding), or of the matrices AdamW updates
    half = 0 if stage == 0 else 4 * sum(p.numel() for p in model.parameters()) // 2
    matrices = 0 if stage == 0 else 4 * sum(p.numel() for p in model.parameters() if p.dim() >= 2) // 2
    window = [True, True, False, True, False, True, True, False]  # kept after the call: not after an update
    dropped = [kept and i != cases.DROPPED_WINDOW_AT for i, kept in enumerate(window)]  # nor once set to None
    expected = {"update every k-th call": window, "zero_grad() outside, set to None": dropped,
                "zero_grad() outside, zeroed": [True] * 8, "zero_grad() opening each window": [True] * 8,
                "model.zero_grad() opening each window": [True] * 8, "no zero_grad() anywhere": [True] * 8}
    for name, kept_after in expected.items():
        assert result["kept"][name] == [half if kept else 0 for kept in kept_after], name
    assert result["kept"]["two optimizers"] == [matrices if kept else 0 for kept in window]
    # every training call reduces its own gradients once (Ψ elements); only an update gathers parameters after it
    # (stages 1-2); stage 3 gathers them for forward and again for backward (but the unit backward starts with,
    # kept gathered), in every training call alike, and an evaluation gathers them once
    psi = sum(p.numel() for p in model.parameters())
    reduced = "all_reduce" if stage == 0 else "reduce_scatter"
    to_train = {sent.get("all_gather") for sent, (train, _) in zip(result["sent"], cases._CALLS) if train}
    for (train, update), sent in zip(cases._CALLS, result["sent"]):
        expected = {reduced: psi} if train else {}
        if stage in (1, 2) and update:
            expected["all_gather"] = psi
        if stage == 3:
            expected["all_gather"] = sent["all_gather"] if train else psi
        assert sent == expected
    if stage == 3:
        assert len(to_train) == 1 and psi < to_train.pop() < 2 * psi
    # a graph per kind of call: finding no gradient or some, evaluating, updating, and where zero_grad() outside set
    # them to None, finding none in the middle of a window; a window's opening call finds the gradients the last
    # window's update used, or none on the first call; at stage 0 in fp32 .grad also keeps the gradients an update
    # used where the step resets them before backward (as eager does), which makes one more kind of call there
    traces = {"update every k-th call": 4, "zero_grad() outside, set to None": 5, "zero_grad() outside, zeroed": 4,
              "zero_grad() opening each window": 5, "model.zero_grad() opening each window": 5, "two optimizers": 4,
              "no zero_grad() anywhere": 4}
    if stage == 0 and precision == "fp32":
        traces["two optimizers"] = 5
    assert result["traces"] == traces


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp16_updates_with_no_zero_grad_between_match_grad_scaler(ranks2, stage):
    """Under float16 loss scaling the step keeps the unscaled gradients an update used where nothing resets them
    before the next backward, and unscales them with the next call's scaled ones, as GradScaler does; an evaluation
    through the step between two updates passes them on."""
    errors = ranks2.run(cases.fp16_updates_without_zero_grad_in_the_step_against_grad_scaler, stage=stage)[0]
    # FSDP2's updates (0.0 seen at 2 ranks; the gradients an update used dropped: 0.6% off at stage 3)
    assert all(error < 1e-4 for error in errors.values()), errors


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_an_update_before_backward_steps_with_the_last_calls_gradients(ranks2, precision):
    """``step(); zero_grad(); forward; backward()`` at stage 0 (from stage 1 on the model may not be read after an
    update in the same call: test_capture): the gradients each call leaves, the fp32 masters' in bf16, are the next
    call's update, as DDP's and FSDP2's. (bf16 kept none before, and the model never trained: 100% off FSDP2.)"""
    result = ranks2.run(cases.update_first_against_the_referee, precision=precision)[0]
    every_gradient = 4 * sum(p.numel() for p in cases.gpt_and_adamw()[0].parameters())  # fp32, in bf16 too
    assert result["left"] == [every_gradient] * 4
    if precision == "bf16":
        assert result["update_error"] < 1e-2


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_microbatches_in_bf16_sum_as_fsdp2_sums_them_from_stage_2(ranks2, stage):
    """Stages 2-3 reduce-scatter each micro-batch's gradients and sum the shards in fp32, the masters' gradients'
    dtype, as FSDP2 does (summed in bf16 they were 0.7% off). Stages 0-1 reduce once, after backward has summed
    the full gradients in bf16 as autograd accumulates them: within a few percent."""
    error = ranks2.run(cases.microbatches_in_bf16_against_fsdp2, stage=stage)[0]
    assert error < (1e-3 if stage >= 2 else 5e-2), error


@pytest.mark.parametrize("stage, precision", [(0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32"), (0, "bf16"),
                                              (1, "bf16"), (2, "bf16"), (3, "bf16"), (1, "fp16"), (3, "fp16")])
def test_an_update_through_a_closure_matches_the_referee(ranks2, stage, precision):
    """The closure's forward and backward are the step's, not the update's (before, at stages 1-2 they read the
    parameters' shards the update writes: a shape error inside the graph). The case compares every loss, in fp32
    the parameters and optimizer state with DDP's, in bf16 and fp16 the parameters' updates with FSDP2's."""
    update_error = ranks2.run(cases.closure_against_the_referee, stage=stage, precision=precision)[0]
    assert update_error is None if precision == "fp32" else update_error < 1e-2


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_autocast_inside_the_step_matches_ddp(ranks2, stage):
    """Mixed precision written the eager way (fp32 parameters, autocast around forward) rather than with
    ``mixed_precision=``: the graph records autocast's casts, and every stage trains as DDP does."""
    ranks2.run(cases.autocast_against_ddp, stage=stage)
