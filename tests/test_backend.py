"""zerofx as a torch.compile backend: an eager loop around a compiled model matches DDP, issues the whole-step
path's collectives, survives graph breaks and shares checkpoints with the whole-step path."""

import pytest
import torch

import cases_backend as cases
from conftest import _pool
from models import mlp_and_adamw, regression_step


@pytest.fixture(scope="module")
def beside_ddp(tmp_path_factory):
    """Per stage, one run of each loop style beside DDP, the last step's collectives beside a whole step's, and the
    backend's graphs dumped."""
    runs = {}
    for stage in (0, 1, 2, 3):
        dump_dir = tmp_path_factory.mktemp(f"stage{stage}")
        runs[stage] = _pool(2).run(cases.beside_ddp_and_whole_step, stage=stage, dump_dir=str(dump_dir))[0]
        runs[stage]["dump_dir"] = dump_dir
    return runs


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_eager_loop_around_the_backend_matches_ddp(beside_ddp, stage):
    assert beside_ddp[stage]["ddp_mismatch"] is None


@pytest.mark.parametrize("stage, last_pass, collectives", [(0, "08_bucket_allreduce", 1),
                                                            (1, "09_reduce_scatter_grads", 1),
                                                            (2, "09_reduce_scatter_grads", 2),
                                                            (3, "11_reduce_scatter_grads", 5)])
def test_backend_issues_the_whole_step_paths_collectives_and_dumps_its_graphs(beside_ddp, stage, last_pass,
                                                                              collectives):
    result = beside_ddp[stage]
    # the same collectives; their order may differ where schedule_collectives moves one off a graph's peak, and the
    # backend's forward and backward are two graphs with peaks of their own
    assert sorted(result["backend"], key=repr) == sorted(result["whole_step"], key=repr)
    assert result["volumes"][0] == result["volumes"][1] > 0
    backward = result["dump_dir"] / "region0" / "backward"
    assert (backward / "00_aot.py").exists() and (result["dump_dir"] / "region0" / "forward" / "00_aot.py").exists()
    assert f"collectives: {collectives} " in (backward / f"{last_pass}.py").read_text()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_backend_stats_count_the_model_states_a_whole_step_counts(beside_ddp, stage):
    """Parameters, master weights and optimizer state kept between steps, by class, equal to a whole step's at the
    same stage; gradients live inside a step and are not measured here; the same formula."""
    ours, theirs = beside_ddp[stage]["model_states"]
    assert ours == theirs and ours["grads"] is None and ours["params"] > 0 and ours["optimizer_states"] > 0
    psi, n = beside_ddp[stage]["num_params"], 2  # fp32 AdamW: 16Ψ, 8Ψ + 8Ψ/N, 4Ψ + 12Ψ/N, 16Ψ/N
    assert beside_ddp[stage]["formula"] == pytest.approx({0: 16 * psi, 1: 8 * psi + 8 * psi / n,
                                                          2: 4 * psi + 12 * psi / n, 3: 16 * psi / n}[stage])


def test_stage_3_forward_saves_no_gathered_parameter_for_backward(beside_ddp):
    assert beside_ddp[3]["saved_gathered"] == 0


@pytest.mark.parametrize("stage", [0, 3])
def test_graph_break_between_blocks_gives_ddps_losses_and_is_named(ranks2, stage):
    """At stage 3 both regions gather the tied embedding, and its two gradient shards add up."""
    result = ranks2.run(cases.graph_break_against_ddp, stage=stage)[0]
    assert result["graphs"] == ["region0.backward", "region0.forward", "region1.backward", "region1.forward"]
    assert len(result["breaks"]) == 1 and "graph_break" in result["breaks"][0]


EAGER_CASES = [(model, stage, False) for model in cases.EAGER_MODELS for stage in (0, 1, 2, 3)]
EAGER_CASES += [(model, stage, True) for model in ("head eager, embedding compiled", "each block compiled")
                for stage in (0, 1, 2, 3)] + [("break in the loop over blocks", 3, True)]
EAGER_PARAMS = {"head eager, embedding compiled": lambda name: name == "wte.weight",  # tied to the head
                "scale read by a disabled function": lambda name: name == "scale"}


@pytest.mark.parametrize("model, stage, bf16", EAGER_CASES)
def test_parameters_read_by_eager_code_train_as_ddp_does(ranks2, model, stage, bf16):
    """Eager code reads parameters between or beside the compiled regions: a head in a disabled function (its weight,
    tied to the embedding, read both in a region and eagerly; at stage 3 gathered for the read), a scale
    passed to one, the embeddings and head around blocks compiled one by one, or split by a break inside the loop
    over the blocks (one region then serves both blocks: each backward hands its gradients to the parameters its
    own forward read). Their gradients are reduced as backward ends in one collective (at
    stage 0 the tied weight's sum averaged once more), and training matches DDP (bf16: the whole-step path)."""
    result = ranks2.run(cases.eager_parameters_against_ddp, stage=stage, model=model, mixed_precision=bf16)[0]
    data = [r for r in result["records"] if r[3] == "data"]
    eager = EAGER_PARAMS.get(model, lambda name: not name.startswith("blocks."))
    numels = [numel if stage == 0 else -(-numel // 2) * 2 for name, numel in result["numels"].items() if eager(name)]
    after_backward = data[-1] if stage in (0, 3) else data[-2]  # stages 1-2 then gather the updated chunks
    assert after_backward[:2] == ("all_reduce" if stage == 0 else "reduce_scatter", sum(numels)), data


@pytest.mark.parametrize("stage", [0, 1])
def test_ranks_whose_eager_code_reads_different_parameters_raise_before_averaging(ranks2, stage):
    messages = ranks2.run(cases.eager_parameters_differing_across_ranks, stage=stage)
    assert messages[0] == messages[1] and "outside the compiled regions" in messages[0], messages
    assert "scale" in messages[0]


def test_stage_3_parameters_used_by_eager_code_between_steps(ranks2):
    """Between steps every read of a parameter gives DDP's value (inside the case: ``named_parameters``,
    ``state_dict()``, ``copy.deepcopy``, a norm), ``load_state_dict`` writes new values into the shards (training then
    goes on as DDP's), and each way of writing into one otherwise raises naming it, where the write would land in a
    gathered copy and be lost."""
    for errors in ranks2.run(cases.eager_reads_between_steps):
        assert len(errors) == 12
        for write, message in errors.items():
            assert message is not None and "'ln_f.weight'" in message, (write, message)
            assert ("has no memory behind it" if write == ".data read" else "would write into") in message, message


@pytest.mark.parametrize("alone", [False, True])
def test_stage_3_ranks_reading_different_parameters_eagerly_raise_on_every_rank(ranks2, alone):
    """Ranks reading different parameters eagerly, or one rank reading while the other starts its next step, raise
    `RankMismatchError` on every rank, where the gathers would meet different collectives (or wait)."""
    messages = ranks2.run(cases.eager_reads_differing_across_ranks, alone=alone)
    other = "forward" if alone else "ln_f.bias"
    assert all(m is not None and "ln_f.weight" in m and other in m for m in messages), messages


def test_ranks_compiling_different_graphs_raise_before_their_collectives_disagree(ranks2):
    messages = ranks2.run(cases.ranks_compiling_different_graphs, stage=3)
    assert messages[0] == messages[1]
    assert "the compiled forward graph differs" in messages[0]
    assert "rank 0: region0.forward" in messages[0] and "rank 1: region0.forward" in messages[0]


@pytest.mark.parametrize("stage", [0, 3])
def test_a_rank_running_a_region_more_raises_on_every_rank_instead_of_hanging(ranks2, stage):
    """Rank 1's loss gains a term compiled as a region of its own: its agreement meets rank 0's backward's."""
    messages = ranks2.run(cases.ranks_running_different_regions, timeout=60, stage=stage)
    for message in messages:
        assert message.startswith("ranks would run different graphs"), messages
        assert "rank 0: region0.backward" in message and "rank 1: region1.forward" in message, messages


@pytest.mark.parametrize("backend_stage, whole_step_stage", [(0, 3), (3, 1)])
def test_checkpoints_move_between_the_backend_and_the_whole_step_path(ranks2, tmp_path, backend_stage,
                                                                      whole_step_stage):
    """The checkpoint layout depends on neither the path nor the stage: the parameters whole, shards or padded."""
    losses = ranks2.run(cases.checkpoint_between_paths, directory=str(tmp_path), backend_stage=backend_stage,
                        whole_step_stage=whole_step_stage)[0]
    assert set(losses) == {"backend, then whole step", "whole step, then backend"}


@pytest.mark.parametrize("stage", [0, 3])
def test_hugging_face_llama_through_the_backend_matches_ddp(ranks2, stage):
    regions = ranks2.run(cases.hf_llama_against_ddp, stage=stage)[0]
    assert regions == ["region0.backward", "region0.forward", "region1.backward", "region1.forward"]


BF16_RUNS = [(0, None), (1, None), (2, None), (3, None), (3, "float32")]  # (stage, reduce_dtype)


@pytest.fixture(scope="module")
def bf16_beside_whole_step():
    """Every run of `BF16_RUNS` in one call of the 2-rank pool (each run compiles both paths: seconds apiece)."""
    return _pool(2).run(cases.bf16_against_whole_step, runs=BF16_RUNS)[0]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_batchnorm_under_bf16_trains_through_the_backend_as_the_whole_step_does(ranks2, stage):
    """bf16 weights, fp32 running statistics: both paths call the norm with its weights cast up to the statistics'
    dtype, and give bitwise the same losses, parameters and statistics."""
    result = ranks2.run(cases.bf16_batchnorm_against_whole_step, stages=[stage])[0][stage]
    assert result["losses"][0] == result["losses"][1]
    assert result["different"] == []


@pytest.fixture(scope="module")
def bf16_clipped_beside_whole_step():
    return _pool(2).run(cases.bf16_clipped_against_whole_step, stages=[0, 1, 2, 3])[0]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zerofx_clip_under_bf16_clips_as_the_whole_step_does(bf16_clipped_beside_whole_step, stage):
    """Under bf16 the prepared model's gradients are the optimizer's fp32 shards at every stage (stage 0's masters
    too): ``zerofx.clip_grad_norm_`` finds the total norm over all ranks' shards that torch's clip, traced into a whole
    step, finds over whole gradients, bit for bit, and so do the clipped fp32 masters."""
    result = bf16_clipped_beside_whole_step[stage]
    backend_norms, step_norms = result["norms"]
    assert backend_norms == step_norms and min(backend_norms) > 0.05  # every step clipped (max_norm 0.05)
    assert result["losses"][0] == result["losses"][1]
    assert result["param_difference"] == 0.0

@pytest.mark.parametrize("stage, reduce_dtype", BF16_RUNS)
def test_bf16_through_the_backend_is_bitwise_the_whole_step_paths(bf16_beside_whole_step, stage, reduce_dtype):
    """MixedPrecision(param_dtype=torch.bfloat16) through the backend: 4 steps give bitwise the losses, fp32 master
    parameters and optimizer state of ``zerofx.compile`` with the same MixedPrecision, and the last step the same
    collectives (bf16, or fp32 gradients with ``reduce_dtype``) and volume. Bitwise because both paths run the same
    ATen ops in bf16 eagerly on the same values: forward and backward as traced (AOTAutograd's graphs, the whole
    step's), gradients reduced by the same passes, cast to fp32 for the same AdamW update on the masters, and cast
    back (stage 3: at each gather) with the same rounding."""
    result = bf16_beside_whole_step[(stage, reduce_dtype)]
    backend_losses, step_losses = result["losses"]
    assert backend_losses == step_losses
    assert result["param_dtypes"] == ["torch.bfloat16"] and result["master_dtypes"] == ["torch.float32"]
    assert result["moved"] == result["num_params"]
    assert result["different_params"] == [] and result["different_state"] == []
    backend, whole_step = result["collectives"]
    assert sorted(backend, key=repr) == sorted(whole_step, key=repr)
    sent = {dtype for _, _, dtype, _ in backend}
    assert sent == ({torch.bfloat16} if reduce_dtype is None else {torch.bfloat16, torch.float32})
    assert result["volumes"][0] == result["volumes"][1] > 0
    ours, theirs = result["model_states"]
    assert ours == theirs and ours["master_params"] > 0, (ours, theirs)
    psi, n = result["psi"], 2  # bf16 AdamW, fp32 masters: 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 14Ψ/N (no bf16 shard)
    b_g = 2 if reduce_dtype is None else 4
    expected = {0: (2 + b_g + 12) * psi, 1: (2 + b_g) * psi + 12 * psi / n, 2: 2 * psi + (b_g + 12) * psi / n,
                3: (b_g + 12) * psi / n}[stage]
    assert result["formula"] == pytest.approx(expected)


@pytest.mark.parametrize("backend_stage, whole_step_stage", [(0, 2), (3, 1)])
def test_bf16_checkpoints_move_between_the_backend_and_the_whole_step_path(ranks2, tmp_path, backend_stage,
                                                                           whole_step_stage):
    """Under bf16 mixed precision a checkpoint holds the fp32 masters whichever path saved it: a run resumed on the
    other path is bitwise the whole step trained straight through (the bf16 parameters are casts of the masters)."""
    runs = ranks2.run(cases.bf16_checkpoint_between_paths, directory=str(tmp_path), backend_stage=backend_stage,
                      whole_step_stage=whole_step_stage)[0]
    assert set(runs) == {"backend_path, then whole_step_path", "whole_step_path, then backend_path"}
    for way, result in runs.items():
        losses, straight = result["losses"]
        assert losses == straight, way
        assert result["different_params"] == [], way


def test_prepare_refuses_what_the_backend_does_not_run_yet():
    model, opt = cases.gpt_and_adamw()
    fp16 = cases.zerofx.MixedPrecision(param_dtype=torch.float16)
    for options, named in (({"mesh": object()}, "mesh="), ({"mixed_precision": fp16}, "loss_scaling")):
        with pytest.raises(NotImplementedError, match=named):
            cases.zerofx.prepare(model, opt, **options)
    kept = cases.zerofx.MixedPrecision(cast_at_gather=False)  # stage 3 alone keeps shards: refused there only
    with pytest.raises(NotImplementedError, match="cast_at_gather=False"):
        cases.zerofx.prepare(model, opt, stage=3, mixed_precision=kept)
    with pytest.raises(TypeError, match="mixed_precision must be a zerofx.MixedPrecision"):
        cases.zerofx.prepare(model, opt, mixed_precision=object())
    model.ln_f.weight.requires_grad_(False)
    with pytest.raises(NotImplementedError, match="frozen floating parameters"):
        cases.zerofx.prepare(model, opt, mixed_precision=cases.zerofx.MixedPrecision())
    with pytest.raises(ValueError, match="stage must be"):
        cases.zerofx.backend(stage=4)
    with pytest.raises(ValueError, match="not given to zerofx.prepare"):
        cases.zerofx.prepared(model)


@pytest.mark.parametrize("stage, mixed", [(0, True), (1, False), (2, False), (3, False), (3, True)])
def test_prepare_refuses_a_second_optimizer_and_a_trainable_parameter_outside_its_optimizer(stage, mixed):
    """A second optimizer over the biases, kept beside the one given to prepare, never moved them from stage 1 on:
    prepare takes every trainable parameter into its optimizer's shards. Stage 0 in full precision keeps the
    parameters in the model, and the second optimizer steps them (as under DDP)."""
    import zerofx

    model, _ = mlp_and_adamw()
    weights = torch.optim.AdamW([p for name, p in model.named_parameters() if name.endswith("weight")], lr=1e-2)
    biases = torch.optim.SGD([p for name, p in model.named_parameters() if name.endswith("bias")], lr=1e-2)
    policy = zerofx.MixedPrecision(torch.bfloat16) if mixed else None
    with pytest.raises(TypeError, match="zerofx.prepare takes one torch.optim.Optimizer, got list"):
        zerofx.prepare(model, [weights, biases], stage=stage, mixed_precision=policy)
    with pytest.raises(ValueError, match="parameter '0.bias' requires grad but is not in the optimizer given to "
                                         r"prepare \(2 such\)"):
        zerofx.prepare(model, weights, stage=stage, mixed_precision=policy)


def test_a_second_optimizer_beside_prepare_at_stage_0_steps_its_parameters():
    import zerofx

    model, _ = mlp_and_adamw()
    weights = torch.optim.AdamW([p for name, p in model.named_parameters() if name.endswith("weight")], lr=1e-2)
    biases = torch.optim.SGD([p for name, p in model.named_parameters() if name.endswith("bias")], lr=1e-2)
    model, weights = zerofx.prepare(model, weights, stage=0)
    compiled = torch.compile(model, backend=zerofx.backend(stage=0))
    before = model[0].bias.detach().clone()
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    torch.nn.functional.mse_loss(compiled(x), y).backward()
    weights.step(), biases.step()
    assert not torch.equal(model[0].bias, before)


@pytest.mark.parametrize("stage", [0, 3])
def test_a_float_batch_in_bf16_is_cast_as_it_enters_and_trains_as_the_whole_step(stage):
    """``cast_forward_inputs`` (FSDP2's default): the prepared model casts a float batch to bf16 as the whole-step
    path does, and the two give the same losses."""
    import zerofx

    mixed = zerofx.MixedPrecision(torch.bfloat16)
    model, opt = zerofx.prepare(*mlp_and_adamw(), stage=stage, mixed_precision=mixed)
    compiled = torch.compile(model, backend=zerofx.backend(stage=stage))
    whole_step = zerofx.compile(regression_step, stage=stage, mixed_precision=mixed)
    ref_model, ref_opt = mlp_and_adamw()
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
        torch.testing.assert_close(regression_step(compiled, opt, x, y), whole_step(ref_model, ref_opt, x, y))
