"""zerofx as a torch.compile backend, on every rank of a gloo pool; test_backend.py calls these.

The loop is eager (``loss.backward()``, ``optimizer.step()``) around ``torch.compile(model, backend=zerofx.backend)``,
beside DDP running the same loop, and beside the whole-step path (``zerofx.compile``) where records and checkpoints
are compared.
"""

import copy

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import zerofx
from zerofx import collectives
from zerofx.backend.prepared import is_prepared
from zerofx.errors import RankMismatchError
from cases_loops import _zero_grad_last, assert_matches_ddp
from cases_optimizers import OPTIMIZERS
from models import TINY_GPT, bn_and_sgd, bn_batch, gpt_and_adamw, token_batch, train_step
from nanogpt import GPT, param_groups

LOOPS = {"zero_grad first": train_step, "zero_grad last": _zero_grad_last}


def _clipped(model, optimizer, x, y):
    """Gradients clipped between ``backward()`` and ``step()``, as HF Trainer does: the norm must be of averaged
    gradients, eager parts included, or ranks would scale their updates differently."""
    optimizer.zero_grad()
    loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    optimizer.step()
    return loss


def _clipped_through_zerofx(model, optimizer, x, y):
    """`_clipped` for a prepared model whose gradients are the optimizer's shards (stage 1 on): clipped with
    ``zerofx.clip_grad_norm_``; DDP's as before."""
    optimizer.zero_grad()
    loss = model(x, y)
    loss.backward()
    if isinstance(model, DDP):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    else:
        zerofx.clip_grad_norm_(model, 0.05)
    optimizer.step()
    return loss


def _compiled(model, optimizer, stage, **backend_options):
    torch._dynamo.reset()  # each case compiles afresh: no region of an earlier model is reused
    model, optimizer = zerofx.prepare(model, optimizer, stage=stage)
    return torch.compile(model, backend=zerofx.backend(stage=stage, **backend_options)), optimizer


def _train_beside_ddp(model, opt, ref_model, ref_opt, loop, rank, steps, first=0):
    ddp = DDP(ref_model)
    losses = []
    for i in range(first, first + steps):
        x, y = token_batch(i, rank)
        loss, ref_loss = loop(model, opt, x, y).item(), loop(ddp, ref_opt, x, y).item()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0, msg=f"step {i}")
        losses.append(loss)
    return losses


def beside_ddp_and_whole_step(rank, world_size, stage, dump_dir, steps=10):
    """Each loop style, ``steps`` steps beside DDP (losses, then parameters and optimizer state: the first
    difference is returned); the last step's collectives beside a whole step's; the backend's graphs dumped to
    ``dump_dir``. The whole step leaves recomputation to AOTAutograd's partitioner as the backend does (no
    ``recompute_pointwise``): what backward recomputes decides which parameters it gathers when, at stage 3."""
    mismatch = None
    for name, loop in LOOPS.items():
        ref_model, ref_opt = gpt_and_adamw()
        model, opt = _compiled(*gpt_and_adamw(seed=rank), stage, dump_dir=dump_dir)  # prepare broadcasts rank 0's
        try:
            _train_beside_ddp(model, opt, ref_model, ref_opt, loop, rank, steps)
            assert_matches_ddp(zerofx.prepared(model), ref_model, ref_opt)
        except AssertionError as e:
            mismatch = mismatch or f"{name}: {e}"
    step = zerofx.compile(train_step, stage=stage, recompute_pointwise=False)
    whole_model, whole_opt = gpt_and_adamw()
    step(whole_model, whole_opt, *token_batch(0, rank))
    prepared = zerofx.prepared(model)
    ours, theirs = prepared.stats(), step.stats()
    return {"ddp_mismatch": mismatch, "backend": _records(ours.collectives),
            "whole_step": _records(theirs.collectives), "volumes": (ours.comm_volume, theirs.comm_volume),
            "model_states": (ours.model_state_bytes, theirs.model_state_bytes),
            "formula": _formula_bytes(ours), "num_params": ours.num_params,
            "saved_gathered": _gathered_outputs(prepared.graphs["region0.forward"])}


def _formula_bytes(stats) -> float:
    """The paper's model states for the stats' stage, at its Ψ and world size."""
    return stats.formula.evaluate(stats.formula.model_states, stats.num_params, stats.world_size)


def _records(records):
    """Each collective's data, rank agreements apart: the whole step's may ride on its first bucket."""
    return [(r.kind, r.numel - r.carried, r.dtype, r.purpose) for r in records if r.purpose != "control"]


def _gathered_outputs(forward) -> int:
    """How many of a forward graph's outputs (what it saves for backward) are a gathered parameter or a view of one."""
    output = next(n for n in reversed(forward.graph.nodes) if n.op == "output")
    count = 0
    for value in output.args[0]:
        while isinstance(value, torch.fx.Node) and isinstance(value.target, torch._ops.OpOverload) \
                and value.target.is_view:
            value = value.args[0]
        count += isinstance(value, torch.fx.Node) and value.target is collectives.wait
    return count


class GraphBreakGPT(GPT):
    """The test GPT (two blocks) with a graph break between its blocks."""

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = F.dropout(self.wte(idx) + self.wpe(pos), self.cfg.dropout, self.training)
        x = self.blocks[0](x)
        torch._dynamo.graph_break()
        x = self.blocks[1](x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def graph_break_against_ddp(rank, world_size, stage, steps=10):
    torch.manual_seed(0)
    model = GraphBreakGPT(TINY_GPT)
    opt = torch.optim.AdamW(param_groups(model, weight_decay=0.1), lr=3e-3)
    ref_model, ref_opt = gpt_and_adamw()
    model, opt = _compiled(model, opt, stage=stage)
    losses = _train_beside_ddp(model, opt, ref_model, ref_opt, train_step, rank, steps)
    # the tied embedding's gradient is averaged in two parts, one per region: values that are rounding noise (the
    # attention key's bias, whose gradient is analytically zero and which Adam scales up to lr) differ by about 1e-5
    assert_matches_ddp(zerofx.prepared(model), ref_model, ref_opt, atol=2e-5)
    prepared = zerofx.prepared(model)
    return {"graphs": sorted(prepared.graphs), "breaks": prepared.graph_breaks(*token_batch(0, rank)),
            "losses": losses}


class BreakOnOneRankGPT(GraphBreakGPT):
    """The graph break between the blocks on the ranks that set ``breaks``: the ranks compile different graphs."""

    breaks = False

    def forward(self, idx, targets):
        if self.breaks:
            return super().forward(idx, targets)
        return GPT.forward(self, idx, targets)


def ranks_compiling_different_graphs(rank, world_size, stage):
    """The error each rank raises when one rank's forward breaks where the other's does not."""
    torch.manual_seed(0)
    model = BreakOnOneRankGPT(TINY_GPT)
    model.breaks = rank == 1
    return _first_step_error(model, stage, rank, RankMismatchError)


class ExtraRegionOnOneRankGPT(GPT):
    """On the ranks that set ``extra`` the loss gains a term compiled as a region of its own (after a break), which
    reads a parameter: the first region is the same graph on every rank, and one rank runs one region more."""

    extra = False

    def forward(self, idx, targets):
        loss = super().forward(idx, targets)
        if self.extra:
            torch._dynamo.graph_break()
            loss = loss + 0.0 * self.ln_f.weight.sum()
        return loss


def ranks_running_different_regions(rank, world_size, stage):
    """The error each rank raises when rank 1 runs a compiled region more than rank 0."""
    torch.manual_seed(0)
    model = ExtraRegionOnOneRankGPT(TINY_GPT)
    model.extra = rank == 1
    return _first_step_error(model, stage, rank, RankMismatchError)


def _first_step_error(model, stage, rank, error) -> str | None:
    """The message of the ``error`` the model's first step through the backend raises, or None."""
    model, opt = _compiled(model, torch.optim.AdamW(model.parameters(), lr=3e-3), stage=stage)
    try:
        train_step(model, opt, *token_batch(0, rank))
    except error as e:
        return str(e)
    return None


class LoopBreakGPT(GPT):
    """The test GPT with a graph break inside its loop over blocks, which Dynamo cannot resume from: the embeddings
    and the head run eagerly, only the blocks are compiled."""

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            torch._dynamo.graph_break()
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class EagerScaleGPT(GPT):
    """The test GPT whose loss is scaled by a parameter in code Dynamo leaves to eager (``torch._dynamo.disable``);
    with ``reads_scale`` False (one rank's choice) the scale is not read."""

    def __init__(self, cfg, reads_scale: bool = True):
        super().__init__(cfg)
        self.scale = torch.nn.Parameter(torch.ones(()))
        self.reads_scale = reads_scale

    def forward(self, idx, targets):
        loss = super().forward(idx, targets)
        return _scaled_eagerly(loss, self.scale) if self.reads_scale else loss


@torch._dynamo.disable
def _scaled_eagerly(loss, scale):
    return loss * scale


class EagerHeadGPT(GPT):
    """The test GPT whose head runs in a function Dynamo leaves to eager: the tied embedding is read both inside
    the compiled region (the embedding) and eagerly (the head), and its gradient has a part from each."""

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = _head_eagerly(self.head, self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


@torch._dynamo.disable
def _head_eagerly(head, x):
    return head(x)


def _seeded(model_class):
    def build():
        torch.manual_seed(0)
        model = model_class(TINY_GPT)
        return model, torch.optim.AdamW(param_groups(model, weight_decay=0.1), lr=3e-3)
    return build


def _whole_model(model, stage):
    return torch.compile(model, backend=zerofx.backend(stage=stage))


def _each_block(model, stage):
    """As torchtitan applies torch.compile: each block compiled in place (a region each), the embeddings, final
    norm and head eager."""
    for block in model.blocks:
        block.compile(backend=zerofx.backend(stage=stage))
    return model


# name -> (model and optimizer, how torch.compile is applied)
EAGER_MODELS = {"head eager, embedding compiled": (_seeded(EagerHeadGPT), _whole_model),
                "scale read by a disabled function": (_seeded(EagerScaleGPT), _whole_model),
                "each block compiled": (_seeded(GPT), _each_block),
                "break in the loop over blocks": (_seeded(LoopBreakGPT), _whole_model)}


def _evaluate_beside_ddp(compiled, model, ref_model, rank, stage, step):
    """An evaluation between steps (eval mode, no gradients) gives DDP's loss."""
    model.eval()
    ref_model.eval()
    with torch.no_grad():
        x, y = token_batch(step, rank)
        torch.testing.assert_close(compiled(x, y).item(), ref_model(x, y).item(), rtol=1e-5, atol=0, msg="eval")
    model.train()
    ref_model.train()


def eager_parameters_against_ddp(rank, world_size, stage, model, mixed_precision=False, steps=5):
    """Parameters read by eager code (some of them also inside a compiled region) train as DDP does, in each loop
    style (also with clipping between backward and step: torch's at stage 0, ``zerofx.clip_grad_norm_`` from stage 1
    on), and their gradients reach the update. With
    ``mixed_precision`` (bf16) the reference is the whole-step path with the same `MixedPrecision` (it traces
    through the eager code): losses within bf16 rounding, since the backend reduces the eager and the compiled part
    of the tied embedding's gradient apart. The last step's
    data collectives."""
    build, apply_compile = EAGER_MODELS[model]
    mixed = zerofx.MixedPrecision(param_dtype=torch.bfloat16) if mixed_precision else None
    clipped = _clipped if stage == 0 else _clipped_through_zerofx  # from stage 1 on the shards hold the gradients
    for loop in [*LOOPS.values(), clipped] if mixed is None else LOOPS.values():
        ref_model, ref_opt = build()
        model_, opt = build()
        torch._dynamo.reset()
        model_, opt = zerofx.prepare(model_, opt, stage=stage, mixed_precision=mixed)
        compiled = apply_compile(model_, stage)
        if mixed is None:
            _train_beside_ddp(compiled, opt, ref_model, ref_opt, loop, rank, steps)
            # the tied embedding's gradient is averaged in two parts: the attention key's bias, whose gradient is
            # analytically zero (rounding noise that Adam scales up to lr), differs by about 1e-5, as with a break
            assert_matches_ddp(zerofx.prepared(compiled), ref_model, ref_opt, atol=2e-5)
            _evaluate_beside_ddp(compiled, model_, ref_model, rank, stage, steps)
            _train_beside_ddp(compiled, opt, ref_model, ref_opt, loop, rank, 1, first=steps + 1)  # and train on
            continue
        whole_step = zerofx.compile(loop, stage=stage, mixed_precision=mixed)
        for i in range(steps):
            x, y = token_batch(i, rank)
            torch.testing.assert_close(loop(compiled, opt, x, y).item(), whole_step(ref_model, ref_opt, x, y).item(),
                                       rtol=1e-2, atol=0, msg=f"step {i}")
    return {"records": _records(zerofx.prepared(compiled).stats().collectives),
            "numels": {name: p.numel() for name, p in model_.named_parameters()}}


def eager_parameters_differing_across_ranks(rank, world_size, stage):
    """Rank 1's eager code reads a parameter rank 0's does not."""
    torch.manual_seed(0)
    return _first_step_error(EagerScaleGPT(TINY_GPT, reads_scale=rank == 1), stage, rank, RankMismatchError)


def _write_errors(model) -> dict[str, str]:
    """What each way of writing into a stage-3 parameter from eager code raises (None where it does not)."""
    weight = model.ln_f.weight
    writes = {"mul_": lambda: weight.mul_(2), "+=": lambda: weight.__iadd__(1),
              "init, positional": lambda: torch.nn.init.ones_(weight),
              "init, keyword": lambda: torch.nn.init.normal_(weight),
              "setitem": lambda: weight.__setitem__(0, 1.0), "foreach": lambda: torch._foreach_mul_([weight], 2.0),
              "out=": lambda: torch.add(weight, 1, out=weight), "aten overload": lambda: torch.ops.aten.add_.Tensor(
                  weight, 1), "inplace=True": lambda: F.relu(weight, inplace=True),
              "collective": lambda: torch.distributed.broadcast(weight, 0),
              ".data = another dtype": lambda: setattr(weight, "data", torch.zeros_like(weight, dtype=torch.float64)),
              ".data read": lambda: weight.data}
    errors = {}
    with torch.no_grad():
        for name, write in writes.items():
            try:
                write()
                errors[name] = None
            except RuntimeError as e:
                errors[name] = str(e)
    return errors


def eager_reads_between_steps(rank, world_size, steps=3):
    """Stage 3: between steps, eager code reads every parameter (``named_parameters``, ``state_dict()``, also under
    ``inference_mode``, a norm, ``.T``, ``copy.deepcopy``) and gets DDP's values; ``.to`` its own device changes
    nothing; writes raise, and the parameters are as before them; ``load_state_dict`` and ``.data =`` of new values
    (DDP's model loads the same) write them into the shards: training goes on as DDP's."""
    ref_model, ref_opt = gpt_and_adamw()
    compiled, opt = _compiled(*gpt_and_adamw(), stage=3)
    model = compiled._orig_mod
    _train_beside_ddp(compiled, opt, ref_model, ref_opt, train_step, rank, steps)
    read = {name: p.detach().clone() for name, p in model.named_parameters()}
    reference = dict(ref_model.named_parameters())
    for name, value in read.items():
        torch.testing.assert_close(value, reference[name].detach(), rtol=1e-5, atol=2e-5, msg=name)
    state = model.state_dict()
    copied = dict(copy.deepcopy(model).named_parameters())
    for name, value in read.items():
        assert torch.equal(state[name], value) and torch.equal(copied[name], value), name
    norm = model.ln_f.weight.norm().item()
    torch.testing.assert_close(norm, ref_model.ln_f.weight.norm().item(), rtol=1e-5, atol=0)
    assert torch.equal(model.wte.weight.T, read["wte.weight"].T)
    with torch.inference_mode():
        assert torch.equal(model.state_dict()["ln_f.weight"], read["ln_f.weight"])
    device = model.ln_f.weight.device
    assert model.to(device) is model and model.ln_f.weight.to(device, copy=False) is model.ln_f.weight
    errors = _write_errors(model)
    after = {name: p.detach() for name, p in model.named_parameters()}
    assert all(torch.equal(after[name], value) for name, value in read.items()), "a refused write changed a value"
    new_values = {name: value * 0.5 for name, value in ref_model.state_dict().items()}
    new_values["ln_f.bias"] = new_values["ln_f.bias"] + 1  # assigned to .data below, as HF's _adjust_bias does
    with torch.no_grad():
        model.load_state_dict({**new_values, "ln_f.bias": model.ln_f.bias.detach()})
        model.ln_f.bias.data = new_values["ln_f.bias"]
        ref_model.load_state_dict(new_values)
    assert all(torch.equal(p.detach(), new_values[name]) for name, p in model.named_parameters())
    _train_beside_ddp(compiled, opt, ref_model, ref_opt, train_step, rank, 2, first=steps)
    return errors


def eager_reads_differing_across_ranks(rank, world_size, alone: bool):
    """Between steps at stage 3, rank 0 reads the final norm's weight, and rank 1 its bias (or, ``alone``, nothing:
    it goes on to its next step, whose compiled forward agrees with the others before it gathers)."""
    model, opt = _compiled(*gpt_and_adamw(), stage=3)
    train_step(model, opt, *token_batch(0, rank))
    try:
        if rank == 0:
            model.ln_f.weight.sum()
        elif not alone:
            model.ln_f.bias.sum()
        train_step(model, opt, *token_batch(1, rank))
    except RankMismatchError as e:
        return str(e)
    return None


def checkpoint_between_paths(rank, world_size, directory, backend_stage, whole_step_stage, steps=4):
    """Each way: ``steps`` steps on one path, ``zerofx.checkpoint.save``, a fresh model (another seed) loaded on
    the other path, ``steps`` more; every loss and the final state against DDP training straight through."""
    ref_model, ref_opt = gpt_and_adamw()
    ddp = DDP(ref_model)
    ref_losses = [train_step(ddp, ref_opt, *token_batch(i, rank)).item() for i in range(2 * steps)]

    def backend_path(seed):
        return _compiled(*gpt_and_adamw(seed=seed), stage=backend_stage)

    def whole_step_path(seed):
        model, opt = gpt_and_adamw(seed=seed)
        step = zerofx.compile(train_step, stage=whole_step_stage).bind(model, opt, *token_batch(0, rank))
        return step, (model, opt)

    losses = {}
    for first, then in (("backend", "whole step"), ("whole step", "backend")):
        run = []
        for phase, path in enumerate((first, then)):
            if path == "backend":
                model, opt = backend_path(seed=phase)
                target, train = zerofx.prepared(model), lambda x, y: train_step(model, opt, x, y)
            else:
                target, (model, opt) = whole_step_path(seed=phase)
                train = lambda x, y, step=target, model=model, opt=opt: step(model, opt, x, y)  # noqa: E731
            if phase:
                zerofx.checkpoint.load(target, f"{directory}/{first}")
            for i in range(phase * steps, (phase + 1) * steps):
                run.append(train(*token_batch(i, rank)).item())
            if not phase:
                zerofx.checkpoint.save(target, f"{directory}/{first}")
        torch.testing.assert_close(run, ref_losses, rtol=1e-5, atol=0, msg=f"{first}, then {then}")
        assert_matches_ddp(target, ref_model, ref_opt)
        losses[f"{first}, then {then}"] = run
    return losses


def hf_llama_against_ddp(rank, world_size, stage, steps=4):
    """A Hugging Face ``LlamaForCausalLM`` from a config, in the HF Trainer's loop style, beside DDP; the last batch
    short, as an epoch's last often is (Dynamo compiles again, with a symbolic batch size)."""
    from cases_hf import _batch, _hf_step, _model

    ref_model = _model("llama")
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=3e-3, weight_decay=0.01)
    ddp = DDP(ref_model)
    model = _model("llama")
    model, opt = _compiled(model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01), stage)
    for i in range(steps):
        batch = _batch(i, rank, batch=2 if i == steps - 1 else 4)
        torch.testing.assert_close(_hf_step(model, opt, batch).item(), _hf_step(ddp, ref_opt, batch).item(),
                                   rtol=1e-5, atol=0, msg=f"step {i}")
    assert_matches_ddp(zerofx.prepared(model), ref_model, ref_opt, atol=1e-6)
    return sorted(zerofx.prepared(model).graphs)


def _both_paths(make, batch, stage, mixed, rank, steps, loop=train_step):
    """``steps`` calls of ``loop`` on a model from ``make`` through the backend (each rank's own initialisation:
    prepare broadcasts rank 0's) and through ``zerofx.compile``, both with ``mixed``: the prepared model, the
    compiled step, and each path's outputs."""
    torch._dynamo.reset()
    model, opt = zerofx.prepare(*make(seed=rank), stage=stage, mixed_precision=mixed)
    compiled = torch.compile(model, backend=zerofx.backend(stage=stage))
    backend = [loop(compiled, opt, *batch(i, rank)) for i in range(steps)]
    step = zerofx.compile(loop, stage=stage, mixed_precision=mixed, recompute_pointwise=False)
    whole_model, whole_opt = make()
    whole = [step(whole_model, whole_opt, *batch(i, rank)) for i in range(steps)]
    return model, step, backend, whole


def bf16_against_whole_step(rank, world_size, runs, steps=4):
    """For each (stage, reduce_dtype name or None) of ``runs``, ``steps`` steps of the test GPT through the backend
    and through ``zerofx.compile``, both with ``MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype)`` (built
    here: a MixedPrecision does not cross processes): the losses, the final fp32 master parameters (gathered, by
    name) and optimizer state, how many parameters training moved, and the last step's collectives and
    communication volume of each path."""
    results = {}
    for stage, reduce_dtype in runs:
        mixed = zerofx.MixedPrecision(torch.bfloat16, reduce_dtype and getattr(torch, reduce_dtype))
        model, step, backend, whole = _both_paths(gpt_and_adamw, token_batch, stage, mixed, rank, steps)
        backend_losses, step_losses = [loss.item() for loss in backend], [loss.item() for loss in whole]
        ours, theirs = zerofx.full_state_dict(zerofx.prepared(model)), zerofx.full_state_dict(step)
        backend_stats, step_stats = zerofx.prepared(model).stats(), step.stats()
        initial = dict(gpt_and_adamw()[0].named_parameters(remove_duplicate=False))
        results[(stage, reduce_dtype)] = {
            "losses": (backend_losses, step_losses),
            "moved": sum(not torch.equal(value, initial[name]) for name, value in ours["model"].items()),
            "num_params": len(initial),
            "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "master_dtypes": sorted({str(v.dtype) for v in ours["model"].values()}),
            "different_params": _different(ours["model"], theirs["model"]),
            "different_state": _different(_flat_state(ours["optimizer"]), _flat_state(theirs["optimizer"])),
            "collectives": (_records(backend_stats.collectives), _records(step_stats.collectives)),
            "volumes": (backend_stats.comm_volume, step_stats.comm_volume),
            "model_states": (backend_stats.model_state_bytes, step_stats.model_state_bytes),
            "formula": _formula_bytes(backend_stats), "psi": backend_stats.num_params,
        }
    return results


def _clipped_returning_norm(model, optimizer, x, y, max_norm=0.05):
    """`_clipped`, returning the total norm too: ``zerofx.clip_grad_norm_`` for a prepared model, torch's for one a
    whole step traces."""
    optimizer.zero_grad()
    loss = model(x, y)
    loss.backward()
    if is_prepared(model):
        norm = zerofx.clip_grad_norm_(model, max_norm)
    else:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    return loss, norm


def bf16_clipped_against_whole_step(rank, world_size, stages, steps=3):
    """For each stage, ``steps`` clipped steps of the test GPT under ``MixedPrecision(param_dtype=torch.bfloat16)``
    through the backend (``zerofx.clip_grad_norm_``) and through ``zerofx.compile`` (torch's clip, traced): the
    losses and total norms of both paths, and the largest difference between their final fp32 master parameters."""
    results = {}
    for stage in stages:
        model, step, backend, whole = _both_paths(gpt_and_adamw, token_batch, stage,
                                                  zerofx.MixedPrecision(torch.bfloat16), rank, steps,
                                                  loop=_clipped_returning_norm)
        ours, theirs = zerofx.full_state_dict(zerofx.prepared(model)), zerofx.full_state_dict(step)
        results[stage] = {
            "losses": ([loss.item() for loss, _ in backend], [loss.item() for loss, _ in whole]),
            "norms": ([norm.item() for _, norm in backend], [norm.item() for _, norm in whole]),
            "param_difference": max((ours["model"][k] - theirs["model"][k]).abs().max().item() for k in ours["model"]),
        }
    return results


def bf16_batchnorm_against_whole_step(rank, world_size, stages, steps=4):
    """For each stage, ``steps`` steps of a BatchNorm model under ``MixedPrecision(param_dtype=torch.bfloat16)``
    through the backend and through ``zerofx.compile``: the losses of both, and the names of the parameters and
    buffers (running statistics) whose final values differ."""
    results = {}
    for stage in stages:
        model, step, backend, whole = _both_paths(bn_and_sgd, bn_batch, stage, zerofx.MixedPrecision(torch.bfloat16),
                                                  rank, steps)
        ours, theirs = zerofx.full_state_dict(zerofx.prepared(model)), zerofx.full_state_dict(step)
        results[stage] = {"losses": ([loss.item() for loss in backend], [loss.item() for loss in whole]),
                          "different": _different(ours["model"], theirs["model"])}
    return results


def _flat_state(optimizer_sd: dict) -> dict:
    return {f"{fqn}.{key}": value for fqn, entries in optimizer_sd["state"].items() for key, value in entries.items()}


def _different(ours: dict, theirs: dict) -> list[str]:
    """The names whose values are not bitwise equal (or missing on one side)."""
    assert ours.keys() == theirs.keys(), (sorted(ours), sorted(theirs))
    return sorted(name for name in ours if not torch.equal(torch.as_tensor(ours[name]), torch.as_tensor(theirs[name])))


def bf16_checkpoint_between_paths(rank, world_size, directory, backend_stage, whole_step_stage, steps=2):
    """Under ``MixedPrecision(param_dtype=torch.bfloat16)``, each way: ``steps`` steps on one path,
    ``zerofx.checkpoint.save``, a fresh model (another seed) loaded on the other path, ``steps`` more; the losses and
    the final fp32 masters beside the whole-step path training straight through, as the names that differ."""
    mixed = zerofx.MixedPrecision(param_dtype=torch.bfloat16)
    straight = zerofx.compile(train_step, stage=whole_step_stage, mixed_precision=mixed, recompute_pointwise=False)
    model, opt = gpt_and_adamw()
    ref_losses = [straight(model, opt, *token_batch(i, rank)).item() for i in range(2 * steps)]
    reference = zerofx.full_state_dict(straight)["model"]

    def backend_path(seed):
        torch._dynamo.reset()
        model, opt = zerofx.prepare(*gpt_and_adamw(seed=seed), stage=backend_stage, mixed_precision=mixed)
        compiled = torch.compile(model, backend=zerofx.backend(stage=backend_stage))
        return zerofx.prepared(model), lambda x, y: train_step(compiled, opt, x, y)

    def whole_step_path(seed):
        model, opt = gpt_and_adamw(seed=seed)
        step = zerofx.compile(train_step, stage=whole_step_stage, mixed_precision=mixed, recompute_pointwise=False)
        step.bind(model, opt, *token_batch(0, rank))
        return step, lambda x, y: step(model, opt, x, y)

    out = {}
    for first, then in ((backend_path, whole_step_path), (whole_step_path, backend_path)):
        losses = []
        for phase, path in enumerate((first, then)):
            target, train = path(seed=phase)
            if phase:
                zerofx.checkpoint.load(target, f"{directory}/{first.__name__}")
            losses += [train(*token_batch(i, rank)).item() for i in range(phase * steps, (phase + 1) * steps)]
            if not phase:
                zerofx.checkpoint.save(target, f"{directory}/{first.__name__}")
        out[f"{first.__name__}, then {then.__name__}"] = {
            "losses": (losses, ref_losses),
            "different_params": _different(zerofx.full_state_dict(target)["model"], reference)}
    return out


def each_optimizer_against_ddp(rank, world_size, stage, steps=3):
    """The backend leaves the update to the optimizer, run eagerly on this rank's shards: each optimizer of
    cases_optimizers against DDP, losses and full state."""
    for make in OPTIMIZERS.values():
        ref_model = gpt_and_adamw()[0]
        ref_opt = make(ref_model)
        model = gpt_and_adamw()[0]
        compiled, opt = _compiled(model, make(model), stage)
        _train_beside_ddp(compiled, opt, ref_model, ref_opt, train_step, rank, steps)
        assert_matches_ddp(zerofx.prepared(compiled), ref_model, ref_opt)
