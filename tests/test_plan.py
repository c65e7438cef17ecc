"""`overlap plan`: the pieces of the model (FLOPs, bytes, links, bubble, windows) and the command line."""

import json

import pytest

from overlap.cli import main
from overlap.config.recipes import qwen3_30b_a3b
from overlap.plan.comm_model import alltoall_time_s, expected_destinations, members_per_node, ring_time_s
from overlap.plan.hardware import builtin_cluster
from overlap.plan.schedule import bubble_fraction
from overlap.training.metrics import flops_per_token, training_flops

H100 = builtin_cluster("h100", "bf16", 8)


def test_flops_per_token_is_megatrons_count():
    f = training_flops(qwen3_30b_a3b(16).model)  # planner reference 4.1: 23.006 GFLOP/token at s = 4096
    assert f.total / 1e9 == pytest.approx(23.006, abs=0.001)
    assert f.attention_core / 48 == pytest.approx(100.7e6, rel=1e-3)  # causal halving
    assert f.logits == pytest.approx(1.867e9, rel=1e-3)
    assert flops_per_token(qwen3_30b_a3b(16).model) == f.total


def test_link_choice_follows_members_per_node():
    assert members_per_node(16, 1, 8) == 8 and members_per_node(16, 8, 8) == 1 and members_per_node(4, 1, 8) == 4
    n = 1e9
    assert ring_time_s(n, 8, 8, H100) == pytest.approx(10e-6 + n / 370e9)  # one node: NVLink
    assert ring_time_s(n, 16, 1, H100) == pytest.approx(20e-6 + n / 46e9)  # one member per node: its NIC
    assert ring_time_s(n, 16, 8, H100) == pytest.approx(20e-6 + n / 368e9)  # rail-parallel: min(8 x 46, 370)
    # EP16 over 2 nodes: 8 of the 15 peers are off-node; that share goes through this GPU's NIC
    assert alltoall_time_s(15e6, 16, 8, H100) == pytest.approx(20e-6 + 8e6 / 46e9)


def test_expected_destinations_match_the_reference():
    assert expected_destinations(16, 128, 8) == pytest.approx(6.6, abs=0.05)
    assert expected_destinations(2, 128, 8) == pytest.approx(1.99, abs=0.01)


def test_bubble_fractions():
    assert bubble_fraction(4, 8) == pytest.approx(3 / 8)
    assert bubble_fraction(4, 8, 2) == pytest.approx(3 / 16)
    assert bubble_fraction(1, 8) == 0


def _plan(tmp_path, *argv):
    out = tmp_path / "plan.json"
    assert main(["plan", *argv, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_plan_json_mirrors_bench_and_gives_verdicts(tmp_path):
    doc = _plan(tmp_path, "-m", "qwen", "-mr", "qwen3_30b_a3b", "-g", "h100", "-ng", "16", "-ep", "16")
    row = doc["configs"][0]
    for key in ("name", "overrides", "step_time_ms", "tflops_per_gpu", "compute_ms", "bubble_ms", "exposed_comm_ms",
                "total_comm_ms", "bytes_per_iter", "peak_mem_gb"):
        assert key in row
    assert doc["cluster"]["gpu"] == "h100" and "calibrated" in doc["cluster"]["compute_efficiency_source"]
    verdicts = " | ".join(doc["verdicts"])
    assert "EP overlap: -" in verdicts and "pays" in verdicts and "TP overlap: not applicable at TP=1" in verdicts


def test_ab_uses_bench_semantics(tmp_path):
    doc = _plan(tmp_path, "-m", "llama", "-mr", "llama3_8b", "-g", "h100", "-ng", "16", "-tp", "2",
                "--ab", "comm_overlap.tp_comm_overlap=false,true")
    assert [c["name"] for c in doc["configs"]] == ["comm_overlap.tp_comm_overlap=false",
                                                  "comm_overlap.tp_comm_overlap=true"]
    assert doc["configs"][1]["step_time_ms"]["mean"] < doc["configs"][0]["step_time_ms"]["mean"]
    assert doc["configs"][0]["total_comm_ms"]["tp_ag"] > 0


def test_pipeline_bubble_and_interleaving(tmp_path):
    common = ["-m", "llama", "-mr", "llama3_70b", "-g", "h100", "-ng", "64", "-tp", "8", "-pp", "4", "-gb", "32"]
    one = _plan(tmp_path, *common, "-vp", "None", "--config", "a:", "--config", "b:")["configs"][0]
    inter = _plan(tmp_path, *common, "-vp", "5", "--config", "a:", "--config", "b:")["configs"][0]
    assert inter["bubble_ms"] < one["bubble_ms"] and inter["bytes_per_iter"]["pp_send"] > one["bytes_per_iter"]["pp_send"]


def test_cluster_file(tmp_path, capsys):
    cluster = tmp_path / "c.json"
    cluster.write_text(json.dumps({"gpu": "cpu", "gpus_per_node": 4, "peak_tflops": 0.05, "compute_efficiency": 1.0,
                                   "nvlink": {"bandwidth_GBps": 1, "latency_us": 50},
                                   "nic": {"bandwidth_GBps": 1, "latency_us": 50}}))
    doc = _plan(tmp_path, "-m", "qwen", "-mr", "dense_tiny", "-g", "cpu", "-ng", "4", "--cluster", str(cluster))
    assert doc["cluster"]["peak_tflops"] == 0.05
    cluster.write_text(json.dumps({"gpu": "cpu", "peak_tflops": 0.05}))
    assert main(["plan", "-m", "qwen", "-mr", "dense_tiny", "-g", "cpu", "-ng", "4", "--cluster", str(cluster)]) == 2
    assert "--cluster gpus_per_node" in capsys.readouterr().err


@pytest.mark.parametrize("argv, field", [
    (["-g", "vr200"], "-g/--gpu"),
    (["-g", "cpu"], "-g/--gpu"),
    (["-g", "h100", "--ab", "nokey"], "--ab"),
    (["-g", "h100", "--json", "/nonexistent/dir/x.json"], "--json"),
])
def test_bad_input_is_a_config_error(capsys, argv, field):
    assert main(["plan", "-m", "qwen", "-mr", "qwen3_30b_a3b", "-ng", "16", *argv]) == 2
    err = capsys.readouterr().err
    assert f"overlap: error: {field}" in err and "Traceback" not in err
