"""The optimizers zerofx captures beyond SGD, Adam and AdamW, at every stage and precision, under a schedule."""

import pytest

import cases_backend
import cases_optimizers as cases

# per-element state, which fixes K: fp32 bytes per trainable element (master weights add 4 under mixed precision)
STATE = {"RMSprop": ["grad_avg", "momentum_buffer", "square_avg"], "Adagrad": ["sum"],
         "Adamax": ["exp_avg", "exp_inf"], "NAdam": ["exp_avg", "exp_avg_sq"], "Adadelta": ["acc_delta", "square_avg"]}
COUNTERS = {"NAdam": ["mu_product", "step"]}


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_each_optimizer_trains_as_the_referee_under_one_cycle_lr(ranks2, stage, precision):
    """Hyperparameters the schedule moves (lr, momentum, beta1) are graph inputs: one trace for the whole run."""
    result = ranks2.run(cases.optimizers_against_referee, stage=stage, precision=precision)[0]
    for name, figures in result.items():
        assert figures["traces"] == 1, name
        assert figures["state"] == sorted(STATE[name] + COUNTERS.get(name, ["step"])), name
        assert figures["k"] == 4 * len(STATE[name]) + (0 if precision == "fp32" else 4), name



@pytest.mark.parametrize("stage", [1, 3])
def test_each_optimizer_through_the_backend_matches_ddp(ranks2, stage):
    """Stage 1 shards the optimizer state only, stage 3 everything; the update runs eagerly on the shards."""
    ranks2.run(cases_backend.each_optimizer_against_ddp, stage=stage)
