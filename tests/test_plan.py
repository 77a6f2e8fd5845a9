"""``zerofx.plan``: predictions for a world of any size from the step's graph, checked against runs that really
happen here and against the paper's formula (its figures at scale: benchmarks/plan_at_scale.py)."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import cases_plan
import zerofx
from models import token_batch, train_step
from nanogpt import GPT
from zerofx.__main__ import main
from zerofx.planning import KNOWN, from_hf_config, gpt_of_size, model_shape
from zerofx.planning.cli import parse_bytes
from zerofx.planning.decoder import num_params, plan_decoder
from zerofx.planning.on_meta import OnMeta
from zerofx.planning.search import deepest


def _predicted(world_size, optimizer):
    out = {}
    for name, options in cases_plan.RUNS.items():
        model, opt = cases_plan.one_block_gpt(optimizer, device="meta")
        batch = token_batch(0, 0, batch=cases_plan.BATCH, cfg=cases_plan.ONE_BLOCK_GPT)
        stats = zerofx.plan(train_step, model, opt, batch, world_size=world_size,
                            **cases_plan.compile_options(options))
        out[name] = cases_plan.figures(stats)
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
    """Stages 0-3 (fp32 and bf16 mixed precision, AdamW) on 2 gloo ranks: the plan's model-state bytes by class
    within 1% of the measured total, its peak within 5% of the measured peak (live storages), the same
    communication."""
    measured = ranks2.run(cases_plan.measured_stats, optimizer="adamw")[0]
    _assert_predicted_as_measured(_predicted(2, "adamw"), measured)


def test_plan_predicts_what_four_ranks_measure(ranks4):
    """The same on 4 ranks, with SGD with momentum: a second optimizer, and the faster one to trace."""
    measured = ranks4.run(cases_plan.measured_stats, optimizer="sgd")[0]
    _assert_predicted_as_measured(_predicted(4, "sgd"), measured)


def test_sizes_name_the_papers_models():
    """A size is a GPT-like model with Ψ within 1% of it; "7.5B" is 36 layers of width 4096, the shape of the 7.5B
    model the paper's figures are for, "1T" Megatron-LM's trillion-parameter width (25600)."""
    for size, psi in (("1.5B", 1.5e9), ("7.5B", 7.5e9), ("100B", 100e9), ("1T", 1e12)):
        assert abs(num_params(gpt_of_size(size)) / psi - 1) < 0.01, (size, num_params(gpt_of_size(size)))
    assert (gpt_of_size("7.5B").n_layer, gpt_of_size("7.5B").d_model) == (36, 4096)
    assert gpt_of_size("1T").d_model == 25600


def test_hugging_face_configs_give_their_models_parameters():
    """GPT-2 (tied embeddings) and Llama (grouped-query attention, untied): the planner's decoder for the config has
    as many parameters as the Hugging Face model built from it."""
    import transformers

    configs = [transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=32),
               transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=96, vocab_size=100,
                                        max_position_embeddings=32)]
    for config in configs:
        with torch.device("meta"):
            want = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
        assert num_params(from_hf_config(config)) == want, config.model_type


def test_deepest_follows_the_line_and_confirms_it():
    budget = 1000

    def linear(shape):
        return 100 + 30 * shape.n_layer

    def curved(shape):  # the line through depths 2 and 4 overshoots: the plans walk back
        return 100 + 30 * shape.n_layer + shape.n_layer**2

    shape = gpt_of_size("1.5B")
    assert deepest(shape, linear, budget) == 30 and deepest(shape, linear, budget, confirm=True) == 30
    assert deepest(shape, curved, budget) == 25  # the line's answer, which no plan checked
    assert deepest(shape, curved, budget, confirm=True) == 18  # 964 bytes; 19 blocks need 1031
    assert deepest(shape, lambda s: budget + 1, budget, confirm=True) == 0


def test_attention_on_meta_is_the_fused_kernel():
    """On meta tensors SDPA would decompose into bmm + softmax (T × T scores); planning traces the fused kernel,
    which keeps only the output and a log-sum-exp per query."""
    def attend(q, k, v):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()
        return q.grad

    q, k, v = (torch.empty(2, 4, 16, 8, device="meta", requires_grad=True) for _ in range(3))
    with OnMeta():
        gm = make_fx(attend, tracing_mode="fake")(q, k, v)
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.bmm.default not in targets
    fused_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    fused = next(n for n in gm.graph.nodes if n.target == fused_op)
    assert [tuple(t.shape) for t in fused.meta["val"][:2]] == [(2, 4, 16, 8), (2, 4, 16)]


def test_bad_input_names_the_argument(tmp_path):
    model, opt = cases_plan.one_block_gpt("sgd", device="meta")
    batch = token_batch(0, 0, cfg=cases_plan.ONE_BLOCK_GPT)
    with pytest.raises(ValueError, match="world_size"):
        zerofx.plan(train_step, model, opt, batch, world_size=0)
    with pytest.raises(ValueError, match="mesh_shape"):
        zerofx.plan(train_step, model, opt, batch, world_size=8, mesh_shape=(2, 2))
    real = GPT(cases_plan.ONE_BLOCK_GPT)
    with pytest.raises(ValueError, match="model: plan needs its parameters on the meta device"):
        zerofx.plan(train_step, real, torch.optim.AdamW(real.parameters()), batch, world_size=2)
    with pytest.raises(ValueError, match="model: '.*missing' is not one of gpt2, .*, a size such as 7.5B, nor"):
        model_shape(str(tmp_path / "missing"))  # a directory: read at once, no Hugging Face hub to ask
    with pytest.raises(ValueError, match="seq"):
        plan_decoder(KNOWN["gpt2"], world_size=2, stage=0, seq=4096)
    with pytest.raises(SystemExit, match="--keep-param-shard .* --precision fp32"):
        main(["plan", "--model", "gpt2", "--world", "8", "--precision", "fp32", "--keep-param-shard"])


@pytest.mark.parametrize("keep_param_shard", [False, True])
def test_command_line_prints_the_stages_of_a_hugging_face_model(tmp_path, capsys, keep_param_shard):
    """``python -m zerofx plan`` for a config read from a directory: the stage 3 row's model states are the formula's
    (b_g + K)Ψ/N_d for bf16 mixed-precision Adam, 14Ψ/N_d, within 1% (padding to a multiple of N_d); with
    ``--keep-param-shard`` the paper's (b_p + b_g + K)Ψ/N_d, 16Ψ/N_d."""
    import transformers

    transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=32).save_pretrained(tmp_path)
    main(["plan", "--model", str(tmp_path), "--world", "8", "--stage", "3", "--batch", "2", "--device-memory", "1GB",
          *(["--keep-param-shard"] if keep_param_shard else [])])
    lines = capsys.readouterr().out.splitlines()
    assert ("bf16 shard kept" in lines[0]) == keep_param_shard, lines[0]
    row = lines[-1].split()
    want = (16 if keep_param_shard else 14) * num_params(model_shape(str(tmp_path))) / 8
    assert row[0] == "3" and row[-1] == "yes", lines
    assert abs(parse_bytes(row[1] + row[2]) / want - 1) <= 0.01, (row, want)


def test_activations_at_their_peak_are_named_by_the_op_that_made_them():
    """With checkpointed blocks, GPT-2's activations peak in the loss's backward: every block's input is kept, and
    three B·T·V tensors over the vocabulary are alive (the log-probabilities, their gradient, the logits')."""
    shape = dataclasses.replace(model_shape("gpt2").with_depth(2), d_model=64, n_head=2, d_ff=256)
    batch, seq = 2, 32
    stats = plan_decoder(shape, world_size=1, stage=0, batch=batch, seq=seq, checkpoint="blocks")
    parts = stats.activations_at_peak
    over_vocabulary = batch * seq * shape.vocab_size * 4
    assert parts["aten._log_softmax.default"] == over_vocabulary
    assert parts["aten.nll_loss_backward.default"] == over_vocabulary
    assert parts["aten._log_softmax_backward_data.default"] == over_vocabulary
    assert parts["checkpoints"] == shape.n_layer * batch * seq * shape.d_model * 4
    assert sum(parts.values()) == stats.activation_bytes
    assert list(parts.values()) == sorted(parts.values(), reverse=True)
