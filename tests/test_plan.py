"""``zerofx.plan``: predictions for a world of any size from the step's graph, checked against runs that really
happen here, and against the paper's figures."""

import torch

import cases_plan
import zerofx
from models import token_batch, train_step
from nanogpt import GPT, param_groups


def _one_block_gpt_on_meta():
    with torch.device("meta"):
        model = GPT(cases_plan.ONE_BLOCK_GPT)
    return model, torch.optim.AdamW(param_groups(model, weight_decay=0.1), lr=3e-3)


def _predicted(world_size):
    out = {}
    for name, options in cases_plan.RUNS.items():
        model, opt = _one_block_gpt_on_meta()
        stats = zerofx.plan(train_step, model, opt, token_batch(0, 0, batch=cases_plan.BATCH, cfg=cases_plan.ONE_BLOCK_GPT),
                            world_size=world_size, **cases_plan.compile_options(options))
        out[name] = {"model_states": stats.model_state_bytes, "peak": stats.peak_bytes,
                     "activations": stats.activation_bytes, "comm": stats.comm_volume}
    return out


def _assert_predicted_as_measured(predicted, measured):
    for name, want in measured.items():
        got = predicted[name]
        for part, nbytes in want["model_states"].items():
            assert abs(got["model_states"][part] - nbytes) <= 0.01 * want["model_states"]["total"], \
                (name, part, got["model_states"], want["model_states"])
        assert abs(got["peak"] - want["peak"]) <= 0.05 * want["peak"], (name, got["peak"], want["peak"])
        assert got["comm"] == want["comm"], (name, got["comm"], want["comm"])


def test_plan_predicts_what_two_ranks_measure(ranks2):
    """Stages 0-3 (fp32, bf16, checkpointed blocks) on 2 gloo ranks: the plan's model-state bytes by class within 1%
    of the measured total, its peak within 5% of the measured peak (live storages), the same communication."""
    measured = ranks2.run(cases_plan.measured_stats)[0]
    _assert_predicted_as_measured(_predicted(2), measured)


def test_plan_predicts_what_four_ranks_measure(ranks4):
    measured = ranks4.run(cases_plan.measured_stats)[0]
    _assert_predicted_as_measured(_predicted(4), measured)
