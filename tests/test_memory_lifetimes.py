"""Lifetimes of a step graph's buffers (`zerofx.memory.lifetimes`) and the planned arena `stats()` reports."""

import operator

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import cases_memory_plan as cases
import zerofx
from models import train_step
from zerofx.memory.lifetimes import lifetimes, peak_live


def test_a_buffer_lives_until_the_last_reader_of_any_view_or_in_place_result():
    def f(x):
        y = x * 2  # read through a view (v), then updated in place (w): lives until z
        v = y.view(-1)
        w = y.add_(1)
        t = x + 3  # read once
        z = v.sum() + w.sum() + t.sum()
        return z

    gm = make_fx(f, tracing_mode="fake")(torch.ones(4, 4))
    nodes = list(gm.graph.nodes)
    position = {n.name: i for i, n in enumerate(nodes)}
    spans = {s.name: s for s in lifetimes(gm.graph)}
    users = {n.name: [position[u.name] for u in n.users] for n in nodes}
    mul, add = spans["mul"], spans["add"]
    assert mul.start == position["mul"] and mul.end == max(users["view"] + users["add_"]) + 1
    assert add.end == max(users["add"]) + 1 and add.nbytes == 64
    assert spans["x_1"].is_input and (spans["x_1"].start, spans["x_1"].end) == (0, len(nodes))
    z = next(n for n in nodes if n.op == "output").args[0]
    assert spans[z.name].end == len(nodes)  # returned: alive to the end
    assert "view" not in spans and "add_" not in spans  # aliases are not buffers of their own
    assert peak_live(list(spans.values()))[0] == 3 * 64 + 2 * 4  # x, y, t and the first two sums


def test_the_pieces_of_an_unsafe_split_keep_their_buffer_alive():
    """``unsafe_split`` (how nn.GRU's and nn.LSTM's decomposed cells split their gates) returns views its schema does
    not name: the split buffer lives until its last piece is read, and the pieces are not buffers of their own."""
    def f(x):
        gates = x * 2
        first, second = torch.ops.aten.unsafe_split.Tensor(gates, 2)
        other = x + 1  # made after the split, while the second piece is still to be read
        return (first.sum() + other.sum()) * second.sum()

    gm = make_fx(f, tracing_mode="fake")(torch.ones(4, 4))
    nodes = list(gm.graph.nodes)
    position = {n.name: i for i, n in enumerate(nodes)}
    spans = {s.name: s for s in lifetimes(gm.graph)}
    second = next(n for n in nodes if n.target is operator.getitem and n.args[1] == 1)
    assert spans["mul"].end == max(position[u.name] for u in second.users) + 1
    assert spans["mul"].end > spans["add"].start  # so the plan cannot put `other` where the gates are
    assert not any(name.startswith(("unsafe_split", "getitem")) for name in spans)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_planned_gru_trains_and_evaluates_as_eager(stage):
    """A GRU evaluated under ``no_grad`` runs its decomposed cell, whose gates are unsafe_split views: planned, its
    losses are eager's, training and evaluating."""
    def step_fn(model, optimizer, x, y):
        if not model.training:
            with torch.no_grad():
                return model(x, y)
        return train_step(model, optimizer, x, y)

    def make():
        torch.manual_seed(0)
        model = _Recurrent()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    (model, opt), (ref_model, ref_opt) = make(), make()
    step = zerofx.compile(step_fn, stage=stage, memory_plan=True)
    for i, training in enumerate([True, True, False, True, False]):
        model.train(training), ref_model.train(training)
        g = torch.Generator().manual_seed(i)
        x, y = torch.randint(0, 50, (6, 7), generator=g), torch.randint(0, 5, (6,), generator=g)
        torch.testing.assert_close(step(model, opt, x, y), step_fn(ref_model, ref_opt, x, y).detach(), rtol=0, atol=0)


class _Recurrent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding, self.rnn, self.head = torch.nn.Embedding(50, 16), torch.nn.GRU(16, 16, batch_first=True), \
            torch.nn.Linear(16, 5)

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.head(self.rnn(self.embedding(x))[0][:, -1]), y)


def test_memory_plan_is_bitwise_and_the_lifetimes_predict_the_measured_peak(ranks2):
    """2 ranks, the example GPT at stages 0-3 (fp32), checkpointed at stage 3 (fp32) and stage 1 (bf16), and at stage
    2 in fp16 (loss scaling): with ``memory_plan`` every loss, parameter and optimizer state is bitwise that of the
    step without, and the peak stays within 2% of it. Without it, the step's own buffers plan with no fragmentation
    (≤ 1%) in the smaller of a joint arena and pools by class (both reported), and the peak the lifetimes predict
    equals the peak `StepProbe` measures on live storages, byte for byte."""
    for per_run in ranks2.run(cases.planned_is_bitwise_unplanned, timeout=600):
        for name, figures in per_run.items():
            assert figures["buffers"] > 0 and figures["arena"] >= figures["lower_bound"] > 0, name
            assert figures["planned_peak"] <= figures["unplanned_peak"] * 1.02, (name, figures)
            assert figures["fragmentation"] <= 0.01 or "blocks" in name, (name, figures)
            assert figures["predicted_peak"] == figures["unplanned_peak"], (name, figures)
            assert figures["largest"] and all(nbytes > 0 for _, _, nbytes in figures["largest"])
            assert set(figures["by_layout"]) == {"joint", "pools by class"}, name  # both layouts reported
            assert figures["arena_bytes"] == min(figures["by_layout"].values()), name


class _TwoProjections(torch.nn.Module):
    """A bias-free projection of a 3-D input (``mm`` viewed back by ``_unsafe_view``, whose schema does not say it
    is a view), whose output the step returns, then a second projection."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 32, bias=False)
        self.b = torch.nn.Linear(32, 16)

    def forward(self, x):
        h = self.a(x)
        return self.b(torch.relu(h)), h


def _returns_hidden(model, optimizer, x):
    optimizer.zero_grad()
    out, hidden = model(x)
    loss = out.pow(2).mean()  # pow with a scalar exponent: its out= variant is not the tensor-exponent one
    loss.backward()
    optimizer.step()
    return loss, hidden


@pytest.mark.parametrize("recompute_pointwise", [False, True])
def test_memory_plan_leaves_what_the_step_returns_intact(recompute_pointwise):
    import zerofx

    results = []
    for memory_plan in (False, True):
        torch.manual_seed(0)
        model = _TwoProjections()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = zerofx.compile(_returns_hidden, memory_plan=memory_plan, recompute_pointwise=recompute_pointwise)
        results.append([tuple(t.clone() for t in step(model, opt, torch.randn(4, 8, 16))) for _ in range(2)])
    for (loss, hidden), (want_loss, want_hidden) in zip(results[1], results[0]):
        assert torch.equal(loss, want_loss) and torch.equal(hidden, want_hidden)
