"""ZeRO over "dp" × tensor parallelism over "tp" on a 2 × 2 mesh of gloo ranks (cases in cases_tensor_parallel.py)."""

import cases_tensor_parallel as cases


def test_every_stage_matches_fsdp2_with_the_same_tensor_parallel_plan(ranks4):
    runs = ranks4.run(cases.stages_match_fsdp2, timeout=600)
    assert len(runs[0]) == 4 and all(len(losses) == 10 for losses in runs[0].values())
