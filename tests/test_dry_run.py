"""`overlap run --dry-run`: one rank of a cluster layout played in one CPU process on fake tensors.

The three layouts of the guides (Qwen3-30B-A3B at EP16, Llama-3-70B at TP4 x PP4 x VPP2,
Qwen3-235B-A22B at TP2 x EP32 x PP8 x VPP4) run at their real widths, sequence lengths and world
sizes; only the depth and the micro-batches are cut (a fake op costs the same at any size, so time
goes with the number of layers and micro-batches played). Each runs in its own process, as a user
would run it: the dry run owns that process's torch.distributed world.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from overlap.layers.moe import split_sizes
from overlap.layers.moe.permute import count_per_expert
from overlap.layers.moe.split_sizes import BalancedRouting

QWEN30 = [
    "-m",
    "qwen",
    "-mr",
    "qwen3_30b_a3b",
    "-g",
    "h100",
    "-ng",
    "16",
    "-ep",
    "16",
    "model.num_layers=2",
]
LLAMA70 = [
    "-m",
    "llama",
    "-mr",
    "llama3_70b",
    "-g",
    "h100",
    "-ng",
    "32",
    "-tp",
    "4",
    "-pp",
    "4",
    "-vp",
    "2",
    "model.num_layers=8",
    "--dry-run-microbatches",
    "4",
]
QWEN235 = [
    "-m",
    "qwen",
    "-mr",
    "qwen3_235b_a22b",
    "-g",
    "h100",
    "-ng",
    "256",
    "-tp",
    "2",
    "-ep",
    "32",
    "-pp",
    "8",
    "-vp",
    "4",
    "model.num_layers=30",
]

# Peak over the memory model's estimate for the same rank and micro-batches
# (`overlap.perf.memory_model`, what `overlap explain` and `overlap plan` report): within 10%, the
# issue's bound (measured on these cut layouts: 1.00 to 1.01; tests/test_memory_model.py holds the
# guide commands' other variants).
PEAK_OVER_ESTIMATE = (1 / 1.1, 1.1)


def _dry_run(
    tmp_path, *args: str, code: str | None = None
) -> tuple[subprocess.CompletedProcess, dict | None]:
    """`overlap run --dry-run ARGS` in a fresh process (after running `code`, a test's patch); its
    JSON report."""
    report = tmp_path / "dry.json"
    argv = ["run", *args, "--dry-run", "--dry-run-json", str(report)]
    script = (
        f"{textwrap.dedent(code or '')}\nimport sys\nfrom overlap.cli import "
        f"main\nsys.exit(main({argv!r}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    return out, json.loads(report.read_text()) if report.exists() else None


_REPORTS: dict[tuple[str, ...], dict] = {}


def _report(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess | None, dict]:
    """`_dry_run` of a layout, once per test session (the scaled peaks reuse the layout tests')."""
    if args not in _REPORTS:
        out, doc = _dry_run(tmp_path, *args)
        _check_common(out, doc)
        _REPORTS[args] = doc
        return out, doc
    return None, _REPORTS[args]


def _check_common(out: subprocess.CompletedProcess, doc: dict) -> None:
    assert out.returncode == 0, out.stderr[-3000:]
    assert doc["ok"] and doc["finding"] is None
    assert "Result: the step ran; no device mix-up found" in out.stdout
    low, high = PEAK_OVER_ESTIMATE
    assert doc["peak_bytes"] > doc["start_bytes"] > 0
    assert low <= 1 / doc["peak_over_estimate"] <= high, doc["peak_over_estimate"]
    reads = {r["site"].split(":")[0]: r for r in doc["host_reads"]}
    assert reads["overlap/training/trainer.py"]["intended"] == "the logged loss"
    assert reads["overlap/optim/adam.py"]["intended"].startswith("the gradient norm")


def test_qwen3_30b_ep16(tmp_path):
    out, doc = _report(tmp_path, *QWEN30)
    kinds = set(doc["program"])
    assert {
        "ep_dispatch",
        "ep_combine",
        "ep_dispatch_bwd",
        "ep_combine_bwd",
        "ep_counts",
        "dp_rs",
        "dp_ag",
    } <= kinds
    assert not any(k.startswith(("tp_", "pp_")) for k in kinds), kinds
    assert doc["program"]["ep_dispatch"]["groups"] == [list(range(16))]
    # 2 MoE layers x 2 micro-batches (the default: the step's 64 cut to the steady state of PP = 1)
    assert (doc["microbatches_played"], doc["microbatches_per_step"]) == (2, 64)
    assert doc["program"]["ep_dispatch"]["ops"] == 4
    assert doc["split_size_reads"] == 4 and "routing assumed balanced" in out.stdout
    split = [
        r for r in doc["host_reads"] if r["site"].startswith("overlap/layers/moe/dispatcher.py")
    ]
    assert split and split[0]["answer"] == "balanced routing"


def test_qwen3_30b_ep16_sync_free_dispatch_reads_no_split_sizes(tmp_path):
    """`model.moe_expert_rank_capacity_factor=1.5`: the blocks' all-to-alls (1.5x the dropless
    bytes at balanced routing: every block is full, each row with its local expert beside its
    weight), no counts exchange, and no host read but the loss and the grad norm (the overflow
    count folded into the latter); the memory model sizes the padded rows within the dry run's
    bound (`_check_common`)."""
    _, dropless = _report(tmp_path, *QWEN30)
    out, doc = _report(tmp_path, *QWEN30, "model.moe_expert_rank_capacity_factor=1.5")
    assert doc["split_size_reads"] == 0 and "routing assumed balanced" not in out.stdout
    assert sorted(r["intended"].split(" (")[0] for r in doc["host_reads"]) == [
        "the gradient norm",
        "the logged loss",
    ]
    assert "ep_counts" not in doc["program"] and dropless["program"]["ep_counts"]["ops"] == 4
    blocks, plain = doc["program"]["ep_dispatch"], dropless["program"]["ep_dispatch"]
    assert blocks["ops"] == plain["ops"] == 4
    # rows of 2048 bf16 (4096 bytes) and a weight (4), here with the local expert (4 more)
    assert blocks["bytes"] == pytest.approx(1.5 * plain["bytes"] * 4104 / 4100, rel=1e-3)


def test_llama3_70b_tp4_pp4_vpp2(tmp_path):
    out, doc = _dry_run(tmp_path, *LLAMA70)
    _check_common(out, doc)
    program = doc["program"]
    assert {
        "tp_ag",
        "tp_rs",
        "pp_send_fwd",
        "pp_recv_fwd",
        "pp_send_bwd",
        "pp_recv_bwd",
        "dp_rs",
        "dp_ag",
    } <= set(program)
    assert not any(k.startswith("ep_") for k in program)
    assert program["tp_ag"]["groups"] == [[0, 1, 2, 3]]
    # rank 0 is the first of four stages in a ring (a virtual pipeline wraps): next stage rank 8,
    # previous rank 24
    assert program["pp_send_fwd"]["peers"] == [8] and program["pp_recv_fwd"]["peers"] == [24]
    assert doc["split_size_reads"] == 0 and doc["microbatches_played"] == 4


def test_llama3_70b_bridge_perf_layout_tp4_pp4_cp2_vpp5(tmp_path):
    """Bridge's Llama3-70B H100 BF16 perf recipe, its own layout (TP4 PP4 CP2 VPP5, no layout
    flags), one layer per virtual stage: the KV ring plays with the CP peer (rank 4: TP is
    fastest, CP next), and the peak is within the memory model's bounds."""
    args = ("-m", "llama", "-mr", "llama3_70b", "-g", "h100", "-c", "bf16", "-ng", "64")
    out, doc = _dry_run(tmp_path, *args, "model.num_layers=20")
    _check_common(out, doc)
    program = doc["program"]
    for kind in ("cp_kv", "cp_dkv"):
        assert program[kind]["peers"] == [4], (kind, program[kind])


def test_qwen3_235b_tp2_ep32_pp8_vpp4(tmp_path):
    out, doc = _report(tmp_path, *QWEN235)
    program = doc["program"]
    for kind in (
        "tp_ag",
        "tp_rs",
        "ep_dispatch",
        "ep_combine_bwd",
        "pp_send_fwd",
        "pp_recv_bwd",
        "dp_rs",
        "dp_ag",
    ):
        assert program[kind]["ops"] > 0, kind
    assert program["ep_dispatch"]["groups"] == [list(range(32))]
    # the depth played is said where it is used
    assert out is None or "model.num_layers=30" in out.stdout
    # rank 0's steady state: 16 of the step's 512 micro-batches (GBS 8192 over DP 16)
    assert doc["microbatches_played"] == 16


_GIB = 2**30


def _scaled_peak(tmp_path, layout: list[str], depths: tuple[int, int], full: int) -> float:
    """The peak of `layout` at depth `full`, from dry runs at two cut depths: the per-layer figure
    (peak difference over depth difference; parameters, their gradients and optimizer states and
    every layer's activations grow with the depth, nothing else does) scaled to the full depth."""
    peaks = []
    for depth in depths:
        args = tuple(a for a in layout if not a.startswith("model.num_layers="))
        _out, doc = _report(tmp_path, *args, f"model.num_layers={depth}")
        peaks.append(doc["peak_bytes"])
    per_layer = (peaks[1] - peaks[0]) / (depths[1] - depths[0])
    return peaks[0] + per_layer * (full - depths[0])


def test_qwen3_30b_ep16_fits_where_megatron_measured_62_gib(tmp_path):
    """The MoE guide's cluster (`-mr qwen3_30b_a3b -g h100 -c bf16 -ng 16 -gn 8 -ep 16`): Megatron
    measured a 62.2 GiB peak on 80 GB H100s; our rank's steady-state peak (Adam's moments included)
    must stay within 6% of it. 48 layers, scaled from 2 and 4."""
    peak = _scaled_peak(tmp_path, QWEN30, (2, 4), 48)
    assert peak <= 66 * _GIB, peak / _GIB


def test_qwen3_235b_fits_an_h100(tmp_path):
    """Bridge's Qwen3-235B-A22B H100 BF16 layout (TP2 PP8 VPP4 EP32, EP overlap and delayed weight
    gradients: its perf recipe's), which Megatron runs on 80 GB H100s: at most 72 GiB. Its 94
    layers and the embedding and loss make 3 slots per virtual stage; 30 and 62 layers make 1 and
    2, and rank 0's chunks hold 3, 7 and 11 layers."""
    peak = _scaled_peak(tmp_path, QWEN235, (30, 62), 94)
    assert peak <= 72 * _GIB, peak / _GIB


def test_a_device_mix_up_is_found_with_its_line(tmp_path):
    # The bug: rotary tables made on the CPU; the first forward multiplies them with device
    # activations.
    patch = """
        from overlap.layers.rotary import RotaryEmbedding
        built = RotaryEmbedding.__init__
        def on_cpu(self, *args, **kwargs):
            built(self, *args, **kwargs)
            self.cos, self.sin = self.cos.to("cpu"), self.sin.to("cpu")
        RotaryEmbedding.__init__ = on_cpu
    """
    out, doc = _dry_run(tmp_path, *QWEN30[:-1], "model.num_layers=1", code=patch)
    assert out.returncode == 1
    assert "Traceback" not in out.stderr
    error = out.stderr.strip().splitlines()[-1]
    assert error.startswith("overlap: error: dry run of rank 0: device mix-up"), error
    assert "overlap/layers/rotary.py:" in error and "(_rope_forward)" in error
    assert doc["finding"]["kind"] == "device mix-up" and doc["finding"]["site"].startswith(
        "overlap/layers/rotary.py"
    )


@pytest.mark.parametrize(
    "args,env,message",
    [
        (QWEN30, {"RANK": "0", "WORLD_SIZE": "16"}, "one process plays one rank"),
        (["-m", "qwen", "-mr", "dense_tiny", "-g", "cpu", "-ng", "2"], {}, "runs for real here"),
        ([*QWEN30, "checkpoint.save=/tmp/x"], {}, "a dry run has no weights"),
        (
            [*QWEN30, "--dry-run-microbatches", "65"],
            {},
            "64 micro-batch(es) per data-parallel rank",
        ),
    ],
)
def test_refusals_exit_2_before_anything_is_built(args, env, message, monkeypatch, capsys):
    from overlap.cli import main

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["run", *args, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_dry_run_flags_need_dry_run(capsys):
    from overlap.cli import main

    assert main(["run", *QWEN30, "--dry-run-rank", "3"]) == 2
    assert "--dry-run-rank=3: it shapes a dry run" in capsys.readouterr().err


@pytest.mark.parametrize(
    "tokens,topk,experts,ep", [(4096, 8, 128, 16), (7, 3, 8, 4), (1, 1, 4, 2), (10, 2, 6, 3)]
)
def test_balanced_routing_split_sizes(tokens, topk, experts, ep):
    routing = BalancedRouting(tokens, topk, experts, ep)
    el = experts // ep
    counts = {r: routing.alltoall_counts(r) for r in range(ep)}
    for r in range(ep):
        sent, received = counts[r][:experts], counts[r][experts:]
        assert sum(sent) == tokens * topk  # every routed pair goes somewhere
        assert max(sent) - min(sent) <= 1  # as even as integers allow
        for s in range(ep):  # what rank s sends to rank r's experts is what r expects from s
            assert received[s * el : (s + 1) * el] == counts[s][r * el : (r + 1) * el]
    per_rank = [sum(counts[r][experts:]) for r in range(ep)]
    assert max(per_rank) - min(per_rank) <= el  # the remainders rotate: no rank gets them all
    flex = routing.flex_counts(1)
    assert [row[1:] for row in flex[0]] == [counts[1][r * el : (r + 1) * el] for r in range(ep)]
    assert all(row[0] == min(tokens, sum(row[1:])) for row in flex[0] + flex[1])


def test_balanced_routing_respects_an_unpadded_capacity():
    routing = BalancedRouting(100, 4, 8, 2, capacity=40)
    # 50 pairs per expert, clamped as the routing would drop them
    assert max(routing.alltoall_counts(0)) == 40


def test_split_sizes_are_read_for_real_unless_a_dry_run_answers():
    # The sent counts, then the received ones (whatever their shape), flattened; the exchange is
    # waited for through the scheduler's wait in every case. (On CUDA a side stream copies them: not
    # run here, no GPU.)
    sent, received = torch.tensor([3, 1]), torch.tensor([[4, 1], [5, 9]])
    waited = []

    def wait(exchange: str) -> torch.Tensor:
        waited.append(exchange)
        return received

    host, got = split_sizes.read_split_sizes(sent, "exchange", wait, lambda: [0])
    assert host == [3, 1, 4, 1, 5, 9] and got is received and waited == ["exchange"]
    asked = []
    with split_sizes.balanced_routing(asked.append):
        host, got = split_sizes.read_split_sizes(sent, "exchange", wait, lambda: [2, 2, 2, 2])
        assert host == [2, 2, 2, 2] and got is received
    assert asked == [split_sizes.SPLIT_SIZE_READ] and len(waited) == 2
    assert split_sizes.read_split_sizes(sent, "exchange", wait, lambda: [0])[0] == [
        3,
        1,
        4,
        1,
        5,
        9,
    ]


def test_expert_counts_equal_bincount():
    gen = torch.Generator().manual_seed(0)
    for experts in (1, 5, 64):
        idx = torch.randint(0, experts, (37, 3), generator=gen)
        assert torch.equal(
            count_per_expert(idx, experts), torch.bincount(idx.reshape(-1), minlength=experts)
        )
