"""Two pipeline features on real worlds: `deallocate_pipeline_outputs` (a sent activation's storage
is released once its send completed) and `defer_embedding_wgrad_compute` + `wgrad_deferral_limit`
(the output layer's weight-gradient GEMMs run at the pipeline flush).

Tolerances:
- deallocation on vs off: bit-identical losses and gradient buffers (the same operations in the same
  order; only the storage of sent outputs goes, and their backward enters the autograd engine
  directly);
- deferred output-layer wgrads without a cap: bit-identical (the same GEMMs, accumulated into the
  gradient buffer in the same micro-batch order, only later);
- with `wgrad_deferral_limit` capping it, the first `limit` micro-batches' output-layer gradients
  are accumulated after the later ones': the first step's gradient buffers (same weights) within
  1e-6 x the buffer's largest element, losses rel 1e-6.

Memory is measured by the executor on the output storages themselves (`Trainer.pipeline_memory`, see
`overlap.pipeline.output_memory.PipelineMemory`): bytes of stage outputs alive, peak per step.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from overlap.config import ConfigContainer
from overlap.parallel.state import ParallelState
from overlap.parallel.trace import recorder
from overlap.training.runtime_refusals import runtime_refusals
from overlap.training.trainer import Trainer
from tests.configs import TINY, tiny_config
from tests.world import run_world

STEPS = 2
SEQ, HIDDEN = TINY["seq_length"], TINY["hidden_size"]
OUTPUT_BYTES = SEQ * 1 * HIDDEN * 4  # one stage output: [seq, micro-batch 1, hidden] fp32
BATCHED = ("comm_overlap.batch_p2p_comm=true", "comm_overlap.overlap_p2p_comm=false")
OVERLAPPED = ("comm_overlap.batch_p2p_comm=false", "comm_overlap.overlap_p2p_comm=true")
DEALLOCATE = ("model.deallocate_pipeline_outputs=true",)
DEFER = ("comm_overlap.defer_embedding_wgrad_compute=true",)
PP2 = (("pipeline_model_parallel_size", 2),)
PP2_VPP2 = PP2 + (("virtual_pipeline_model_parallel_size", 2),)


def _config(overrides: tuple[str, ...], layout: tuple, moe: bool = False) -> ConfigContainer:
    fields = dict(layout)  # (field, value) pairs: hashable, so runs are cached by their arguments
    return tiny_config(moe, "fp32", fields.pop("num_layers", 4), list(overrides), STEPS, **fields)


def _train(overrides: tuple[str, ...], layout: tuple, moe: bool = False) -> dict:
    """Per step: loss, a copy of every gradient buffer (after the reduction), the deferred
    output-wgrad spans and the bucket collectives of this rank; and the peak live output bytes of
    each step."""
    cfg = _config(overrides, layout, moe)
    res = cfg.finalize(dist.get_world_size())
    trainer = Trainer(cfg, ParallelState(res.layout))
    steps = []
    recorder().drain()
    for it in range(STEPS):
        loss, _norm = trainer.train_step(it)
        events, spans = recorder().drain()
        steps.append(
            dict(
                loss=loss,
                grads=[b.grad_data.clone() for ddp in trainer.ddps for b in ddp.buffers],
                deferred=[s.t_start for s in spans if s.name == "bwd.deferred_output_wgrad"],
                buckets=[e.t_launch for e in events if e.kind in ("dp_ar", "dp_rs")],
                grad_reduce=[s.t_start for s in spans if s.name == "grad_reduce"][0],
            )
        )
    return dict(steps=steps, peaks=trainer.pipeline_memory.step_peaks, pp_rank=trainer.ps.pp_rank)


@functools.cache
def _run(world: int, overrides: tuple[str, ...], layout: tuple, moe: bool = False) -> list[dict]:
    return run_world(world, _train, overrides, layout, moe)


def _assert_identical(a: list[dict], b: list[dict]) -> None:
    for rank_a, rank_b in zip(a, b):
        for step_a, step_b in zip(rank_a["steps"], rank_b["steps"]):
            assert step_a["loss"] == step_b["loss"]
            assert len(step_a["grads"]) == len(step_b["grads"])
            assert all(torch.equal(x, y) for x, y in zip(step_a["grads"], step_b["grads"]))


# --- deallocate_pipeline_outputs ------------------------------------------------------------------
MEMORY_ON_GLOO = pytest.mark.gloo_only(
    reason="the bytes a sent output holds: under NCCL's rules gloo's send keeps its alias to the "
    "step's end, where on CUDA the allocator frees it at once"
)


@pytest.mark.parametrize("p2p", [BATCHED, OVERLAPPED], ids=["batched", "overlapped"])
@pytest.mark.parametrize("layout", [PP2, PP2_VPP2], ids=["pp2", "pp2_vpp2"])
@MEMORY_ON_GLOO
def test_deallocation_gives_identical_losses_and_holds_fewer_output_bytes(layout, p2p):
    off = _run(2, p2p, layout)
    on = _run(2, p2p + DEALLOCATE, layout)
    _assert_identical(off, on)
    for rank_off, rank_on in zip(off, on):
        # PP2 without VPP: the last stage sends no activations
        if all(p == 0 for p in rank_off["peaks"]):
            assert (
                layout == PP2 and rank_off["pp_rank"] == 1 and all(p == 0 for p in rank_on["peaks"])
            )
            continue
        assert len(rank_on["peaks"]) == STEPS
        for peak_off, peak_on in zip(rank_off["peaks"], rank_on["peaks"]):
            assert 0 < peak_on < peak_off
        if layout == PP2 and p2p == BATCHED:
            # one sender, no cycle: each output's send is waited as soon as it is posted, and the
            # output freed before the next one exists (the 1F1B warm-up alone keeps two outputs for
            # backward without it)
            assert rank_on["peaks"] == [OUTPUT_BYTES] * STEPS
        elif layout == PP2:
            # overlapped: a wait would hold the compute for the transfer, so each send is dropped
            # once the consumer is heard from (output_memory's causal rule): the warm-up's output
            # and the steady step's are in flight at once
            assert rank_on["peaks"] == [2 * OUTPUT_BYTES] * STEPS


@MEMORY_ON_GLOO
def test_deallocation_with_moe_aux_losses_is_identical():
    """A chunk's MoE aux loss is a second backward seed next to the released output."""
    off = _run(2, BATCHED, PP2, True)
    on = _run(2, BATCHED + DEALLOCATE, PP2, True)
    _assert_identical(off, on)
    assert on[0]["peaks"] == [OUTPUT_BYTES] * STEPS


PP4 = (("pipeline_model_parallel_size", 4),)
PP4_VPP2 = PP4 + (("virtual_pipeline_model_parallel_size", 2), ("num_layers", 8))


@pytest.mark.parametrize(
    "layout, p2p",
    [(PP4, BATCHED), (PP4, OVERLAPPED), (PP4_VPP2, OVERLAPPED)],
    ids=["pp4", "pp4_overlapped", "pp4_vpp2"],
)
@MEMORY_ON_GLOO
def test_deeper_pipelines_with_both_features_are_identical(layout, p2p):
    """PP4: the waits that release outputs follow a chain (without VPP) or a ring (with it) and must
    not deadlock."""
    off = _run(4, p2p, layout)
    on = _run(4, p2p + DEALLOCATE + DEFER, layout)
    _assert_identical(off, on)
    for rank_off, rank_on in zip(off, on):
        if rank_on["pp_rank"] < 3 or layout == PP4_VPP2:
            assert all(0 < a < b for a, b in zip(rank_on["peaks"], rank_off["peaks"]))
        assert all(
            len(s["deferred"]) == (8 if rank_on["pp_rank"] == 3 else 0) for s in rank_on["steps"]
        )


# --- defer_embedding_wgrad_compute ----------------------------------------------------------------
@pytest.mark.parametrize("layout", [PP2, PP2_VPP2], ids=["pp2", "pp2_vpp2"])
def test_deferred_output_wgrad_is_identical_and_runs_at_the_flush(layout):
    base = _run(2, (), layout)
    deferred = _run(2, DEFER, layout)
    _assert_identical(base, deferred)
    for rank in deferred:
        last_stage = rank["pp_rank"] == 1
        for step in rank["steps"]:
            # every micro-batch's GEMM, on the last stage
            assert len(step["deferred"]) == (8 if last_stage else 0)
    for rank in base:
        assert all(not step["deferred"] for step in rank["steps"])


def test_wgrad_deferral_limit_caps_the_deferred_micro_batches():
    base = _run(2, (), PP2)
    capped = _run(2, DEFER + ("comm_overlap.wgrad_deferral_limit=2",), PP2)
    # 0, like -1: no limit
    unlimited = _run(2, DEFER + ("comm_overlap.wgrad_deferral_limit=0",), PP2)
    _assert_identical(base, unlimited)
    for rank_base, rank_capped in zip(base, capped):
        expected = 2 if rank_capped["pp_rank"] == 1 else 0
        assert [len(s["deferred"]) for s in rank_capped["steps"]] == [expected] * STEPS
        assert [s["loss"] for s in rank_capped["steps"]] == pytest.approx(
            [s["loss"] for s in rank_base["steps"]], rel=1e-6
        )
        for x, y in zip(rank_base["steps"][0]["grads"], rank_capped["steps"][0]["grads"]):
            assert (x - y).abs().max() <= 1e-6 * x.abs().max()


DP_OVERLAP = ("ddp.overlap_grad_reduce=true", "ddp.bucket_size=20000")


def test_deferred_output_wgrad_with_overlap_grad_reduce_reduces_after_the_deferred_gemms():
    """DP2 x PP2: the output layer's bucket may only be reduced once every deferred GEMM has added
    its gradient."""
    base = _run(4, DP_OVERLAP, PP2)
    deferred = _run(4, DP_OVERLAP + DEFER, PP2)
    capped = _run(4, DP_OVERLAP + DEFER + ("comm_overlap.wgrad_deferral_limit=1",), PP2)
    _assert_identical(base, deferred)
    for rank_base, rank_def, rank_cap in zip(base, deferred, capped):
        if rank_def["pp_rank"] == 0:
            continue
        for step_base, step_def, step_cap in zip(
            rank_base["steps"], rank_def["steps"], rank_cap["steps"]
        ):
            # 4 micro-batches per rank
            assert len(step_def["deferred"]) == 4 and len(step_cap["deferred"]) == 1
            assert step_def["buckets"] and step_cap["buckets"]
            # without deferral the buckets go out during the last backward, before the trainer's
            # grad sync ...
            assert max(step_base["buckets"]) < step_base["grad_reduce"]
            # ... with it, none before the last deferred GEMM, and still launched by the grad-ready
            # hook at the flush
            assert min(step_def["buckets"]) > max(step_def["deferred"])
            assert max(step_def["buckets"]) < step_def["grad_reduce"]
            # capped: the step's last gradient came before the flush, so the buckets wait for the
            # grad sync
            assert min(step_cap["buckets"]) > max(step_cap["deferred"])
            assert min(step_cap["buckets"]) >= step_cap["grad_reduce"]
        assert [s["loss"] for s in rank_cap["steps"]] == pytest.approx(
            [s["loss"] for s in rank_base["steps"]], rel=1e-6
        )
        for x, y in zip(rank_base["steps"][0]["grads"], rank_cap["steps"][0]["grads"]):
            assert (x - y).abs().max() <= 1e-6 * x.abs().max()


# --- no longer refused ----------------------------------------------------------------------------
def _refused_fields(overrides: tuple[str, ...]) -> set[str]:
    cfg = _config(overrides, PP2)
    cfg.finalize(2)
    return {error.field for error in runtime_refusals(cfg)}


def test_the_two_switches_run_with_our_schedule_and_are_refused_for_the_peer():
    both = DEALLOCATE + DEFER + ("comm_overlap.wgrad_deferral_limit=3",)
    names = {"model.deallocate_pipeline_outputs", "model.defer_embedding_wgrad_compute"}
    assert not _refused_fields(both) & names
    assert _refused_fields(both + ("model.pipeline_impl=torch_pipelining",)) >= names


@pytest.mark.parametrize("kind", ["linear", "grouped"])
def test_a_queued_weight_gradient_keeps_its_input_not_the_graph_behind_it(kind):
    """A weight-gradient GEMM waiting in the store (deferred to the flush, or delayed under EP
    overlap) holds its input detached: the tensors its autograd graph leads back to (here a leaf
    standing in for the pipeline's received activation, and that leaf's gradient) are freed when
    the backward ends, not at the flush; the gradient the flush delivers is the one computed at
    once (bit-identical)."""
    import gc
    import weakref

    from overlap.layers.linear_functions import GroupedLinear, linear
    from overlap.layers.wgrad_store import WeightGradStore

    shape = (2, 6, 4) if kind == "grouped" else (8, 4)
    grads = []
    for delayed in (False, True):
        weight = torch.nn.Parameter(torch.randn(*shape, generator=torch.Generator().manual_seed(0)))
        store = WeightGradStore()
        received = torch.randn(6, 4, generator=torch.Generator().manual_seed(1)).requires_grad_()
        x = received * 2 + received  # the layers between the received activation and the GEMM
        if kind == "grouped":
            out = GroupedLinear.apply(x, weight, [2, 4], None, store)
        else:
            out = linear(x, weight, store=store)
        alive = weakref.ref(received)
        with store.delaying(delayed):
            out.square().sum().backward()
        del received, x, out
        gc.collect()
        assert alive() is None  # freed with the backward, whether or not its GEMM waits
        assert (weight.grad is None) == delayed and len(store.queue) == int(delayed)
        store.flush()
        grads.append(weight.grad)
    assert torch.equal(grads[0], grads[1])
