"""zerofx as a torch.compile backend: an eager loop around a compiled model matches DDP, issues the whole-step
path's collectives, survives graph breaks and shares checkpoints with the whole-step path."""

import pytest

import cases_backend as cases


@pytest.mark.parametrize("stage", [0])
def test_eager_loop_around_the_backend_matches_ddp(ranks2, stage):
    assert ranks2.run(cases.against_ddp, stage=stage) == [True, True]


@pytest.mark.parametrize("stage", [0])
def test_backend_issues_the_whole_step_paths_collectives_and_dumps_its_graphs(ranks2, stage, tmp_path):
    result = ranks2.run(cases.records_beside_whole_step, stage=stage, bucket_bytes=None, dump_dir=str(tmp_path))[0]
    assert result["backend"] == result["whole_step"]
    assert result["volumes"][0] == result["volumes"][1] > 0
    backward = tmp_path / "region0" / "backward"
    assert (backward / "00_aot.py").exists() and (tmp_path / "region0" / "forward" / "00_aot.py").exists()
    assert "collectives: 1 " in (backward / "08_bucket_allreduce.py").read_text()


def test_graph_break_between_blocks_gives_ddps_losses_and_is_named(ranks2):
    result = ranks2.run(cases.graph_break_against_ddp)[0]
    assert result["graphs"] == ["region0.backward", "region0.forward", "region1.backward", "region1.forward"]
    assert len(result["breaks"]) == 1 and "graph_break" in result["breaks"][0]


def test_parameters_read_outside_every_compiled_region_are_refused_before_the_update(ranks2):
    message = ranks2.run(cases.eager_parameters_refused)[0]
    assert "'wte.weight'" in message and "'ln_f.weight'" in message and "blocks" not in message.split("]")[0]


@pytest.mark.parametrize("whole_step_stage", [3])
def test_checkpoints_move_between_the_backend_and_the_whole_step_path(ranks2, tmp_path, whole_step_stage):
    """The backend at stage 0 and the whole step at stage 3: the checkpoint layout depends on neither."""
    losses = ranks2.run(cases.checkpoint_between_paths, directory=str(tmp_path),
                        whole_step_stage=whole_step_stage)[0]
    assert set(losses) == {"backend, then whole step", "whole step, then backend"}


@pytest.mark.parametrize("stage", [0])
def test_hugging_face_llama_through_the_backend_matches_ddp(ranks2, stage):
    regions = ranks2.run(cases.hf_llama_against_ddp, stage=stage)[0]
    assert regions == ["region0.backward", "region0.forward", "region1.backward", "region1.forward"]


def test_prepare_refuses_what_the_backend_does_not_run_yet():
    model, opt = cases.gpt_and_adamw()
    for options, named in (({"stage": 1}, "stage 1"), ({"mesh": object()}, "mesh="),
                           ({"mixed_precision": object()}, "mixed_precision")):
        with pytest.raises(NotImplementedError, match=named):
            cases.zerofx.prepare(model, opt, **options)
    with pytest.raises(ValueError, match="stage must be"):
        cases.zerofx.backend(stage=4)
    with pytest.raises(ValueError, match="not given to zerofx.prepare"):
        cases.zerofx.prepared(model)
