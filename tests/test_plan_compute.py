"""The planner's compute pieces (`overlap.plan.compute`): the per-kernel overhead as a floor under
each kernel's work and the CUDA graphs that remove it, selective recompute's backward, the
embedding, and the real per-stage layout. Most checks compare two plans of one configuration, or
price every kernel at the overhead, so the numbers are exact (1e-9)."""

import json

import pytest

from overlap.harness import resolve_run, start_up_quiet
from overlap.plan.compute import KernelCosts, microbatch_compute
from overlap.plan.hardware import builtin_cluster, load_cluster, with_efficiency

LLAMA = "-m llama -mr llama3_8b -g h100 -ng 8 -tp 1 -pp 1 -ep 1 -gb 128 -mb 1 -sl 8192 -c bf16"
QWEN = "-m qwen -mr qwen3_30b_a3b -g h100 -ng 16 -ep 16 -gb 1024 -mb 1 -sl 4096 -c bf16"


def plan_of(flags: str, tau: float = 0.0, efficiency: float = 0.5):
    with start_up_quiet():  # its start-up lines (the tests that read them see theirs)
        job = resolve_run(flags.split(), [])
    cluster = with_efficiency(builtin_cluster("h100", "bf16", 8), efficiency, "test", tau)
    return microbatch_compute(job.cfg, job.resolution.layout, cluster), job, cluster


def test_a_kernel_costs_its_work_or_its_launch_whichever_is_longer():
    tau = 10e-6
    _plan, _job, cluster = plan_of(LLAMA, tau)
    k = KernelCosts(cluster)
    # a short GEMM waits for its launch: it costs the overhead, not the overhead on top
    short = k.gemm(128, 128, 128)
    assert short / 0.5 < tau and k.launch_wait() == pytest.approx(tau - short / 0.5, rel=1e-12)
    # a grouped GEMM is one launch per group, each with its share of the work
    grouped = k.gemm(128, 128, 128, groups=4)
    assert k.launch_wait() == pytest.approx(4 * tau - grouped / 0.5, rel=1e-12)
    # a long one hides its launch
    long = k.gemm(8192, 8192, 8192)
    assert long / 0.5 > tau and k.launch_wait() == 0.0
    # glue kernels share their bytes equally
    glue = k.glue(1e6, kernels=2)
    assert k.launch_wait() == pytest.approx(2 * max(0.0, tau - glue / 2 / 0.5), rel=1e-12)


def test_every_launch_outside_a_graph_is_counted():
    # an overhead far above every kernel's work: each piece costs its launches x the overhead
    tau = 1.0
    with_tau, *_ = plan_of(LLAMA, tau)
    # Llama's attention: qkv, core, proj; the norm and the residual add; rotary (no QK norms)
    assert with_tau.attention_fwd_s == pytest.approx(6 * tau, rel=1e-9)
    # its dense MLP: fc1, fc2; norm + residual; the gated activation
    assert with_tau.dense_mlp_fwd_s == pytest.approx(5 * tau, rel=1e-9)
    # Qwen3-30B-A3B at EP16: 8 local experts, one GEMM each for fc1 and fc2; 16 expert GEMMs,
    # the activation, router GEMM + norm + 4 routing kernels, permute and un-permute, the
    # residual add
    moe, *_ = plan_of(QWEN, tau)
    assert moe.moe_fwd_s == pytest.approx((16 + 1 + 6 + 2 + 1) * tau, rel=1e-9)


def test_a_cuda_graph_scope_removes_its_pieces_launch_overhead():
    tau = 1.0  # every kernel launch-bound, as above
    graphs = " model.cuda_graph_impl=transformer_engine model.cuda_graph_scope="
    plain, *_ = plan_of(QWEN, tau)
    router, *_ = plan_of(QWEN + graphs + "[moe_router,moe_preprocess]", tau)
    attn, *_ = plan_of(QWEN + graphs + "[attn,moe_router,moe_preprocess]", tau)
    # the router's 6 launches and the permute: 7 fewer per MoE layer (their microseconds of work
    # remain); the attention untouched
    assert plain.moe_fwd_s - router.moe_fwd_s == pytest.approx(7 * tau, rel=1e-4)
    assert router.attention_fwd_s == pytest.approx(plain.attention_fwd_s, rel=1e-12)
    # Qwen3's attention adds QK norms: 7 launches; graphed, it costs its work alone
    none, *_ = plan_of(QWEN)
    assert plain.attention_fwd_s == pytest.approx(7 * tau, rel=1e-9)
    assert attn.attention_fwd_s == pytest.approx(none.attention_fwd_s, rel=1e-12)
    # a full-iteration graph leaves only the ideal times
    whole = " model.cuda_graph_impl=local model.cuda_graph_scope=[full_iteration]"
    full, *_ = plan_of(QWEN + whole, tau)
    assert full.fwd_bwd_s == pytest.approx(none.fwd_bwd_s, rel=1e-12)


def test_selective_recompute_adds_the_named_modules_forward_to_the_backward():
    sel = " model.recompute_granularity=selective model.recompute_modules="
    plain, job, cluster = plan_of(QWEN)
    core, *_ = plan_of(QWEN + sel + "[core_attn]")
    act, *_ = plan_of(QWEN + sel + "[moe_act]")
    assert plain.recompute_s == 0
    # core_attn: the attention core once more per layer (causal FLOPs at 0.75 of the BF16 peak)
    m = job.cfg.model
    q = m.num_attention_heads * m.head_dim
    core_s = KernelCosts(cluster).attention_core(2.0 * q * m.seq_length * m.seq_length) / 0.5
    assert core.recompute_s == pytest.approx(core_s * m.num_layers, rel=1e-9)
    assert core.bwd_s - plain.bwd_s == pytest.approx(core.recompute_s, rel=1e-9)
    # moe_act: the routed experts' gated activation (reads 2 F, writes F per routed row), in BF16
    rows = m.seq_length * m.moe_router_topk
    act_s = 2.0 * rows * 3 * m.moe_ffn_size / cluster.hbm_Bps / 0.5
    assert act.recompute_s == pytest.approx(act_s * m.num_layers, rel=1e-9)
    assert act.fwd_s == pytest.approx(plain.fwd_s, rel=1e-12)


def test_the_stages_are_the_layouts_and_the_embedding_is_priced():
    flags = (
        "-m qwen -mr qwen3_235b_a22b -g h100 -ng 256 -tp 2 -pp 8 -vp 4 -ep 32 -gb 8192 -mb 1 -sl "
        "4096 -c bf16"
    )
    c, *_ = plan_of(flags)
    # 94 layers over 8 ranks: the average rank's 11.75, not 12 (the stage weights carry the rest)
    assert c.moe_layers == pytest.approx(94 / 8) and c.dense_layers == 0
    assert len(c.stage_weights) == 32 and sum(c.stage_weights) == pytest.approx(32)
    assert c.embedding_bwd_s > 0
    # the first stage (embedding + 2 layers) costs more than 2 layers' worth
    middle = c.stage_weights[1] / 3
    assert c.stage_weights[0] > 2 * middle


def test_a_cluster_file_can_set_the_overhead_and_keeps_it_otherwise(tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"gpu": "h100", "compute_efficiency": 0.5}))
    built_in = builtin_cluster("h100", "bf16", 8).efficiency.kernel_overhead_s
    assert built_in > 0
    kept = load_cluster(str(path), "h100", "bf16", None)
    assert kept.efficiency.kernel_overhead_s == built_in and kept.expected_error is None
    path.write_text(json.dumps({"gpu": "h100", "kernel_overhead_us": 5}))
    own = load_cluster(str(path), "h100", "bf16", None)
    assert own.efficiency.kernel_overhead_s == pytest.approx(5e-6)
    assert own.efficiency.value == builtin_cluster("h100", "bf16", 8).efficiency.value
    assert own.expected_error is None
    assert own.to_json()["kernel_overhead_us"] == pytest.approx(5)


def test_the_expert_capacity_pads_or_drops_the_rows_the_experts_compute_and_the_dispatch_sends():
    """`moe_expert_capacity_factor`: padded, every expert computes and receives its whole capacity
    (factor 2: twice the balanced rows); unpadded, the rows past the capacity are dropped (factor
    0.5: half); factor 1 padded is the balanced routing's rows. The memory, compute and
    communication models read the same rows (`launch.activations.capacity_rows_per_token`)."""
    from overlap.plan.comm_model import comm_plan

    off = "comm_overlap.overlap_moe_expert_parallel_comm=false"
    off += " model.moe_token_dispatcher_type=alltoall"
    padded = " model.moe_pad_expert_input_to_capacity=true"
    cases = {
        "none": "",
        "padded 1": " model.moe_expert_capacity_factor=1.0" + padded,
        "padded 2": " model.moe_expert_capacity_factor=2.0" + padded,
        "dropped 0.5": " model.moe_expert_capacity_factor=0.5",
    }
    got = {}
    for name, extra in cases.items():
        plan, job, cluster = plan_of(f"{QWEN} {off}{extra}")
        sent = comm_plan(job.cfg, job.resolution.layout, cluster).kinds["ep_dispatch"].bytes_each
        got[name] = (plan.moe_fwd_s, sent)
    assert got["padded 1"] == pytest.approx(got["none"], rel=1e-9)
    assert got["padded 2"][1] == pytest.approx(2 * got["none"][1], rel=1e-9)
    assert got["dropped 0.5"][1] == pytest.approx(0.5 * got["none"][1], rel=1e-9)
    # the experts' GEMMs and elementwise kernels grow and shrink with their rows (the router,
    # the permutation and the norms do not)
    assert got["dropped 0.5"][0] < got["none"][0] < got["padded 2"][0]
