"""Hugging Face Llama, GPT-2 (dropout on) and Mixtral (Mixture of Experts) at every stage, T5 (encoder-decoder) and
BERT (encoder) at two stages each, in the HF Trainer's loop style, against DDP; Mixtral under mixed precision against
FSDP2."""

import pytest

import cases_hf as cases


@pytest.mark.parametrize("arch", ["llama", "gpt2", "mixtral"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_hf_model_in_the_trainers_loop_matches_ddp(ranks2, stage, arch):
    result = ranks2.run(cases.hf_loop_against_ddp, stage=stage, arch=arch)[0]
    # training, one evaluation-mode step, the short last batch; Mixtral's second call traces once more: its first
    # forward installed transformers' output-capturing hooks
    assert result["traces"] == (4 if arch == "mixtral" else 3)


# each at two stages, together every stage: the suite stays short
@pytest.mark.parametrize("stage, arch", [(1, "t5"), (3, "t5"), (0, "bert"), (2, "bert")])
def test_hf_encoder_models_in_the_trainers_loop_match_ddp(ranks2, stage, arch):
    result = ranks2.run(cases.hf_loop_against_ddp, stage=stage, arch=arch)[0]
    assert result["traces"] == 3


# each precision at two stages, not every pair: the suite stays short
@pytest.mark.parametrize("stage, precision", [(1, "bf16"), (3, "bf16"), (0, "fp16"), (2, "fp16")])
def test_mixtral_in_mixed_precision_matches_fsdp2(ranks2, stage, precision):
    """Its experts' torch._grouped_mm traces in float32 masters' float16 compute too, as the CPU kernel computes."""
    ranks2.run(cases.hf_mixed_precision_against_fsdp2, stage=stage, arch="mixtral", precision=precision)
