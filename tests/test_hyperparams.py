"""Hyperparameters as graph inputs: schedules that change them every step, branches torch.optim takes on them, and
the bound on how many graphs a step keeps. One process."""

import logging

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

import cases_hyperparams as cases
import zerofx
from models import bn_and_sgd, bn_batch, gpt_and_adamw, token_batch, train_step
from zerofx import optim_support


def gpt_and_sgd(**sgd):
    model, _ = gpt_and_adamw()
    return model, torch.optim.SGD(model.parameters(), **{"lr": 0.05, "momentum": 0.9, **sgd})


def bn_with(**sgd):
    model, _ = bn_and_sgd()
    return model, torch.optim.SGD(model.parameters(), **{"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4, **sgd})


def one_cycle(opt):
    scheduler = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=20, cycle_momentum=True)
    return lambda i: scheduler.step()


def set_each_step(name, values):
    """Sets ``group[name] = values[i]`` after step i."""
    def schedule_for(opt):
        def after_step(i):
            for group in opt.param_groups:
                group[name] = values[i]
        return after_step
    return schedule_for


def train_eager_and_compiled(make, batch, schedule_for, steps, **compile_kwargs):
    """The same schedule on eager torch.optim and on the compiled step; both runs' (model, opt, losses, step)."""
    runs = []
    for compiled in (False, True):
        model, opt = make()
        after_step = schedule_for(opt)
        step = zerofx.compile(train_step, **compile_kwargs) if compiled else train_step
        losses = []
        for i in range(steps):
            losses.append(step(model, opt, *batch(i, 0)).item())
            after_step(i)
        runs.append((model, opt, losses, step))
    return runs


def assert_bitwise_equal(eager_run, compiled_run):
    (ref, ref_opt, ref_losses, _), (_, _, losses, step) = eager_run, compiled_run
    assert losses == ref_losses
    full = zerofx.full_state_dict(step)  # from stage 1 on the step holds the state
    torch.testing.assert_close(full["model"], ref.state_dict(), rtol=0, atol=0)
    names = {id(p): n for n, p in ref.named_parameters()}
    ref_state = {names[id(p)]: state for p, state in ref_opt.state.items()}
    torch.testing.assert_close(full["optimizer"]["state"], ref_state, rtol=0, atol=0)


def retrace_messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "re-tracing" in r.getMessage()]


@pytest.mark.parametrize("make, batch", [(bn_and_sgd, bn_batch), (gpt_and_sgd, token_batch)], ids=["bn", "gpt"])
def test_one_cycle_lr_cycling_sgd_momentum_traces_once_and_matches_eager(make, batch):
    eager, compiled = train_eager_and_compiled(make, batch, one_cycle, steps=20)
    assert_bitwise_equal(eager, compiled)
    assert compiled[3].stats().traces == 1
    assert compiled[1].param_groups[0]["momentum"] != 0.9  # the schedule did move it


def test_nesterov_and_dampening_are_computed_with_the_scheduled_values():
    # dampening != 0 keeps the first step's buffer lazy: the second step traces the steady state, then no more
    for sgd in ({"nesterov": True}, {"dampening": 0.1}):
        eager, compiled = train_eager_and_compiled(lambda: bn_with(**sgd), bn_batch, one_cycle, steps=8)
        assert_bitwise_equal(eager, compiled)
        assert compiled[3].stats().traces == (2 if "dampening" in sgd else 1)
    dampening = [0.1, 0.3, 0.0, 0.2, 0.5, 0.05]
    eager, compiled = train_eager_and_compiled(lambda: bn_with(dampening=0.2), bn_batch,
                                               set_each_step("dampening", dampening), steps=6)
    assert_bitwise_equal(eager, compiled)
    assert compiled[3].stats().traces == 2


def test_momentum_to_zero_and_back_retraces_once_per_side(caplog):
    momentum = [0.9, 0.0, 0.0, 0.5, 0.7, 0.0, 0.8, 0.6]
    with caplog.at_level(logging.WARNING, logger="zerofx"):
        eager, compiled = train_eager_and_compiled(bn_with, bn_batch, set_each_step("momentum", momentum), steps=8)
    assert_bitwise_equal(eager, compiled)
    assert compiled[3].stats().traces == 2  # back on the non-zero side the first graph serves any value
    messages = retrace_messages(caplog)
    assert len(messages) == 1 and "('momentum', '> 0')" in messages[0] and "('momentum', '== 0')" in messages[0]
    assert "optimizer0: SGD: (" in messages[0] and "lr" not in messages[0], messages  # what changed, not the group


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_momentum_from_zero_starts_the_buffer_as_eager_does(stage):
    """From stage 1 on the step holds the optimizer state: it adds the buffer's shard (a momentum warm-up)."""
    eager, compiled = train_eager_and_compiled(lambda: bn_with(momentum=0.0), bn_batch,
                                               set_each_step("momentum", [0.0, 0.9, 0.8, 0.0, 0.95]), steps=5,
                                               stage=stage)
    assert_bitwise_equal(eager, compiled)
    # zero with no buffer, non-zero, and at stage 0 zero with a buffer (a new state layout in the key); from stage 1
    # on the key holds the layout the step took, and zero runs the first graph, which leaves the buffer's shard alone
    assert compiled[3].stats().traces == (3 if stage == 0 else 2)


@pytest.mark.parametrize("make, batch", [(bn_with, bn_batch), (gpt_and_adamw, token_batch)], ids=["sgd", "adamw"])
def test_weight_decay_cycling_retraces_only_when_crossing_zero(make, batch):
    weight_decay = [1e-3, 2e-2, 5e-4, 0.0, 0.0, 1e-2, 3e-3]
    eager, compiled = train_eager_and_compiled(make, batch, set_each_step("weight_decay", weight_decay), steps=7)
    assert_bitwise_equal(eager, compiled)
    # AdamW's second group starts at 0 and becomes non-zero, which the first group's cycling never adds
    assert compiled[3].stats().traces == (2 if make is bn_with else 3)


def test_a_zero_tested_hyperparameter_answers_only_the_guarded_comparison():
    def update(x, traced):
        value = traced.item()
        optim_support.assume_zero_side(value, 0.9)
        assert value != 0 and not value == 0  # decided: the key records this side
        bool(value > 0.5)  # not decided by the key: must not be answered from the traced value
        return x * value

    with pytest.raises(GuardOnDataDependentSymNode):
        make_fx(update, tracing_mode="fake")(torch.ones(2), torch.tensor(0.9, dtype=torch.float64))


def test_trace_cache_keeps_max_traces_graphs_and_warns_once(caplog):
    sizes = [2, 3, 4, 2, 5, 2, 3]
    batch = lambda i, rank: bn_batch(i, rank, batch=sizes[i])  # noqa: E731
    with caplog.at_level(logging.WARNING, logger="zerofx"):
        eager, compiled = train_eager_and_compiled(bn_with, batch, lambda opt: lambda i: None, steps=len(sizes),
                                                   max_traces=3)
    assert_bitwise_equal(eager, compiled)
    step = compiled[3]
    assert len(step._cache) == 3
    # 5 evicts 3, the least recently used (2 ran after it), so 2 is still kept; 3 traces again
    assert step.stats().traces == 5
    warnings = [r.getMessage() for r in caplog.records if "max_traces" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].endswith("what keeps changing: batch")
    assert len(retrace_messages(caplog)) == 4


def test_max_traces_must_be_positive():
    with pytest.raises(ValueError, match="max_traces"):
        zerofx.compile(train_step, max_traces=0)


@pytest.mark.parametrize("stage", [0, 2])
def test_one_cycle_lr_with_sgd_matches_ddp_on_two_ranks(ranks2, stage):
    results = ranks2.run(cases.one_cycle_sgd_matches_ddp, stage=stage)
    assert all(r["traces"] == 1 for r in results) and results[0]["momentum"] != 0.9


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_hyperparameters_given_as_tensors_train_bitwise_as_ddp(ranks2, stage):
    result = ranks2.run(cases.tensor_hyperparameters_match_ddp, stage=stage)[0]
    assert result["traces"] == 1  # the schedule fills the lr tensor in place: the graph reads it at every call
    assert isinstance(result["lr"], torch.Tensor) and result["lr"].item() == pytest.approx(3e-3)


def test_an_lr_changing_between_tensor_and_number_retraces_once_each_way(caplog):
    def adam_with_tensor_lr():
        model, _ = gpt_and_adamw()
        return model, torch.optim.Adam(model.parameters(), lr=torch.tensor(3e-3))

    lrs = [torch.tensor(2e-3), 1e-3, 5e-4, torch.tensor(1e-3), torch.tensor(4e-4), 0.0]
    with caplog.at_level(logging.WARNING, logger="zerofx"):
        eager, compiled = train_eager_and_compiled(adam_with_tensor_lr, token_batch, set_each_step("lr", lrs), steps=6)
    assert_bitwise_equal(eager, compiled)
    assert compiled[3].stats().traces == 2  # a new tensor or a new number is read by the graph made for its kind
    assert "<input: torch.float32 tensor on cpu>" in retrace_messages(caplog)[0]


def _scheduler_inside(model, optimizer, scheduler, x, y):
    loss = train_step(model, optimizer, x, y)
    scheduler.step()
    return loss


def _warmup_inside(model, optimizer, x, y, lr):
    for group in optimizer.param_groups:
        group["lr"] = lr
    return train_step(model, optimizer, x, y)


def _tensor_lr_filled_inside(model, optimizer, x, y):
    optimizer.param_groups[0]["lr"].fill_(0.01)
    return train_step(model, optimizer, x, y)


@pytest.mark.parametrize("stage", [0, 3])
def test_hyperparameters_set_inside_the_step_are_refused(stage):
    """The graph reads hyperparameters at every call: a value the step sets would be traced once and then lost. A
    scheduler stepped inside is refused even where its first step keeps the rate (StepLR between its steps), which
    no hyperparameter written could tell."""
    for scheduler_of in (lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=30),
                         lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
                         lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt)):
        model, opt = gpt_and_sgd()
        scheduler = scheduler_of(opt)
        with pytest.raises(zerofx.CaptureError, match="an LR scheduler's step\\(\\) \\((StepLR|ReduceLROnPlateau)\\) "
                                                      "is called inside the train step"):
            zerofx.compile(_scheduler_inside, stage=stage)(model, opt, scheduler, *token_batch(0, 0))
    model, opt = gpt_and_sgd()
    with pytest.raises(zerofx.CaptureError, match="sets hyperparameter 'lr' of param group 0 of optimizer 0 \\(SGD"):
        zerofx.compile(_warmup_inside, stage=stage)(model, opt, *token_batch(0, 0), 0.01)
    # a tensor lr filled in place (as a scheduler fills it): the same object, a write the graph would replay
    model, opt = gpt_and_sgd(lr=torch.tensor(0.05))
    with pytest.raises(zerofx.CaptureError, match="writes into hyperparameter hyperparam:lr:group0, a tensor"):
        zerofx.compile(_tensor_lr_filled_inside, stage=stage)(model, opt, *token_batch(0, 0))
