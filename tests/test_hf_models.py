"""Hugging Face Llama and GPT-2 (dropout on) at every stage, in the HF Trainer's loop style, against DDP."""

import pytest

import cases_hf as cases


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_hf_model_in_the_trainers_loop_matches_ddp(ranks2, stage, arch):
    result = ranks2.run(cases.hf_loop_against_ddp, stage=stage, arch=arch)[0]
    assert result["traces"] == 3  # training, one evaluation-mode step, the short last batch
