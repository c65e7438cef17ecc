"""Host-sync budget: one training step of the tiny MoE, with every op that would make the host wait
for a GPU recorded by name (`overlap.perf.host_syncs`), holds exactly the reads the step needs.

- the all-to-all path: one split-size read per MoE layer per micro-batch (`read_split_sizes`, the
  host split sizes NCCL's all-to-all takes);
- the padded static-shape path (`moe_expert_capacity_factor` + `moe_pad_expert_input_to_capacity`):
  none;
- the sync-free dropless path (`moe_expert_rank_capacity_factor`): none, its overflow count carried
  by the loss and grad-norm reductions into the grad-norm read (a step without overflow: no re-run,
  so exactly the two per-step reads);
- per step: the logged loss and the gradient norm (`host_syncs.INTENDED_READS`), once each, and
  torch's AdamW reading each parameter's step count, a CPU tensor on a GPU run too (no device sync:
  named to the recorder, not counted);
- nothing else. A new `.item()`, `.tolist()`, `nonzero`, boolean mask, `torch.tensor(list)` or
  `bincount` in the step fails here, named by its line.

EP overlap (the merged combined-1F1B step) and delay_wgrad are on at EP 2, with the all-to-all and
the flex dispatcher. The step runs the permutation a CUDA run takes (the fused one); the loop, the
CPU's reference, syncs per expert on a GPU, which the last test shows the recorder finds.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from overlap.kernels.moe_permute import LOOP_ON_CUDA, permute_fused
from overlap.parallel.state import ParallelState
from overlap.perf.host_syncs import (
    HOST_TENSOR,
    INTENDED_READS,
    SPLIT_SIZES,
    HostSyncRecorder,
    pageable_upload,
    sync_reason,
)
from overlap.training.data import to_device
from overlap.training.trainer import Trainer
from tests.configs import tiny_config
from tests.world import run_world

LAYERS = 2
OVERLAP = [
    "comm_overlap.overlap_moe_expert_parallel_comm=true",
    "comm_overlap.delay_wgrad_compute=true",
]
PADDED = ["model.moe_expert_capacity_factor=1.0", "model.moe_pad_expert_input_to_capacity=true"]
# sync-free dropless dispatch: fixed blocks, its overflow folded into the loss and grad-norm reads
RANK_CAPACITY = ["model.moe_expert_rank_capacity_factor=1.5"]
# what a CUDA run takes unset (the loop is the CPU's reference)
FUSED = ["model.moe_permute_fusion=true"]
FLEX = ["model.moe_token_dispatcher_type=flex", "model.moe_flex_dispatcher_backend=torch"]
# the compiled elementwise chains (on for CUDA unset): the warm-up step compiles them; under the
# recorder their eager ops run (dynamo does not trace under a dispatch mode), and
# test_fused_elementwise checks the compiled graphs' ops
ELEMENTWISE = [
    "model.rms_norm_fusion=true",
    "model.apply_rope_fusion=true",
    "model.bias_activation_fusion=true",
]
# fp16: the loss scaler's overflow check is the gradient-norm read (no read of its own)
FP16 = ["mixed_precision=fp16_mixed", "mixed_precision.initial_loss_scale=4096"]
# context parallelism: its exchanges are device work, never a host read
CP2 = ["model.context_parallel_size=2"]
LOSS, GRAD_NORM = (why for _path, _fn, _code, why in INTENDED_READS)


def _step(overrides: list[str], ep: int) -> tuple[dict, list[str], int, int]:
    """One recorded training step after a warm-up step: (syncs by kind, the unneeded ones,
    micro-batches, AdamW's step counts). EP overlap needs EP > 1: one rank runs the plain step."""
    overrides = (OVERLAP if ep > 1 else []) + overrides
    cfg = tiny_config(True, "bf16_mixed", LAYERS, overrides, 2, expert_model_parallel_size=ep)
    trainer = Trainer(cfg, ParallelState(cfg.finalize(dist.get_world_size()).layout))
    trainer.train_step(0)
    steps = [state["step"] for state in trainer.optimizer.adam.state.values()]
    with HostSyncRecorder(host_tensors=steps) as rec:
        trainer.train_step(1)
    return dict(rec.by_kind()), rec.unneeded(), trainer.num_micro_batches, len(steps)


@pytest.mark.parametrize(
    "world, ep, overrides, per_layer",
    [
        (1, 1, FUSED, 1),
        (2, 2, FUSED, 1),
        (2, 2, FUSED + FLEX, 1),
        (2, 2, FUSED + PADDED, 0),
        (2, 2, FUSED + RANK_CAPACITY, 0),
        (1, 1, FUSED + RANK_CAPACITY, 0),
        (1, 1, FUSED + PADDED, 0),
        (1, 1, FUSED + ELEMENTWISE, 1),
        (2, 2, FP16 + FUSED, 1),
        (2, 1, FUSED + CP2, 1),
        (2, 2, FUSED + CP2 + ["model.cp_comm_type=a2a"], 1),
        (2, 1, FUSED + CP2 + ["model.cp_comm_type=all_gather"], 1),
    ],
    ids=[
        "ep1",
        "ep2-overlap",
        "ep2-overlap-flex",
        "ep2-overlap-padded",
        "ep2-overlap-rank-capacity",
        "ep1-rank-capacity",
        "ep1-padded",
        "ep1-fused-elementwise",
        "ep2-overlap-fp16",
        "cp2-ring",
        "cp2-a2a-ep2-overlap",
        "cp2-all-gather",
    ],
)
def test_a_training_step_syncs_only_for_the_split_sizes_the_loss_and_the_grad_norm(
    world, ep, overrides, per_layer
):
    for by_kind, unneeded, microbatches, adam_steps in run_world(world, _step, overrides, ep):
        assert not unneeded, "host syncs the step should not have:\n" + "\n".join(unneeded)
        # AdamW's reads of its step counts: CPU tensors on a GPU run too, read however often torch's
        # Adam path does (twice per slot on the foreach path, none on fused), never a device sync
        assert 0 < by_kind.pop(HOST_TENSOR) <= 2 * adam_steps
        expected = {LOSS: 1, GRAD_NORM: 1}
        if per_layer:
            expected[SPLIT_SIZES] = per_layer * LAYERS * microbatches
        assert by_kind == expected


def test_the_loop_permutation_is_the_cpu_reference_and_cuda_takes_the_fused_one():
    """Unset, `moe_permute_fusion` is the loop on the CPU, whose per-expert steps would each sync on
    a GPU (the recorder finds exactly those, and nothing else), and the fused permutation on CUDA,
    said in the model section."""
    ((by_kind, unneeded, _, _),) = run_world(1, _step, PADDED, 1)
    assert unneeded and all("(_route_loop)" in line for line in unneeded), unneeded
    for on_cuda, fused in ((True, True), (False, False)):
        res = tiny_config(True, "bf16_mixed", LAYERS, [], 1).finalize(1, on_cuda=on_cuda)
        (decision,) = (
            d for d in res.decisions.sections["model"] if d.field == "model.moe_permute_fusion"
        )
        assert (decision.requested, decision.effective) == (None, fused)
    assert permute_fused(False, on_cpu=False) == (False, f"as asked, although {LOOP_ON_CUDA}")


def test_the_recorder_names_each_class_of_sync_by_its_line():
    t = torch.tensor([1, 0, 2])
    with HostSyncRecorder() as rec:
        float(t[0])
        t.tolist()
        torch.where(t > 0)
        _ = t[t > 0]
        torch.tensor([1, 2])
        torch.tensor(1.0, device="cpu")  # a host tensor on a GPU run too: no copy
        t.repeat_interleave(t)
        t.repeat_interleave(t, output_size=3)  # the size given: no read
        t.repeat_interleave(2)  # a host count: no read
        t.index_select(0, t)  # an integer index: no read
    ops = [s.op for s in rec.syncs]
    assert ops == [
        "aten._local_scalar_dense.default",
        "tolist",
        "aten.nonzero.default",
        "aten.index.Tensor",
        "tensor",
        "aten.repeat_interleave.Tensor",
    ]
    assert {s.site for s in rec.syncs} == {
        "(no line of ours on the stack)"
    }  # tests are not the package
    assert sync_reason(torch.ops.aten.add.Tensor, (t, t), {}) is None


class _PinnedStandIn:
    """A host tensor's surface as the classifier reads it, page-locked (a CPU build cannot pin)."""

    device = torch.device("cpu")

    def is_pinned(self) -> bool:
        return True


def test_a_pageable_host_to_device_copy_is_a_sync_and_a_pinned_non_blocking_one_is_not():
    """Issue 47 item 7: a copy from pageable host memory to the device stages through a driver
    buffer and synchronises the stream (CUDA's `memcpy_and_sync`), blocking or not; "meta" stands
    for the device here."""
    host = torch.arange(4)
    with HostSyncRecorder() as rec:
        host.to("meta")
        host.to("meta", non_blocking=True)
        torch.empty(4, dtype=torch.int64, device="meta").copy_(host)
        host.to("cpu")  # no copy at all
    assert [s.op for s in rec.syncs] == ["aten._to_copy.default"] * 2 + ["aten.copy_.default"]
    assert all("pageable memory" in s.reason for s in rec.syncs)
    to_copy = torch.ops.aten._to_copy.default
    pinned = _PinnedStandIn()
    assert not pageable_upload(to_copy, (pinned,), {"device": "cuda", "non_blocking": True})
    assert pageable_upload(to_copy, (pinned,), {"device": "cuda"})  # pinned but blocking


class _CudaCalls(TorchFunctionMode):
    """Records what `to_device` asks of a CUDA target, running nothing that needs CUDA: the pin
    returns a stand-in for page-locked memory, the copy returns its source."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, dict]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.pin_memory:
            self.calls.append(("pin_memory", {}))
            return args[0]
        if func is torch.Tensor.to:
            self.calls.append(("to", {"device": str(args[1]), **kwargs}))
            return args[0]
        return func(*args, **kwargs)


def test_the_step_data_goes_to_a_gpu_pinned_and_non_blocking():
    """The training data's copy onto a CUDA device (`training.data.to_device`): staged in pinned
    memory and copied non-blocking, so the classifier above finds no sync in it; the CPU keeps its
    tensor."""
    rows = torch.arange(6).view(2, 3)
    with _CudaCalls() as calls:
        to_device(rows, torch.device("cuda", 0))
    assert calls.calls == [("pin_memory", {}), ("to", {"device": "cuda:0", "non_blocking": True})]
    assert to_device(rows, torch.device("cpu")) is rows
