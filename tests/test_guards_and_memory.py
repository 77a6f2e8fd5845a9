"""What the graph depends on (inputs vs guards) and what it costs in memory, on one process."""

import gc
import logging

import pytest
import torch

import zerofx
from gpu_smoke import update_when_told
from models import bn_and_sgd, bn_batch, gpt_and_adamw, token_batch, train_step


def _train_both(make, batch, steps, between=lambda model, opt, i: None):
    runs = []
    for compiled in (False, True):
        model, opt = make()
        step = zerofx.compile(train_step) if compiled else train_step
        losses = []
        for i in range(steps):
            losses.append(step(model, opt, *batch(i, 0)).item())
            between(model, opt, i)
        runs.append((model, opt, losses, step))
    return runs


def test_lr_scheduler_changes_the_update_without_retracing():
    schedulers = {}

    def make():
        model, opt = bn_and_sgd()
        schedulers[id(opt)] = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.3)
        return model, opt

    (ref, ref_opt, ref_losses, _), (model, opt, losses, step) = _train_both(
        make, bn_batch, 6, lambda m, o, i: schedulers[id(o)].step())
    torch.testing.assert_close(losses, ref_losses, rtol=1e-6, atol=0)
    torch.testing.assert_close(model.state_dict(), ref.state_dict(), rtol=1e-6, atol=0)
    assert opt.param_groups[0]["lr"] != 0.1 and step.stats().traces == 1


def test_one_cycle_lr_with_momentum_cycling_matches_eager_without_retracing():
    schedulers, beta1_used = {}, {}

    def make():
        model, opt = gpt_and_adamw()
        schedulers[id(opt)] = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=8,
                                                                   cycle_momentum=True)
        return model, opt

    def after_step(model, opt, i):
        beta1_used.setdefault(id(opt), []).append(opt.param_groups[0]["betas"][0])
        schedulers[id(opt)].step()

    (ref, ref_opt, ref_losses, _), (model, opt, losses, step) = _train_both(make, token_batch, 6, after_step)
    used = beta1_used[id(opt)]
    assert len(used) == 6 and all(a != b for a, b in zip(used, used[1:]))  # every step ran with a new beta1
    torch.testing.assert_close(losses, ref_losses, rtol=1e-6, atol=0)
    torch.testing.assert_close(model.state_dict(), ref.state_dict(), rtol=1e-6, atol=0)
    torch.testing.assert_close(opt.state_dict(), ref_opt.state_dict(), rtol=1e-6, atol=0)
    assert step.stats().traces == 1  # lr and beta1 are graph inputs


def test_branching_hyperparameter_is_a_guard_that_retraces_and_says_why(caplog):
    model, opt = bn_and_sgd()
    step = zerofx.compile(train_step)
    step(model, opt, *bn_batch(0, 0))
    opt.param_groups[0]["weight_decay"] = 0.0  # torch.optim branches on weight_decay != 0
    with caplog.at_level(logging.WARNING, logger="zerofx"):
        step(model, opt, *bn_batch(1, 0))
        step(model, opt, *bn_batch(2, 0))
    assert step.stats().traces == 2
    retraces = [r.getMessage() for r in caplog.records if "re-tracing" in r.getMessage()]
    assert len(retraces) == 1 and "weight_decay" in retraces[0]


def test_eval_mode_and_batch_shape_are_guards(caplog):
    model, opt = bn_and_sgd()
    step = zerofx.compile(train_step)
    step(model, opt, *bn_batch(0, 0))
    with caplog.at_level(logging.WARNING, logger="zerofx"):
        model.eval()
        step(model, opt, *bn_batch(1, 0))
        model.train()
        step(model, opt, *bn_batch(2, 0, batch=6))
        step(model, opt, *bn_batch(3, 0))  # back to a key already compiled: no new trace
    messages = [r.getMessage() for r in caplog.records if "re-tracing" in r.getMessage()]
    assert step.stats().traces == 3
    assert "training" in messages[0] and "batch" in messages[1] and len(messages) == 2


def _peak_bytes(model, opt, step, x, y) -> int:
    """Every live tensor counted from the start, none held by the measurement (a gradient the step drops is freed)."""
    tracker = zerofx.LiveStorageTracker([list(model.parameters()), list(model.buffers()),
                                         [p.grad for p in model.parameters()],
                                         [v for s in opt.state.values() for v in s.values()], [x, y]])
    with tracker:
        step(model, opt, x, y)
    return tracker.peak_bytes


def test_compiled_peak_is_not_above_eager_peak():
    """Both run a warm-up step first, so gradients and optimizer state exist; the second step is measured."""
    peaks = {}
    for name in ("eager", "compiled"):
        model, opt = gpt_and_adamw()
        step = zerofx.compile(train_step) if name == "compiled" else train_step
        step(model, opt, *token_batch(0, 0))
        peaks[name] = _peak_bytes(model, opt, step, *token_batch(1, 0))
    state_bytes = sum(p.numel() * 4 * 4 for p in gpt_and_adamw()[0].parameters())  # param, grad, 2 moments
    assert peaks["compiled"] > state_bytes  # the tracker sees the state, not only temporaries
    assert peaks["compiled"] <= peaks["eager"], peaks


def test_gradients_the_step_will_not_read_are_not_held_through_it():
    """A step that opens with ``zero_grad()`` drops the last step's gradients before it runs, as eager does: its peak
    is the same whether they were left in ``.grad`` or cleared before the call."""
    model, opt = gpt_and_adamw()
    step = zerofx.compile(train_step)
    step(model, opt, *token_batch(0, 0))
    assert all(p.grad is not None for p in model.parameters())  # stage 0 leaves them, as eager does
    left = _peak_bytes(model, opt, step, *token_batch(1, 0))
    model.zero_grad()
    cleared = _peak_bytes(model, opt, step, *token_batch(2, 0))
    assert left == cleared


def test_a_frozen_parameters_gradient_is_the_users_and_stays():
    """A frozen parameter's ``.grad`` (set by the user, read by nothing in the step) stays, as eager leaves it."""
    model, opt = gpt_and_adamw()
    model.ln_f.weight.requires_grad_(False)
    mine = model.ln_f.weight.grad = torch.ones_like(model.ln_f.weight)
    step = zerofx.compile(train_step)
    for i in range(2):
        step(model, opt, *token_batch(i, 0))
    assert model.ln_f.weight.grad is mine


def test_planned_graphs_of_one_step_share_one_arena_and_train_as_unplanned():
    """A short batch and an evaluation trace graphs of their own; with ``memory_plan`` they all write into one
    arena, as large as the largest plan (it grows when a larger one comes, and the smaller graph moves into it), and
    the losses are bitwise those without a plan."""
    runs = []
    for memory_plan in (False, True):
        model, opt = gpt_and_adamw()
        step = zerofx.compile(train_step, memory_plan=memory_plan)
        losses = [step(model, opt, *token_batch(i, 0, batch=b)).item() for i, b in enumerate([3, 4, 4, 3])]
        model.eval()
        losses.append(step(model, opt, *token_batch(4, 0)).item())
        model.train()
        losses.append(step(model, opt, *token_batch(5, 0)).item())
        runs.append((losses, step))
    (want, _), (got, step) = runs
    assert got == want
    graphs = list(step._cache.values())
    assert len(graphs) == 3
    planned = [g.ctx.artifacts["memory_plan"].arena_bytes for g in graphs]
    storages = {slot.untyped_storage().data_ptr() for g in graphs for slot in g.arena()}
    assert len(storages) == 1
    assert graphs[0].arena()[0].untyped_storage().nbytes() == max(planned)


def _kept_after_a_step(**options):
    """The step, its loss, and the bytes of every storage its first step left alive (its loss dropped)."""
    model, opt = gpt_and_adamw()
    batch = token_batch(0, 0)
    step = zerofx.compile(train_step, **options)
    with zerofx.LiveStorageTracker() as tracker:
        loss = step(model, opt, *batch).item()
        gc.collect()
        kept = sum(tracker.live_by_storage().values())
    return step, (model, opt), loss, kept


def test_stage_0_plans_its_memory_by_default_keeps_it_between_steps_and_releases_it():
    """Stage 0 writes its intermediates into the arena unless told otherwise, stages 1-3 only when asked. A planned
    step keeps its arena (and its scalar operands) alive between steps, with the gradients it left in ``.grad``
    inside it: measured on live storages, what it keeps beyond the unplanned step is ``held_plan_bytes`` less those
    gradients, which the unplanned step keeps apart; ``release_arena`` frees the arena until the next step."""
    assert [zerofx.compile(train_step, stage=s).config.memory_plan for s in range(4)] == [True, False, False, False]
    assert not zerofx.compile(train_step, memory_plan=False).config.memory_plan
    assert zerofx.compile(train_step, stage=3, memory_plan=True).config.memory_plan
    with pytest.raises(TypeError, match="memory_plan"):
        zerofx.compile(train_step, memory_plan="no")
    planned, planned_state, planned_loss, planned_kept = _kept_after_a_step()
    unplanned, unplanned_state, unplanned_loss, unplanned_kept = _kept_after_a_step(memory_plan=False)
    held = planned.stats().held_plan_bytes
    in_arena = [name for name, p in planned_state[0].named_parameters() if planned._arena.holds(p.grad)]
    assert in_arena  # those the plan did not leave to the allocator
    grads = dict(unplanned_state[0].named_parameters())
    assert planned_loss == unplanned_loss and unplanned.stats().held_plan_bytes == 0
    assert planned_kept - unplanned_kept == held - sum(grads[n].grad.untyped_storage().nbytes() for n in in_arena) > 0
    planned.release_arena()
    assert 0 < planned.stats().held_plan_bytes < held  # the scalar operands stay with the graph
    batch = token_batch(1, 0)
    assert planned(*planned_state, *batch).item() == unplanned(*unplanned_state, *batch).item()
    assert planned.stats().held_plan_bytes == held


def _halve_grads(model, opt, x, y):
    opt.zero_grad()
    loss = model(x, y)
    loss.backward()
    for p in model.parameters():
        p.grad.div_(2)  # in place: the graph returns what an arena slot was written with
    opt.step()
    return loss


def _zero_after_step(model, opt, x, y):
    loss = model(x, y)
    loss.backward()
    for p in model.parameters():
        p.grad.div_(2)
    opt.step()
    opt.zero_grad(set_to_none=False)
    return loss


def _keep(grad: torch.Tensor, i: int):
    """The last step's gradient as a caller may keep it (the tensor, a view of it, or only its storage), a reader
    of its values from what is kept, and its values now."""
    if i % 3 == 2:
        offset, shape, stride, dtype = grad.storage_offset(), grad.shape, grad.stride(), grad.dtype
        return (grad.untyped_storage(), lambda kept: torch.empty(0, dtype=dtype).set_(kept, offset, shape, stride),
                grad.clone())
    kept = grad if i % 3 == 0 else grad[1:3]
    return kept, lambda kept: kept, kept.clone()


@pytest.mark.parametrize("step_fn", [train_step, _halve_grads, _zero_after_step])
def test_a_gradient_kept_from_the_last_planned_step_is_not_overwritten_by_the_next(step_fn, caplog):
    """The arena holds the gradients a stage-0 step leaves; one the caller still holds when the next step starts
    (the tensor, a view of it, its storage) keeps its values, and the step plans into new bytes, saying so: whether
    the next step drops ``.grad`` first (``zero_grad()`` inside it), reads it (``zero_grad(set_to_none=False)`` after
    the step), or the step changed it in place (``grad.div_``). With nothing kept, every step reuses the same arena
    (a step that reads the gradients first takes them out of it)."""
    runs = []
    for memory_plan in (False, True):
        model, opt = gpt_and_adamw()
        step = zerofx.compile(step_fn, memory_plan=memory_plan)
        kept, losses = [], []
        for i in range(4):
            losses.append(step(model, opt, *token_batch(i, 0)).item())
            grad = model.blocks[0].attn.qkv.weight.grad
            if i == 0:
                assert step._arena.holds(grad) == memory_plan
            kept.append(_keep(grad, i))
            del grad
        assert all(torch.equal(read(k), want) for k, read, want in kept), memory_plan
        runs.append((losses, [p.detach().clone() for p in model.parameters()]))
    (want_losses, want_params), (losses, params) = runs
    assert losses == want_losses and all(map(torch.equal, params, want_params))
    assert "Clone gradients you keep" in caplog.text
    caplog.clear()
    model, opt = gpt_and_adamw()
    step = zerofx.compile(step_fn)
    arenas = []
    for i in range(4):
        step(model, opt, *token_batch(i, 0))
        arenas.append(step._arena._raw.data_ptr())  # nothing kept: every step reuses the same bytes
    assert len(set(arenas)) == 1 and "Clone gradients" not in caplog.text




@pytest.mark.parametrize("memory_plan", [False, True])
def test_a_gradient_the_caller_holds_through_an_accumulation_window_sums_it_as_under_eager(memory_plan):
    """A gradient the first call of a window leaves in the arena, held by the caller (the tensor, a view of it): the
    next call adds into it in place, where the caller sees the window's sum, as eager's backward adds; the arena is
    left to it."""
    sums = {}
    for kind in ("eager", "zerofx"):
        model, opt = gpt_and_adamw()
        step = update_when_told if kind == "eager" else zerofx.compile(update_when_told, memory_plan=memory_plan)
        for i in range(3):
            step(model, opt, *token_batch(i, 0), i == 2)
            if i == 0:
                grad = model.blocks[0].mlp[0].weight.grad
                view, first = grad[1:3], grad.clone()
            if i == 1:
                now = model.blocks[0].mlp[0].weight.grad
                assert torch.equal(grad, now) and torch.equal(view, now[1:3]) and not torch.equal(now, first), kind
                sums[kind] = now.clone()
        del grad, view, now
    torch.testing.assert_close(sums["zerofx"], sums["eager"], rtol=1e-6, atol=0)
