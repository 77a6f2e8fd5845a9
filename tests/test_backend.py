"""zerofx as a torch.compile backend: an eager loop around a compiled model matches DDP, issues the whole-step
path's collectives, survives graph breaks and shares checkpoints with the whole-step path."""

import pytest

import cases_backend as cases
from conftest import _pool


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
                                                            (1, "08_reduce_scatter_grads", 1),
                                                            (2, "08_reduce_scatter_grads", 2),
                                                            (3, "10_reduce_scatter_grads", 5)])
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


def test_stage_3_forward_saves_no_gathered_parameter_for_backward(beside_ddp):
    assert beside_ddp[3]["saved_gathered"] == 0


@pytest.mark.parametrize("stage", [0, 3])
def test_graph_break_between_blocks_gives_ddps_losses_and_is_named(ranks2, stage):
    """At stage 3 both regions gather the tied embedding, and its two gradient shards add up."""
    result = ranks2.run(cases.graph_break_against_ddp, stage=stage)[0]
    assert result["graphs"] == ["region0.backward", "region0.forward", "region1.backward", "region1.forward"]
    assert len(result["breaks"]) == 1 and "graph_break" in result["breaks"][0]


def test_parameters_read_outside_every_compiled_region_are_refused_before_the_update(ranks2):
    message = ranks2.run(cases.eager_parameters_refused)[0]
    assert "'wte.weight'" in message and "'ln_f.weight'" in message and "blocks" not in message.split("]")[0]


def test_ranks_compiling_different_graphs_raise_before_their_collectives_disagree(ranks2):
    messages = ranks2.run(cases.ranks_compiling_different_graphs, stage=3)
    assert messages[0] == messages[1]
    assert "the compiled forward graph differs" in messages[0]
    assert "rank 0: region0.forward" in messages[0] and "rank 1: region0.forward" in messages[0]


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


def test_prepare_refuses_what_the_backend_does_not_run_yet():
    model, opt = cases.gpt_and_adamw()
    for options, named in (({"mesh": object()}, "mesh="), ({"mixed_precision": object()}, "mixed_precision")):
        with pytest.raises(NotImplementedError, match=named):
            cases.zerofx.prepare(model, opt, **options)
    with pytest.raises(ValueError, match="stage must be"):
        cases.zerofx.backend(stage=4)
    with pytest.raises(ValueError, match="not given to zerofx.prepare"):
        cases.zerofx.prepared(model)
