"""The peers benchmark end to end on the tiny size, fp32, one round: it runs, writes its table, and every system
trains to the same loss with the bytes and traffic its stage implies. DeepSpeed is left out (an optional extra
whose first start compiles a C++ extension); the chart is checked where matplotlib is installed. bf16 against
FSDP2 is tested in test_stages_dist."""

import importlib.util
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import compare_peers  # noqa: E402
from peers.report import losses_agree  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("peers")
    path, runs = compare_peers.main(["--size", "tiny", "--worlds", "2", "--rounds", "1", "--warmup", "1",
                                     "--steps", "2", "--precisions", "fp32", "--skip", "deepspeed", "--out", str(out), "--date", "test"])
    return path, runs[0], {(r["name"], r["precision"]): r for r in runs[0]["results"]}


def test_every_system_runs_and_the_losses_agree(tiny):
    _, run, by_name = tiny
    assert set(by_name) == {(f"zerofx-{s}", "fp32") for s in range(4)} | {
        ("DDP", "fp32"), ("FSDP2 reshard", "fp32"), ("FSDP2 no-reshard", "fp32")}
    assert run["skipped"] == {}
    assert losses_agree(run["results"]) == {"fp32": True}
    assert by_name[("zerofx-0", "fp32")]["final_loss"] == pytest.approx(by_name[("DDP", "fp32")]["final_loss"],
                                                                        rel=1e-6)


def test_traffic_is_the_stage_s_by_ring_accounting(tiny):
    _, run, by_name = tiny
    psi, n = run["psi"], run["world_size"]

    def in_psi(name, precision="fp32"):
        return by_name[(name, precision)]["comm_elements"] / (psi * (n - 1) / n)

    for stage, moved in ((0, 2), (1, 2), (2, 2), (3, 3)):
        # besides the formula: the 8-byte rank check per step and padding to a multiple of N (28 parameters)
        assert in_psi(f"zerofx-{stage}") == pytest.approx(moved, abs=5e-3)
    assert in_psi("DDP") == pytest.approx(2, abs=1e-9)
    assert in_psi("FSDP2 reshard") == pytest.approx(3, abs=5e-3)
    assert in_psi("FSDP2 no-reshard") == pytest.approx(2, abs=5e-3)


def test_model_states_are_what_each_system_keeps(tiny):
    _, run, by_name = tiny
    psi = run["psi"]
    state = {key: r["model_state_bytes"] for key, r in by_name.items()}
    counters = 4 * 28  # Adam's step counter, one fp32 scalar per parameter tensor (28 in the tiny GPT)
    assert state[("zerofx-0", "fp32")] == 16 * psi + counters  # nothing of the batch stays alive between steps
    assert state[("DDP", "fp32")] == 20 * psi + counters  # its gradient buckets beside .grad
    assert state[("zerofx-3", "fp32")] < state[("zerofx-2", "fp32")] < state[("zerofx-0", "fp32")]


def test_the_table_and_chart_are_written(tiny):
    path, _, by_name = tiny
    text = open(path).read()
    assert text.count("| zerofx-") == 4 and "Final losses agree: fp32 yes" in text
    assert "compare_peers.py --size tiny" in text
    chart = path.replace(".md", ".png")
    if importlib.util.find_spec("matplotlib"):
        assert os.path.getsize(chart) > 0
    else:
        assert "Chart skipped" in text
