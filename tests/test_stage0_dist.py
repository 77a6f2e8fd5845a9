"""Stage 0 on 2 gloo ranks against DistributedDataParallel."""

import pytest

import cases_stage0 as cases
from models import gpt_and_adamw


def test_transformer_adamw_matches_ddp(ranks2):
    results = ranks2.run(cases.ddp_parity)
    assert results[0]["losses"] != results[1]["losses"]  # each rank trained on its own data
    assert results[0]["losses"][-1] < results[0]["losses"][0]


def test_one_allreduce_per_bucket_and_commdebugmode_agrees(ranks2):
    bucket_bytes = 16 * 1024
    result = ranks2.run(cases.allreduce_buckets, bucket_bytes=bucket_bytes)[0]
    numels = result["graph_allreduce_numels"]
    psi = result["num_params"]
    model, _ = gpt_and_adamw()
    largest_param = max(p.numel() for p in model.parameters())
    assert sum(numels) == psi
    assert result["carried"] == [1] + [0] * (len(numels) - 1)  # the rank agreement's element, on the first bucket
    assert all(n * 4 <= bucket_bytes or n == largest_param for n in numels)
    # Gradients become ready in reverse order of forward use: ln_f, each block from its MLP back to ln1, wte last
    # (its lookup is forward's first use). A bucket holds 4096 fp32 elements, exactly one MLP matrix (128 x 32):
    # ln_f (2 x 32) + the last block's mlp.2.bias (32) = 96 | mlp.2.weight | mlp.0.bias (128) | mlp.0.weight |
    # ln2 (2 x 32) + attn.proj (1024 + 32) + attn.qkv.bias (96) = 1216, as qkv.weight (3072) would overflow |
    # qkv.weight + ln1 (2 x 32) + the next block's mlp.2.bias (32) = 3168, in block 0 + wpe (16 x 32) = 3648 | wte
    per_block = [4096, 128, 4096, 1216]
    assert numels == [96, *per_block, 3168, *per_block, 3648, 65 * 32]
    data = [r for r in result["record_kinds"] if r[2] == "data"]
    assert [n for kind, n, _ in data if kind == "all_reduce"] == numels
    assert result["record_carried"] == result["carried"]  # the records say which element is not data
    control = [r for r in result["record_kinds"] if r[2] == "control"]
    assert control == [("all_gather", 2, "control")]  # the per-step rank check
    counts = result["comm_debug_counts"]
    all_reduces = sum(v for k, v in counts.items() if "all_reduce" in k or "allreduce" in k)
    all_gathers = sum(v for k, v in counts.items() if "all_gather" in k or "allgather" in k)
    assert all_reduces == len(numels), counts
    assert all_gathers == len(control)
    assert sum(counts.values()) == len(result["record_kinds"])


def test_uneven_batch_raises_on_every_rank_without_hanging(ranks2):
    results = ranks2.run(cases.uneven_batch, timeout=60)
    for r in results:
        assert r["error"] is not None and "batch" in r["error"] and "rank 1" in r["error"]
        assert r["seconds"] < 10
        assert r["group_ok"]


def test_an_uneven_first_batch_raises_showing_only_what_differs(ranks2):
    for r in ranks2.run(cases.uneven_first_batch, timeout=60):
        error = r["error"]
        assert error is not None and r["group_ok"]
        assert "rank 0: batch: (" in error and "torch.Size([4, 16])" in error, error
        assert "rank 1: batch: (" in error and "torch.Size([3, 16])" in error, error
        assert "params" not in error and "buffers" not in error, error  # the same on both ranks


def _one_short(rank):
    return 3 if rank == 1 else 4


def _each_its_own(rank):
    return 3 - rank


@pytest.mark.parametrize("last_batch,precision", [(_one_short, "fp32"), (_each_its_own, "fp32"),
                                                  (_one_short, "bf16"), (_each_its_own, "fp16")])
def test_steady_steps_carry_the_rank_agreement_and_a_changed_rank_still_raises_everywhere(ranks2, last_batch,
                                                                                        precision):
    """From the third step of one shape on, the agreement rides on the first bucket: the step issues no control
    collective. A step every rank shortens alike trains as DDP does (fp32), as the step without the check does
    (bf16, fp16); a rank that alone changes, or ranks that change differently, raise on every rank, at once, and
    the group still works."""
    results = ranks2.run(cases.carried_agreement, last_batch=last_batch, precision=precision, timeout=120)
    for r in results:
        assert r["carried"]
        # 1: the all-gathers of the step and of the new graph's fingerprint; 2: the step's (no graph has run twice
        # yet); 3, 4 carried; 5 shortened: every rank replays the first bucket, then the step's all-gather and the
        # new graph's; 6, 7: the step's all-gather again (6 changed back, 7 follows a change); 8 carried
        assert r["control"] == [2, 1, 0, 0, 2, 1, 1, 0]
        assert r["debug_all_gathers"] == r["control"]
        assert r["error"] is not None and "batch" in r["error"] and "rank 1" in r["error"], r["error"]
        assert r["seconds"] < 10
        assert r["group_ok"]


def test_dump_dir_has_one_readable_file_per_pass(ranks2, tmp_path):
    results = ranks2.run(cases.dump_files, dump_dir=str(tmp_path))
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["00_capture.py", "01_remove_profiler_ops.py", "02_checkpoint_activations.py",
                     "03_partition_checkpoints.py", "04_offload_checkpoints.py", "05_recompute_pointwise.py",
                     "06_skip_nonfinite_update.py", "07_broadcast_buffers.py", "08_bucket_allreduce.py",
                     "09_fold_aliases.py", "10_schedule_collectives.py", "11_carry_rank_agreement.py",
                     "12_plan_scalar_operands.py", "13_plan_memory.py",
                     "memory.png", "units.txt"]
    text = (tmp_path / "08_bucket_allreduce.py").read_text()
    n = results[0]["allreduces"]
    assert n == 12 and f"# collectives: {n} (" in text  # the buckets of 16 KiB counted in the test above
    assert text.count("= zerofx_collectives_all_reduce(") == n
    assert "# collectives: 0 (0 bytes)" in (tmp_path / "00_capture.py").read_text()
    assert "p__wte_weight" in text and 'f32[65, 32]' in text  # parameters by name, with shapes
    namespace = {}
    exec(compile(text, "08_bucket_allreduce.py", "exec"), namespace)  # the dump is a Python module
    assert "forward" in vars(namespace["Step"])
    assert results[0]["final_is_last_pass"] and results[0]["capture_has_no_allreduce"]


def test_rank_dependent_branch_raises_on_every_rank(ranks2):
    errors = ranks2.run(cases.rank_dependent_branch, timeout=60)
    assert all(e is not None and "captured graph" in e for e in errors)

