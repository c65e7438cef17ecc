"""The memory model (`overlap.perf.memory_model`) against what it models.

- The guide commands' other variants (the MoE guide's command with EP overlap, its fallback with
  the loop permutation, Llama3-8B's perf layout) dry-run within 10% of the model's estimate for the
  same rank and micro-batches (tests/test_dry_run.py holds the three layouts of the guides).
- The dry run's accounting on fake tensors equals the same accounting over a real CPU step of the
  tiny MoE model (one rank, every expert local: the routing's row total does not depend on it), with
  the CPU's own kernel choices on both sides.
- `fit` and `overlap explain`: a rank that does not fit says by how much and what would make it fit,
  each alternative priced by the same model.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from overlap.cli import main
from overlap.harness import resolve_run
from overlap.perf import dry_run
from overlap.perf.memory_model import GPU_MEMORY_BYTES, fit, rank_memory
from tests.configs import tiny_config
from tests.world import run_world

GUIDE_MOE = [
    "-m", "qwen", "-mr", "qwen3_30b_a3b", "--task", "pretrain", "-g", "h100", "-c", "bf16",
    "-ng", "16", "-gn", "8", "--max_steps", "8", "--cuda_graph_impl", "none",
    "--moe_flex_dispatcher_backend", "None", "--moe_a2a_overlap", "false",
    "--tokenizer_type", "NullTokenizer", "comm_overlap.overlap_moe_expert_parallel_comm=true",
    "comm_overlap.delay_wgrad_compute=false", "model.moe_shared_expert_overlap=false",
]  # fmt: skip
VARIANTS = {
    "MoE guide, EP overlap": [*GUIDE_MOE, "model.num_layers=2"],
    "MoE guide, loop permutation": [
        *GUIDE_MOE, "model.moe_permute_fusion=false", "model.num_layers=2"
    ],
    "Llama3-8B perf layout": ["-m", "llama", "-mr", "llama3_8b", "-g", "h100", "-ng", "8",
                              "model.num_layers=2"],
    # Bridge's Llama3-70B H100 BF16 perf layout (TP4 PP4 CP2 VPP5), one layer per virtual stage
    # the output layer's weight gradients deferred to the flush, the first 4 of 32 micro-batches':
    # their inputs and logits' gradients stay alive (about 1 GiB each), so the dry run plays 4
    "Llama3-8B perf layout, 4 output wgrads deferred": [
        "-m", "llama", "-mr", "llama3_8b", "-g", "h100", "-ng", "8", "model.num_layers=2",
        "comm_overlap.defer_embedding_wgrad_compute=true", "comm_overlap.wgrad_deferral_limit=4"],
    "Llama3-70B perf layout, CP2 ring": [
        "-m", "llama", "-mr", "llama3_70b", "-g", "h100", "-c", "bf16", "-ng", "64", "-tp", "4",
        "-pp", "4", "-cp", "2", "-vp", "5", "model.num_layers=20"],
}  # fmt: skip


def _dry(tmp_path, args: list[str]) -> dict:
    report = tmp_path / "dry.json"
    argv = ["run", *args, "--dry-run", "--dry-run-json", str(report)]
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import sys\nfrom overlap.cli import main\nsys.exit(main({argv!r}))",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(report.read_text())


@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_guide_variant_dry_runs_within_10pct_of_the_model(tmp_path, name):
    doc = _dry(tmp_path, VARIANTS[name])
    assert 1 / 1.1 <= doc["estimate"]["total_bytes"] / doc["peak_bytes"] <= 1.1, (
        doc["peak_bytes"] / 2**30,
        doc["estimate"]["total_bytes"] / 2**30,
    )
    if "loop" in name:  # the fallback plays: its selections answered, each a host sync on a GPU
        assert doc["loop_permutation_reads"] == 2 * 2 * 128  # layers x micro-batches x experts
    if "deferred" in name:  # as many as are deferred: each adds to the peak
        assert doc["microbatches_played"] == 4


# --- the accounting, fake against real ------------------------------------------------------------
def _tiny():
    return tiny_config(
        True,
        "bf16_mixed",
        2,
        ["model.moe_permute_fusion=true", "model.attention_backend=flash"],
        1,
        global_batch_size=2,
        micro_batch_size=1,
    )


class _RealWatch(dry_run._StepWatch):
    """The dry run's accounting over real CPU tensors: every storage an op makes counted until it
    is freed (the watch's own `_track`), without its host-value and read handling."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self._track(t.untyped_storage(), func)
        return out


def _real_peak() -> tuple[int, int, int]:
    """(start, peak) bytes of one real step of the tiny MoE on this one-rank world, Adam's moments
    made first as the dry run makes them, and the optimizer's slot count."""
    from overlap.parallel.state import ParallelState
    from overlap.training.trainer import Trainer

    cfg = _tiny()
    ps = ParallelState(cfg.finalize(dist.get_world_size()).layout)
    watch = _RealWatch(torch.device("cpu"))
    with watch:
        trainer = Trainer(cfg, ps)
        trainer.optimizer.create_states()
        start = watch.current
        watch.reset_peak()
        trainer.train_step(0)
        trainer.finish_param_sync()
    return start, watch.peak, len(trainer.optimizer.adam.slots)


def test_the_dry_runs_accounting_equals_the_same_accounting_over_real_tensors(monkeypatch):
    """The dry run played with CPU fakes (the same code paths as a real CPU rank) against a real
    step: the same live bytes at the step's start and the same peak, but for Adam's step counters
    (the foreach path keeps one CPU scalar per slot: a host value the dry run computes for real and,
    rightly, does not count as device memory)."""
    real_start, real_peak, slots = run_world(1, _real_peak)[0]
    monkeypatch.setattr(dry_run, "fake_device", lambda: torch.device("cpu"))
    cfg = _tiny()
    cfg.finalize(1)
    job = type("Job", (), {})()
    job.cfg, job.resolution, job.args = cfg, cfg.resolved, None
    monkeypatch.setattr(dry_run, "describe_layout", lambda res: "")
    report = dry_run.run_dry(job, dry_run.DryRunOptions(microbatches=2))
    assert report.ok, report.finding
    counters = 4 * slots  # fp32 scalars
    assert (report.start_bytes, report.peak_bytes) == (real_start - counters, real_peak - counters)


# --- fit -----------------------------------------------------------------------------------------
def test_a_rank_that_does_not_fit_says_by_how_much_and_what_would_fit():
    """Qwen3-30B-A3B at EP 4 on 4 H100s: every rank holds 32 experts (their fp32 state is not
    sharded: expert-DP 1), far past 80 GB; the advice prices recompute and the layout changes."""
    job = resolve_run(["-m", "qwen", "-mr", "qwen3_30b_a3b", "-g", "h100", "-ng", "4"], [])
    verdict = fit(job.cfg, job.resolution.layout, "h100")
    assert not verdict.fits and verdict.margin_bytes < 0
    assert verdict.device_bytes == GPU_MEMORY_BYTES["h100"]
    text = verdict.describe()
    assert "does NOT fit" in text and "short by" in text
    assert any(a.startswith("model.recompute_granularity=selective") for a in verdict.advice)
    assert any("expert-parallel group (-ep)" in a for a in verdict.advice)
    # each priced alternative is below the peak
    for line in verdict.advice:
        if "saves" in line:
            assert "(saves" in line


def test_the_advice_prices_the_distributed_optimizer_only_where_it_is_off():
    """The alternative reads the resolved switch (either spelling turns it on): off, it is priced
    below the peak; on under the optimizer's spelling alone, it is not offered."""
    words = ["-m", "qwen", "-mr", "qwen3_30b_a3b", "-g", "h100", "-ng", "4"]
    off = ["ddp.use_distributed_optimizer=false", "optimizer.use_distributed_optimizer=false"]
    job = resolve_run(words, off)
    advice = fit(job.cfg, job.resolution.layout, "h100").advice
    assert any(
        a.startswith("ddp.use_distributed_optimizer=true: ") and "(saves" in a for a in advice
    )
    job = resolve_run(words, off[:1] + ["optimizer.use_distributed_optimizer=true"])
    assert job.resolution.overlap.use_distributed_optimizer
    advice = fit(job.cfg, job.resolution.layout, "h100").advice
    assert not any(a.startswith("ddp.use_distributed_optimizer") for a in advice)


def test_the_advice_prices_the_deeper_warm_up_where_it_is_on():
    """comm_overlap.p2p_warmup_depth=2 buys overlapped 1F1B's slack with micro-batches alive: on a
    rank that does not fit, going back to depth 1 is priced below the peak; at depth 1 it is not
    offered."""
    words = ["-m", "qwen", "-mr", "qwen3_30b_a3b", "-g", "h100", "-ng", "8", "-pp", "4"]
    overlapped = ["comm_overlap.overlap_p2p_comm=true", "comm_overlap.batch_p2p_comm=false"]
    job = resolve_run(words + ["-ep", "2"], [*overlapped, "comm_overlap.p2p_warmup_depth=2"])
    verdict = fit(job.cfg, job.resolution.layout, "h100")
    assert not verdict.fits
    assert any(
        a.startswith("comm_overlap.p2p_warmup_depth=1: ") and "(saves" in a for a in verdict.advice
    )
    job = resolve_run(words + ["-ep", "2"], overlapped)
    advice = fit(job.cfg, job.resolution.layout, "h100").advice
    assert not any(a.startswith("comm_overlap.p2p_warmup_depth") for a in advice)


def test_the_guide_cluster_fits_with_its_reserve(capsys):
    job = resolve_run(GUIDE_MOE, [])
    est = rank_memory(job.cfg, job.resolution.layout)
    verdict = fit(job.cfg, job.resolution.layout, "h100", est)
    assert verdict.fits and est.total <= 66 * 2**30
    assert main(["explain", *GUIDE_MOE]) == 0
    out = capsys.readouterr().out
    assert "Memory at the peak of the rank that needs the most" in out
    assert "Adam moments" in out and "fit:" in out and "fits," in out
    for block in ("norms", "attention", "router", "dispatch", "experts", "combine"):
        assert f"    {block} " in out


def _walk_peak(chunks, pp, rank, vpp, count, group, merged, late, depth) -> tuple[float, int]:
    from overlap.launch import resources
    from overlap.pipeline.schedules import pipeline_steps

    program = [
        (
            None if s.forward is None else s.forward.chunk,
            None if s.backward is None else s.backward.chunk,
        )
        for s in pipeline_steps(pp, rank, vpp, count, group, merged, depth)
    ]
    kept, working, alive, _where = resources._walk(chunks, program, merged, late)
    return kept + working, alive


def test_the_memory_walk_of_a_long_program_peaks_as_its_short_form():
    """`steady_microbatches`: a program's walk peaks, in bytes and in forwards alive, exactly as
    the full program's (the memory model walks the short one)."""
    import dataclasses
    import itertools

    from overlap.launch import resources
    from overlap.perf.memory_model import steady_microbatches

    names = [f.name for f in dataclasses.fields(resources._Chunk)]
    for pp, vpp, extra, merged, late, depth in itertools.product(
        (2, 3, 4, 8), (1, 2, 3), (None, 2), (False, True), (False, True), (1, 2, 3)
    ):
        if late and (merged or vpp > 1) or depth > 1 and (vpp > 1 or merged):
            continue
        group = None if extra is None else pp + extra
        # (no deferred output-layer weight gradients: under them the whole step is walked)
        chunks = [
            resources._Chunk(
                **{
                    n: 1.0 + 0.1 * c if n == "saved" else 0.0 if n == "deferred" else 0.5 + 0.01 * c
                    for n in names
                }
            )
            for c in range(vpp)
        ]
        for m in (2 * pp * vpp + 5, 64, 131):
            for rank in range(pp):
                args = (chunks, pp, rank, vpp)
                full = _walk_peak(*args, m, group, merged, late, depth)
                short = _walk_peak(
                    *args, steady_microbatches(pp, vpp, group, m, depth), group, merged, late, depth
                )
                assert short[0] == pytest.approx(full[0]) and short[1] == full[1]


@pytest.mark.parametrize("pp", [1, 2])
def test_deferred_output_wgrads_stay_alive_until_the_flush(pp):
    """defer_embedding_wgrad_compute: each deferred micro-batch's output-layer input and logits'
    gradient wait for the flush on the rank holding the output layer, so its peak grows by that
    much per deferred micro-batch - all of the step's, or the first `wgrad_deferral_limit` - over
    the whole step (not the short program the walk takes otherwise); the other ranks are as
    before."""
    est = {}
    for name, extra in (
        ("off", []),
        ("all", ["comm_overlap.defer_embedding_wgrad_compute=true"]),
        (
            "limit 3",
            [
                "comm_overlap.defer_embedding_wgrad_compute=true",
                "comm_overlap.wgrad_deferral_limit=3",
            ],
        ),
    ):
        cfg = tiny_config(
            False,
            "bf16_mixed",
            2,
            extra,
            1,
            global_batch_size=16,
            micro_batch_size=1,
            pipeline_model_parallel_size=pp,
        )
        res = cfg.finalize(pp)
        est[name] = [rank_memory(cfg, res.layout, cpu=True, pp_rank=r) for r in range(pp)]
    m = res.model
    each = m.seq_length * 2 * (m.hidden_size + m.vocab_size)  # bf16, one micro-batch's tokens
    last = pp - 1
    grown = {k: est[k][last].activation_bytes - est["off"][last].activation_bytes for k in est}
    # 16 micro-batches deferred (the step's), or 3; a backward's own activations may still be alive
    assert 15 * each <= grown["all"] <= 16 * each
    assert 2 * each <= grown["limit 3"] <= 3 * each
    for r in range(last):
        assert est["all"][r].total == est["off"][r].total


def test_a_deeper_warm_up_keeps_its_extra_micro_batches_alive():
    """comm_overlap.p2p_warmup_depth=2 under overlapped 1F1B: pipeline rank r keeps PP - rank - 1
    more micro-batches' activations (rank 0 of PP 4: 7 forwards alive instead of 4), and the
    estimate counts them: the activations grow by that ratio, the rest of the rank does not."""
    overlapped = ["comm_overlap.overlap_p2p_comm=true", "comm_overlap.batch_p2p_comm=false"]
    est = {}
    for depth in (1, 2):
        cfg = tiny_config(
            False,
            "bf16_mixed",
            4,
            [*overlapped, f"comm_overlap.p2p_warmup_depth={depth}"],
            1,
            global_batch_size=16,
            micro_batch_size=1,
            pipeline_model_parallel_size=4,
        )
        res = cfg.finalize(4)
        est[depth] = {r: rank_memory(cfg, res.layout, cpu=True, pp_rank=r) for r in range(4)}
    for r in range(4):
        assert est[1][r].in_flight == 4 - r
        assert est[2][r].in_flight == 2 * (4 - r - 1) + 1
        assert est[2][r].param_bytes == est[1][r].param_bytes
    assert est[2][0].activation_bytes > 1.5 * est[1][0].activation_bytes


@pytest.mark.parametrize("precision, kept", [("fp8", 1.0), ("mxfp8", 1.0 + 1 / 32)])
def test_fp8_plans_keep_fp8_copies_of_the_linears_inputs(precision, kept):
    """The planner's FP8 precisions (its GEMMs; the configuration stays BF16): Transformer Engine
    keeps the FP8 copy of each linear's input for the weight gradient (a byte an element, and an
    MXFP8 scale byte per 32). Where the linear was the BF16 tensor's only keeper (the QKV and fc1
    inputs, the experts' dispatched rows, every fc2 input) the copy replaces it; where another
    kernel keeps the BF16 tensor too (the attention output, which the output projection reads) it
    comes on top. `overlap explain` and the dry run (no plan precision) price the run's own BF16.
    MoE (Qwen3-30B-A3B at EP16) and dense (Llama3-8B at TP2 with sequence parallelism)."""
    from overlap.launch.activations import ATTENTION, EXPERTS, MLP

    for args, blocks in (
        (["-m", "qwen", "-mr", "qwen3_30b_a3b", "-ng", "16", "-ep", "16"], (ATTENTION, EXPERTS)),
        (["-m", "llama", "-mr", "llama3_8b", "-ng", "8", "-tp", "2"], (ATTENTION, MLP)),
    ):
        job = resolve_run([*args, "-g", "h100"], [])
        cfg, layout = job.cfg, job.resolution.layout
        m, t = cfg.resolved.model, layout.tp
        sp = t if layout.sequence_parallel else 1
        bf16, fp8 = (
            {b.name: b.ours for b in rank_memory(cfg, layout, gemm_precision=p).blocks}
            for p in (None, precision)
        )
        h, a_d = m.hidden_size, m.num_attention_heads // t * m.head_dim
        saved = 2 - kept  # a BF16 input replaced by its FP8 copy
        assert bf16[ATTENTION] - fp8[ATTENTION] == pytest.approx(saved * h / sp - kept * a_d)
        if EXPERTS in blocks:
            rows = m.moe_router_topk * (h + m.moe_ffn_size)
            assert bf16[EXPERTS] - fp8[EXPERTS] == pytest.approx(saved * rows)
        else:
            assert bf16[MLP] - fp8[MLP] == pytest.approx(saved * (h / sp + m.ffn_size / t))
        total = rank_memory(cfg, layout).total
        assert rank_memory(cfg, layout, gemm_precision="bf16").total == total
        assert rank_memory(cfg, layout, gemm_precision=precision).total < total
