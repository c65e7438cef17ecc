"""Megatron's pipeline layouts: the grammar, the four ways to split, the config's checks, explain
/ plan on the Qwen3-235B recipe's layout, and the runtime training an uneven virtual pipeline to
the single-process losses.
"""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from overlap.cli import main
from overlap.config import ModelConfig
from overlap.errors import ConfigError, NotBuiltError
from overlap.layout.pipeline import parse_layout, resolve_pipeline_layout
from overlap.parallel.state import ParallelState
from overlap.training.trainer import Trainer
from tests.configs import layer_ranges, tiny_config
from tests.world import run_world


def _layout(layers: int, pp: int, **fields):
    return resolve_pipeline_layout(ModelConfig(num_layers=layers, **fields), pp)


# --- the grammar ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec, pp, stages",
    [
        ("Ett|tt", 2, ["Ett", "tt"]),
        ("E|(tt|)*2,(t|)*4,mL", 4, ["E", "tt", "tt", "t", "t", "t", "t", "mL"]),
        ("Et*12|t*10L", 2, ["E" + "t" * 12, "t" * 10 + "L"]),
        ("Et*3|(t*2|)*2t", 4, ["Ettt", "tt", "tt", "t"]),
        ([["embedding", "decoder"], ["Decoder", " loss "]], 2, ["Et", "tL"]),
    ],
)
def test_the_grammar_expands_as_megatron_does(spec, pp, stages):
    assert parse_layout(spec, pp) == stages


@pytest.mark.parametrize(
    "spec, why",
    [
        ("Ex|tL", "unknown symbol"),
        ("Et*|tL", "unknown symbol"),
        ("((t|)*2)*2", "unknown symbol"),
        ("", "empty"),
        ([["embedding", "transformer"], ["loss"]], "unknown layer name"),
        (42, "string or a list of lists"),
        ("Et|t|tL", "not a multiple of pipeline_model_parallel_size"),
    ],
)
def test_bad_strings_are_refused_naming_the_field(spec, why):
    with pytest.raises(ConfigError) as err:
        parse_layout(spec, 2)
    assert err.value.field == "model.pipeline_model_parallel_layout" and why in str(err.value)


@pytest.mark.parametrize(
    "spec, layers, why",
    [
        ("Ett|ttL", 5, "places 4 transformer layers"),
        ("tEt|ttL", 4, "opens the first stage"),
        ("Ett|tLt", 5, "closes the last"),
        ("EtE|ttL", 3, "exactly once"),
        ("Ett|tmL", 3, "MTP layer"),  # model.mtp_num_layers is not set
        ("Ett|ttL", 4, "num_layers_in_first_pipeline_stage"),  # with a first-stage size as well
    ],
)
def test_a_layout_must_fit_the_model(spec, layers, why):
    extra = {"num_layers_in_first_pipeline_stage": 2} if why.startswith("num_layers_in") else {}
    with pytest.raises(ConfigError, match=why):
        _layout(layers, 2, pipeline_model_parallel_layout=spec, **extra)


def test_stage_i_goes_to_rank_i_mod_pp_and_chunk_i_div_pp():
    lay = _layout(6, 2, pipeline_model_parallel_layout="Et|tt|t|ttL")
    assert (lay.pp, lay.vpp) == (2, 2)
    assert [(s.pp_rank, s.chunk, s.start, s.end, s.embedding, s.loss) for s in lay.stages] == [
        (0, 0, 0, 1, True, False),
        (1, 0, 1, 3, False, False),
        (0, 1, 3, 4, False, False),
        (1, 1, 4, 6, False, True),
    ]
    assert layer_ranges(lay) == [[(0, 1), (3, 4)], [(1, 3), (4, 6)]]
    assert lay.as_string() == "Et|tt|t|ttL"


def test_accounting_for_embedding_and_loss_counts_them_as_layers():
    # 94 + 2 = 96 over PP 8 x VPP 4: 3 per chunk, the first and last chunks one transformer layer
    # fewer
    lay = _layout(
        94,
        8,
        virtual_pipeline_model_parallel_size=4,
        account_for_embedding_in_pipeline_split=True,
        account_for_loss_in_pipeline_split=True,
    )
    assert lay.as_string() == "Ett|(t*3|)*30ttL"
    assert lay.layers_per_rank() == [11] + [12] * 6 + [11]
    spelt = _layout(94, 8, pipeline_model_parallel_layout=lay.as_string())
    assert spelt.stages == lay.stages
    assert _layout(7, 4, account_for_loss_in_pipeline_split=True).as_string() == "Ett|tt|tt|tL"
    with pytest.raises(ConfigError, match="95 layers do not split evenly over PP 8"):
        _layout(94, 8, account_for_embedding_in_pipeline_split=True)
    with pytest.raises(ConfigError, match="cannot be combined"):
        _layout(8, 2, account_for_loss_in_pipeline_split=True, num_layers_in_last_pipeline_stage=3)


def test_a_deepseek_v3_style_layout_resolves_with_its_mtp_layer():
    lay = _layout(61, 8, pipeline_model_parallel_layout="Et|(tt|)*30mL", mtp_num_layers=1)
    assert lay.vpp == 4 and lay.stages[-1].mtp == 1 and lay.stages[-1].num_layers == 0
    assert lay.layers_per_rank() == [7, 8, 8, 8, 8, 8, 8, 6]


# --- the configuration, explain and plan ----------------------------------------------------------
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
    "-gb",
    "8192",
]


def test_the_layout_decides_vpp_and_a_contradicting_vp_is_refused():
    cfg = tiny_config(
        False,
        "fp32",
        6,
        [],
        1,
        pipeline_model_parallel_size=2,
        pipeline_model_parallel_layout="Et|tt|t|ttL",
    )
    res = cfg.finalize(2)
    # on the resolved layout; the model section keeps what was typed
    assert res.layout.vpp == res.pipeline.vpp == 2
    assert cfg.model.virtual_pipeline_model_parallel_size is None
    rows = {d.field: d for d in res.decisions.sections["pipeline"]}
    assert rows["model.pipeline_model_parallel_layout"].effective == "Et|tt|t|ttL"
    assert rows["model.virtual_pipeline_model_parallel_size"].effective == 2
    bad = tiny_config(
        False,
        "fp32",
        6,
        [],
        1,
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=3,
        pipeline_model_parallel_layout="Et|tt|t|ttL",
    )
    with pytest.raises(ConfigError) as err:
        bad.finalize(2)
    assert err.value.field == "model.virtual_pipeline_model_parallel_size" and "-vp 2" in str(
        err.value
    )


@pytest.mark.parametrize(
    "override",
    [
        "model.pipeline_model_parallel_layout=Et|t*2|t|tL",
        "model.pipeline_model_parallel_layout=[[embedding,decoder],[decoder,decoder],[decoder],[decoder,loss]]",
    ],
)
def test_both_forms_come_through_an_override(override):
    cfg = tiny_config(False, "fp32", 5, [override], 1, pipeline_model_parallel_size=2)
    res = cfg.finalize(2)
    assert res.pipeline.as_string() == "Et|tt|t|tL" and res.layout.vpp == 2


def test_explain_shows_the_235b_recipe_layout_and_takes_it_spelt_out(capsys):
    assert main(["explain", *QWEN235, "--recompute_modules", "layernorm,moe_act"]) == 0
    out = capsys.readouterr().out
    assert "Ett|(t*3|)*30ttL" in out and "11-12 transformer layers per rank" in out
    assert "PP rank 0       Ett | t*3 | t*3 | t*3" in out
    assert "PP rank 7       t*3 | t*3 | t*3 | ttL" in out
    spelt = [
        "model.account_for_embedding_in_pipeline_split=false",
        "model.account_for_loss_in_pipeline_split=false",
        "model.pipeline_model_parallel_layout=Ett|(t*3|)*30ttL",
    ]
    assert main(["explain", *[a for a in QWEN235 if a not in ("-vp", "4")], *spelt]) == 0
    assert "the layout's stages / PP = 32 / 8" in capsys.readouterr().out
    tiny = ["-m", "qwen", "-mr", "dense_tiny", "-g", "cpu", "-ng", "2", "-pp", "2", "--json"]
    assert main(["explain", *tiny, "model.pipeline_model_parallel_layout=E|t*2|t*2|L"]) == 0
    assert json.loads(capsys.readouterr().out)["pipeline_stages"] == [["E", "tt"], ["tt", "L"]]


def test_plan_resolves_the_235b_recipe_layout(tmp_path):
    report = tmp_path / "plan.json"
    assert (
        main(
            [
                "plan",
                *QWEN235,
                "--recompute_modules",
                "layernorm,moe_act",
                "--ab",
                "model.recompute_granularity=selective,null",
                "--json",
                str(report),
            ]
        )
        == 0
    )
    with_act, without = json.loads(report.read_text())["configs"]
    # moe_act keeps less of the experts' activations
    assert with_act["peak_mem_gb"] < without["peak_mem_gb"]
    assert with_act["bubble_ms"] > 0


def test_the_planner_weighs_and_the_memory_estimate_sizes_the_uneven_stages():
    from overlap.launch.resources import estimate_memory
    from overlap.plan.compute import microbatch_compute
    from overlap.plan.hardware import builtin_cluster
    from overlap.recipes.models import RECIPES

    cfg = RECIPES["qwen3_235b_a22b"].build(256)
    cfg.model.tensor_model_parallel_size, cfg.model.pipeline_model_parallel_size = 2, 8
    cfg.model.virtual_pipeline_model_parallel_size, cfg.model.expert_model_parallel_size = 4, 32
    cfg.model.sequence_parallel = True
    cfg.train.global_batch_size = 8192
    res = cfg.finalize(256, require_libraries=False, on_cuda=True)
    weights = microbatch_compute(cfg, res.layout, builtin_cluster("h100", "bf16", 8)).stage_weights
    assert len(weights) == 32
    # 2 layers (+ the embedding, a few % of a layer) first, 3 in the middle, 2 + the output layer
    assert weights[1] == pytest.approx(weights[30]) and weights[0] < weights[1] < weights[31]
    assert weights[0] == pytest.approx(weights[1] * 2 / 3, rel=0.03)
    # the memory estimate: moe_act keeps less of the routed experts' activations, the same
    # parameters
    one = estimate_memory(cfg, res.layout)
    res.model.recompute_granularity, res.model.recompute_modules = "selective", ["moe_act"]
    assert estimate_memory(cfg, res.layout).activation_bytes < one.activation_bytes
    assert one.params == estimate_memory(cfg, res.layout).params


def test_the_runtime_refuses_a_layout_with_mtp_by_name():
    from overlap.training.runtime_refusals import runtime_refusals

    cfg = tiny_config(
        False,
        "fp32",
        2,
        ["model.mtp_num_layers=1"],
        1,
        pipeline_model_parallel_size=2,
        pipeline_model_parallel_layout="Et|tmL",
    )
    cfg.finalize(2)
    refusals = runtime_refusals(cfg)
    assert any(
        isinstance(r, NotBuiltError) and "Multi-token prediction" in str(r) for r in refusals
    )


# --- the runtime: an uneven virtual pipeline trains like one rank ---------------------------------
STEPS = 3


def _train(layers: int, layout: dict) -> tuple[list[float], list[int], set[str]]:
    """(losses, this rank's chunk sizes, its parameter names: the names checkpoints and HF
    loading go by)."""
    cfg = tiny_config(False, "fp32", layers, [], STEPS, **layout)
    res = cfg.finalize(dist.get_world_size())
    trainer = Trainer(cfg, ParallelState(res.layout))
    sizes = [len(chunk.layers) for chunk in trainer.chunks]
    names = {name for chunk in trainer.chunks for name, _ in chunk.named_parameters()}
    return [r.lm_loss for r in trainer.train().records], sizes, names


UNEVEN = [
    # (id, layers, layout, chunk sizes of rank 0 and rank 1)
    (
        "account_for_embedding_and_loss",
        6,
        dict(
            pipeline_model_parallel_size=2,
            virtual_pipeline_model_parallel_size=2,
            account_for_embedding_in_pipeline_split=True,
            account_for_loss_in_pipeline_split=True,
        ),
        ([1, 2], [2, 1]),
    ),
    (
        "layout_string",
        5,
        dict(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et|tt|t|tL"),
        ([1, 1], [2, 1]),
    ),
    (
        "embedding_and_loss_alone",
        4,
        dict(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="E|tt|tt|L"),
        ([0, 2], [2, 0]),
    ),
    (
        "empty_chunk",
        4,
        dict(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Ett||tt|L"),
        ([2, 2], [0, 0]),
    ),
]


@pytest.mark.parametrize("case", UNEVEN, ids=[c[0] for c in UNEVEN])
def test_an_uneven_virtual_pipeline_matches_single_process_fp32(case):
    """PP2 x VPP2 with chunks of unequal size: the losses of 3 steps (forward, backward and
    optimizer through every chunk) equal the single-process run's within fp32 rounding (rel
    1e-5), and the ranks' parameters are the single-process model's, by name."""
    _id, layers, layout, sizes = case
    ref, _, ref_names = run_world(1, _train, layers, {})[0]
    got = run_world(2, _train, layers, layout)
    for rank, (losses, chunk_sizes, _names) in enumerate(got):
        assert losses == pytest.approx(ref, rel=1e-5)
        assert chunk_sizes == sizes[rank]
    # every parameter once, under its global layer number (checkpoints and HF weights load by these
    # names)
    assert got[0][2] | got[1][2] == ref_names and not got[0][2] & got[1][2]


def test_the_torch_pipelining_peer_trains_an_uneven_layout_to_the_same_losses():
    """torch.distributed.pipelining's interleaved schedule on the same uneven chunks (fp32, rel
    1e-5)."""
    _id, layers, layout, _sizes = UNEVEN[1]
    ours = run_world(2, _train, layers, layout)[0][0]
    peer = run_world(2, _train, layers, {**layout, "pipeline_impl": "torch_pipelining"})[0][0]
    assert peer == pytest.approx(ours, rel=1e-5)
