"""Megatron-FSDP (`ddp.use_megatron_fsdp`, `ddp.data_parallel_sharding_strategy`; what Bridge's
`--use_megatron_fsdp` sets): declared with Megatron's rules, priced by the planner (memory: the
shards plus two layers whole; time: layer-by-layer collectives every micro-batch), refused by
`overlap run` (not built)."""

from __future__ import annotations

import math

import pytest

from overlap.errors import ConfigError
from overlap.harness import resolve_run
from overlap.perf.memory_model import rank_memory
from overlap.plan.comm_model import comm_plan, microbatches
from overlap.plan.hardware import builtin_cluster
from overlap.plan.predict import predict
from overlap.training.runtime_refusals import runtime_refusals

LLAMA8 = "-m llama -mr llama3_8b -g h100 -ng 8 -c bf16 -gb 128 -sl 8192 -cp 1".split()
FSDP = "ddp.use_megatron_fsdp=true"
_NO_DIST_OPT = ("ddp.use_distributed_optimizer=false", "optimizer.use_distributed_optimizer=false")


def _job(*overrides: str):
    return resolve_run(LLAMA8, list(overrides))


def _sharded(strategy: str):
    return _job(FSDP, f"ddp.data_parallel_sharding_strategy={strategy}")


def test_the_decision_table_says_what_is_sharded_and_turns_the_distributed_optimizer_on():
    job = _sharded("optim_grads_params")
    rows = job.resolution.decisions
    assert "the gradients and the parameters" in rows.get("ddp.use_megatron_fsdp").reason
    # the recipe turns the distributed optimizer on; typed off, Megatron-FSDP turns it on again
    typed_off = _job(
        FSDP,
        "ddp.data_parallel_sharding_strategy=optim",
        "ddp.use_distributed_optimizer=false",
        "optimizer.use_distributed_optimizer=false",
    )
    dist_opt = typed_off.resolution.decisions.get("ddp.use_distributed_optimizer")
    assert dist_opt.effective is True and "Megatron-FSDP" in dist_opt.reason
    assert typed_off.cfg.resolved.overlap.use_distributed_optimizer
    # no_shard shards nothing: the recipe's distributed optimizer is turned off, with a row
    no_shard = _sharded("no_shard")
    row = no_shard.resolution.decisions.get("ddp.use_distributed_optimizer")
    assert row.effective is False and "no_shard" in row.reason
    assert not no_shard.cfg.resolved.overlap.use_distributed_optimizer
    o = job.cfg.resolved.overlap
    assert o.use_megatron_fsdp and o.data_parallel_sharding_strategy == "optim_grads_params"
    assert o.overlap_grad_reduce and o.overlap_param_gather  # DP > 1, sharded: Bridge's rule


@pytest.mark.parametrize(
    "overrides, field, said",
    [
        ([FSDP, "ddp.data_parallel_sharding_strategy=zero3"], "ddp.data_parallel_sharding_strategy",
         "unknown sharding strategy"),
        (["ddp.data_parallel_sharding_strategy=optim_grads"], "ddp.data_parallel_sharding_strategy",
         "Megatron-FSDP's"),
        ([FSDP, "ddp.average_in_collective=true"], "ddp.average_in_collective",
         "does not average"),
        ([FSDP, "comm_overlap.defer_embedding_wgrad_compute=true", "-pp", "2"],
         "comm_overlap.defer_embedding_wgrad_compute", "cannot work with Megatron-FSDP"),
    ],
)  # fmt: skip
def test_megatrons_rules_are_errors_that_name_the_field(overrides, field, said):
    words = [w for w in overrides if "=" not in w]
    with pytest.raises(ConfigError) as info:
        resolve_run(LLAMA8 + words, [w for w in overrides if "=" in w])
    assert info.value.field == field and said in str(info.value)


def test_run_refuses_it_as_not_built():
    refused = {e.field: str(e) for e in runtime_refusals(_sharded("optim").cfg, gpu=True)}
    assert "not built" in refused["ddp.use_megatron_fsdp"]
    assert "ddp.use_megatron_fsdp" not in {e.field for e in runtime_refusals(_job().cfg, gpu=True)}


def test_each_strategy_keeps_its_shard_and_what_is_whole_at_the_peak():
    """The dense Llama3-8B on DP 8: the optimizer state is sharded from `optim` on (as the
    distributed optimizer; `no_shard` keeps it whole), the gradients from `optim_grads` and the
    parameters at `optim_grads_params`, each as 1 / 8 of the parameters plus what is whole at the
    peak: the embedding, output layer and final norm (outside Megatron-FSDP's units, the
    transformer layers), with their gradients; the layer computing and those its 500M-element
    prefetch gathers ahead (two of Llama3-8B's 218M); two layers' gradients."""
    m = _job().cfg.resolved.model
    h, vocab = m.hidden_size, m.vocab_size
    layer = h * (m.num_attention_heads + 2 * m.query_groups) * m.head_dim
    layer += m.num_attention_heads * m.head_dim * h + 2 * h + 3 * h * m.ffn_size
    root = 2 * vocab * h + h  # untied embedding and output layer, final norm
    dist_opt = rank_memory(*_layout(_job("ddp.use_distributed_optimizer=true")))
    whole = rank_memory(*_layout(_job(*_NO_DIST_OPT)))
    params = dist_opt.params
    assert params == m.num_layers * layer + root and 500_000_000 // layer == 2
    shard = math.ceil(params / 8) + root
    by = {
        s: rank_memory(*_layout(_sharded(s)))
        for s in ("no_shard", "optim", "optim_grads", "optim_grads_params")
    }
    assert by["no_shard"].optimizer_bytes == whole.optimizer_bytes > dist_opt.optimizer_bytes
    for strategy in ("optim", "optim_grads", "optim_grads_params"):
        assert by[strategy].optimizer_bytes == dist_opt.optimizer_bytes, strategy
    g = 4 if _job().cfg.resolved.precision.grad_reduce_in_fp32 else 2  # the perf recipe's: bf16
    assert by["no_shard"].grad_bytes == by["optim"].grad_bytes == dist_opt.grad_bytes == params * g
    assert by["optim_grads"].grad_bytes == by["optim_grads_params"].grad_bytes
    assert by["optim_grads"].grad_bytes == (shard + 2 * layer) * g
    assert by["optim_grads"].param_bytes == dist_opt.param_bytes == params * 2
    assert by["optim_grads_params"].param_bytes == (shard + 3 * layer) * 2
    assert by["optim_grads_params"].total < by["optim_grads"].total < dist_opt.total


def _layout(job):
    return job.cfg, job.resolution.layout


def test_the_collectives_run_layer_by_layer_every_micro_batch():
    """optim_grads: the gradients' reduce-scatter once per layer and micro-batch, and once more for
    the parameters outside the layers; optim_grads_params also the parameters' all-gather (the
    rest first, then each layer; the layers again for the backward): a step moves the
    distributed optimizer's bytes x the micro-batches (the gather: x 2 less the rest's second
    time). `optim` moves what the distributed optimizer does, and so does FSDP off."""
    cluster = builtin_cluster("h100", "bf16", 8)
    plans = {
        name: comm_plan(*_layout(job), cluster)
        for name, job in (
            ("dist_opt", _job("ddp.use_distributed_optimizer=true")),
            ("optim", _sharded("optim")),
            ("grads", _sharded("optim_grads")),
            ("params", _sharded("optim_grads_params")),
        )
    }
    job = _job()
    mb, m = microbatches(*_layout(job)), job.cfg.resolved.model
    layers, root = m.num_layers, 2 * m.vocab_size * m.hidden_size + m.hidden_size
    params = rank_memory(*_layout(job)).params
    base = plans["dist_opt"].kinds
    assert plans["optim"].kinds == base and plans["optim"].dp_every_microbatch == set()
    assert (
        plans["grads"].dp_every_microbatch == {"rs"}
        and plans["grads"].kinds["dp_ag"] == (base["dp_ag"])
    )
    assert plans["params"].dp_every_microbatch == {"rs", "ag"}
    for name in ("grads", "params"):
        rs = plans[name].kinds["dp_rs"]
        assert rs.count == (layers + 1) * mb
        assert rs.bytes_per_step == pytest.approx(mb * base["dp_rs"].bytes_per_step)
    ag = plans["params"].kinds["dp_ag"]
    assert ag.count == (2 * layers + 1) * mb
    again = (params - root) / params  # the layers' share, gathered again for the backward
    assert ag.bytes_per_step == pytest.approx(mb * (1 + again) * base["dp_ag"].bytes_per_step)
    assert len(plans["params"].dp_ag_s["dp"]) == layers + 1
    assert len(plans["params"].dp_ag_bwd_s["dp"]) == layers


def test_fsdp_is_priced_slower_than_the_distributed_optimizer_and_forces_the_overlaps_on():
    """More traffic never makes a step faster; Megatron-FSDP turns the DP overlaps on whatever
    was asked (a row says so), and they hide most of it: each micro-batch exposes its first
    gather (the embedding and output layer) and its last reduce-scatter (NVLink, Llama3-8B)."""
    cluster = builtin_cluster("h100", "bf16", 8)
    dist_opt = predict(
        "dist-opt", [], *_layout(_job("ddp.use_distributed_optimizer=true")), cluster
    )
    fsdp = predict("fsdp", [], *_layout(_sharded("optim_grads_params")), cluster)
    asked_off = resolve_run(
        LLAMA8,
        [FSDP, "ddp.data_parallel_sharding_strategy=optim_grads_params",
         "ddp.overlap_grad_reduce=false", "ddp.overlap_param_gather=false"],
    )  # fmt: skip
    for field in ("ddp.overlap_grad_reduce", "ddp.overlap_param_gather"):
        row = asked_off.resolution.decisions.get(field)
        assert row.effective is True and "Megatron-FSDP" in row.reason, field
    assert dist_opt.step_ms < fsdp.step_ms
    exposed = sum(fsdp.times.exposed_s.get(k, 0) for k in ("dp_ag", "dp_rs"))
    moved = sum(c.seconds_per_step for k, c in fsdp.comm.kinds.items() if k in ("dp_ag", "dp_rs"))
    assert 0 < exposed < 0.2 * moved
    assert fsdp.times.slowdown_s > dist_opt.times.slowdown_s


def test_bridges_harness_flag_sets_what_bridge_sets_and_an_override_refines_it():
    """`--use_megatron_fsdp true` as Bridge's `_set_megatron_fsdp_overrides`: FSDP on at
    optim_grads_params, averaging in the collective off; an explicit override of the strategy
    wins; `false` sets nothing."""
    flagged = resolve_run([*LLAMA8, "--use_megatron_fsdp", "true"], [])
    d = flagged.cfg.ddp
    assert d.use_megatron_fsdp and not d.average_in_collective
    assert d.data_parallel_sharding_strategy == "optim_grads_params"
    typed = _sharded("optim_grads_params").cfg.resolved.overlap
    assert flagged.cfg.resolved.overlap == typed
    refined = resolve_run(
        [*LLAMA8, "--use_megatron_fsdp", "true"], ["ddp.data_parallel_sharding_strategy=optim"]
    )
    assert refined.cfg.resolved.overlap.data_parallel_sharding_strategy == "optim"
    off = resolve_run([*LLAMA8, "--use_megatron_fsdp", "false"], []).cfg.resolved.overlap
    assert off == _job().cfg.resolved.overlap


def test_the_search_takes_it_as_a_memory_rung_and_says_where_the_command_line_has_it():
    """Megatron-FSDP is one of the search's memory rungs (a candidate carries it only where the
    layout without it does not fit, and its command says it), the command line's own
    `--use_megatron_fsdp` is the given layout's, not every candidate's; where the command line's
    settings refuse it (averaging in the collective), no candidate carries it and the search
    still runs."""
    from overlap.plan.search import search

    flagged = search([*LLAMA8, "--use_megatron_fsdp", "true"])
    given = flagged.given
    assert given.layout.fsdp and "Megatron-FSDP" in given.layout.describe()
    sharded = [c for c in flagged.ranked if c.layout.fsdp]
    assert sharded and any(not c.layout.fsdp for c in flagged.ranked)
    for c in flagged.ranked:
        command = c.command(flagged.words, flagged.overrides)
        assert ("ddp.use_megatron_fsdp=true" in command) == c.layout.fsdp
        assert "--use_megatron_fsdp" not in command
    refused = search(LLAMA8, ["ddp.average_in_collective=true"])
    assert refused.ranked and not any(c.layout.fsdp for c in refused.ranked)
