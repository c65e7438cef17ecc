"""`overlap explain`: the reference harness command line, flags vs overrides, JSON output, and exit
status 2 without a traceback for every user mistake."""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import replace

import pytest
import torch

import overlap.cli as cli
import overlap.kernels.flex_backend as flex
from overlap.cli import main
from overlap.recipes.models import RECIPES

# The reference harness command from SPEC.md section 1 (run_script.py flags), as `overlap explain`
# arguments.
HARNESS = (
    "explain -m qwen -mr qwen3_30b_a3b --task pretrain -g h100 -c bf16 -ng 16 -gn 8 --max_steps 8 "
    "--config_variant v1 --cuda_graph_impl none --moe_flex_dispatcher_backend None "
    "--tokenizer_type NullTokenizer"
).split()
HARNESS_OVERRIDES = [
    "comm_overlap.overlap_moe_expert_parallel_comm=true",
    "comm_overlap.delay_wgrad_compute=false",
    "model.moe_shared_expert_overlap=false",
]
TINY = "explain -m qwen -mr qwen3_moe_tiny -ng 4".split()
ENV_NAMES = (
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "NVTE_FWD_LAYERNORM_SM_MARGIN",
    "NVTE_BWD_LAYERNORM_SM_MARGIN",
)


@pytest.fixture(autouse=True)
def clean_launch_env(monkeypatch):
    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def jobs(monkeypatch):
    """Capture the prepared jobs (finalized configs) of the explain command."""
    seen = []
    real = cli.prepare

    def spy(args, **kwargs):
        job = real(args, **kwargs)
        seen.append(job)
        return job

    monkeypatch.setattr(cli, "prepare", spy)
    return seen


def run(argv, capsys):
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "Traceback" not in out
    return code, out, err


def decisions(argv, capsys) -> dict[str, dict]:
    code, out, err = run([*argv, "--json"], capsys)
    assert code == 0, err
    rows = json.loads(out)["decisions"]
    return {row["field"]: row for row in rows}


# --- the reference harness command ----------------------------------------------------------------
GUIDE = [
    *HARNESS,
    "--moe_a2a_overlap",
    "false",
    *HARNESS_OVERRIDES,
]  # the MoE guide's command, verbatim


@pytest.mark.parametrize("extra", [[], ["model.moe_permute_fusion=false"]])
def test_the_guides_command_resolves_with_the_override_winning_loudly(capsys, caplog, extra):
    caplog.set_level(logging.INFO, logger="overlap.config")
    code, out, err = run([*GUIDE, *extra, "--json"], capsys)
    assert code == 0, err
    doc = json.loads(out)
    rows = {r["field"]: r for r in doc["decisions"]}
    assert rows["model.overlap_moe_expert_parallel_comm"]["effective"] is True
    assert rows["model.delay_wgrad_compute"]["effective"] is False
    assert rows["model.moe_shared_expert_overlap"]["effective"] is False
    beaten = {r["field"]: r for r in doc["command_line"]}[
        "comm_overlap.overlap_moe_expert_parallel_comm"
    ]
    assert (beaten["requested"], beaten["effective"], beaten["decided_by"]) == (
        False,
        True,
        "override",
    )
    assert "beats --moe_a2a_overlap false" in beaten["reason"]
    # Said in the log, as the start-up log repeats it - at info: the user's own override, not a
    # warning.
    said = [r for r in caplog.records if "beats --moe_a2a_overlap false" in r.getMessage()]
    assert said and all(r.levelno == logging.INFO for r in said)
    other = {r["field"]: r for r in doc["other_settings"]}
    assert other["model.moe_permute_fusion"]["value"] is (not extra)
    assert other["model.moe_permute_fusion"]["source"] == ("override" if extra else "recipe")


def test_a_peer_implementation_is_listed_with_its_source(capsys):
    code, out, err = run(
        [
            "explain",
            "-m",
            "qwen",
            "-mr",
            "dense_tiny",
            "-ng",
            "2",
            "-tp",
            "2",
            "--json",
            "model.tensor_parallel_impl=dtensor",
        ],
        capsys,
    )
    assert code == 0, err
    other = {r["field"]: r for r in json.loads(out)["other_settings"]}
    assert (
        other["model.tensor_parallel_impl"]["value"],
        other["model.tensor_parallel_impl"]["source"],
    ) == ("dtensor", "override")
    assert (
        other["model.pipeline_impl"]["value"] == "overlap"
        and other["ddp.impl"]["value"] == "overlap"
    )


def test_the_distributed_optimizer_row_shows_what_runs(capsys):
    """Either spelling turns the distributed optimizer on; the row shows the resolved value even
    when only the optimizer's spelling is typed (the sections stay as typed)."""
    words = ["explain", "-m", "qwen", "-mr", "dense_tiny", "-ng", "2", "--json"]
    code, out, err = run([*words, "optimizer.use_distributed_optimizer=true"], capsys)
    assert code == 0, err
    other = {r["field"]: r for r in json.loads(out)["other_settings"]}
    assert other["ddp.use_distributed_optimizer"]["value"] is True


def test_the_guides_command_text_names_the_beaten_flag(capsys):
    code, out, err = run(GUIDE, capsys)
    assert code == 0, err
    assert "Command line" in out and "beats --moe_a2a_overlap false" in out


def test_the_guides_command_under_strict_is_exit_2_naming_both(capsys):
    code, out, err = run([*GUIDE, "--strict"], capsys)
    assert code == 2
    assert "--moe_a2a_overlap" in err
    assert "comm_overlap.overlap_moe_expert_parallel_comm" in err
    assert err.startswith("overlap: error:")


def test_harness_command_without_flag_turns_ep_overlap_on(capsys):
    code, out, err = run([*HARNESS, *HARNESS_OVERRIDES, "--json"], capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["layout"] == {
        "tp": 1,
        "pp": 1,
        "cp": 1,
        "dp": 16,
        "ep": 16,
        "etp": 1,
        "edp": 1,
        "vpp": None,
    }
    assert {e["name"]: e["value"] for e in doc["launch_env"]}["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"
    rows = doc["decisions"]
    assert isinstance(rows, list) and rows
    for row in rows:
        assert set(row) == {"field", "requested", "effective", "decided_by", "reason"}
    by_field = {row["field"]: row for row in rows}
    ep = by_field["model.overlap_moe_expert_parallel_comm"]
    assert (ep["requested"], ep["effective"], ep["decided_by"]) == (True, True, "user")
    delay = by_field["model.delay_wgrad_compute"]
    assert (delay["requested"], delay["effective"], delay["decided_by"]) == (False, False, "user")
    assert by_field["model.moe_shared_expert_overlap"]["effective"] is False
    assert by_field["ddp.bucket_size"]["effective"] == 134217728


def test_harness_command_text_output(capsys):
    code, out, err = run([*HARNESS, *HARNESS_OVERRIDES], capsys)
    assert code == 0, err
    assert "recipe qwen3_30b_a3b on 16 x h100" in out
    assert "TP 1 x CP 1 x DP 16 x PP 1" in out and "EP 16" in out
    assert "Overlap decisions:" in out
    line = next(
        row for row in out.splitlines() if row.startswith("model.overlap_moe_expert_parallel_comm")
    )
    assert line.split()[1:4] == ["True", "True", "user"]
    assert "Launch environment:" in out


def test_flag_agreeing_with_override_is_fine(capsys):
    rows = decisions([*HARNESS, "--moe_a2a_overlap", "true", *HARNESS_OVERRIDES], capsys)
    assert rows["model.overlap_moe_expert_parallel_comm"]["effective"] is True


def test_model_level_override_beats_the_flag_too(capsys):
    # The flag writes comm_overlap (which the resolution reads first); the override of the
    # model-level twin must still win, as its place on the command line says.
    argv = [*HARNESS, "--moe_a2a_overlap", "false", "model.overlap_moe_expert_parallel_comm=true"]
    rows = decisions(argv, capsys)
    assert rows["model.overlap_moe_expert_parallel_comm"]["effective"] is True
    code, out, err = run([*argv, "--strict"], capsys)
    assert code == 2
    assert "model.overlap_moe_expert_parallel_comm" in err and "--moe_a2a_overlap" in err


# --- --moe_a2a_overlap ----------------------------------------------------------------------------
def test_moe_a2a_overlap_true_turns_on_ep_overlap_only(capsys, jobs):
    rows = decisions([*HARNESS, "--moe_a2a_overlap", "true"], capsys)
    ep = rows["model.overlap_moe_expert_parallel_comm"]
    assert (ep["requested"], ep["effective"], ep["decided_by"]) == (True, True, "user")
    # the reference also turned delay_wgrad on; here it stays what the H100 perf recipe asks (off)
    delay = rows["model.delay_wgrad_compute"]
    assert (delay["requested"], delay["effective"]) == (False, False)
    cfg = jobs[-1].cfg
    assert cfg.comm_overlap.overlap_moe_expert_parallel_comm is True
    assert cfg.comm_overlap.delay_wgrad_compute is False
    assert cfg.comm_overlap.tp_comm_overlap is None
    assert cfg.resolved.overlap.delay_wgrad_compute is False
    assert cfg.resolved.overlap.moe_shared_expert_overlap is False


@pytest.mark.parametrize("text", ["true", "1", "t", "yes", "y", "TRUE"])
def test_moe_a2a_overlap_true_spellings(capsys, text):
    rows = decisions([*HARNESS, "--moe_a2a_overlap", text], capsys)
    assert rows["model.overlap_moe_expert_parallel_comm"]["effective"] is True


@pytest.fixture
def recipe_with_ep_overlap(monkeypatch):
    """qwen3_30b_a3b as a recipe that ships with EP overlap on (the reference's perf recipe
    does)."""

    recipe = RECIPES["qwen3_30b_a3b"]
    sections = {
        **recipe.sections,
        "model": {**recipe.sections["model"], "overlap_moe_expert_parallel_comm": True},
        "comm_overlap": {"tp_comm_overlap": False, "overlap_moe_expert_parallel_comm": True},
    }
    monkeypatch.setitem(RECIPES, "qwen3_30b_a3b", replace(recipe, sections=sections))


def test_recipe_ep_overlap_is_on_without_the_flag(capsys, recipe_with_ep_overlap):
    rows = decisions(HARNESS, capsys)
    assert rows["model.overlap_moe_expert_parallel_comm"]["effective"] is True


@pytest.mark.parametrize("text", ["false", "0", "f", "no", "n"])
def test_moe_a2a_overlap_false_turns_ep_overlap_off(capsys, recipe_with_ep_overlap, text):
    # Reference bug #6006: there `false` was a no-op when the recipe had overlap on. Here it means
    # what it says.
    rows = decisions([*HARNESS, "--moe_a2a_overlap", text], capsys)
    ep = rows["model.overlap_moe_expert_parallel_comm"]
    assert (ep["requested"], ep["effective"], ep["decided_by"]) == (False, False, "user")


def test_moe_a2a_overlap_bad_value_is_exit_2(capsys):
    code, out, err = run([*TINY, "--moe_a2a_overlap", "maybe"], capsys)
    assert code == 2
    assert "--moe_a2a_overlap" in err


def test_moe_a2a_overlap_true_with_unmet_prerequisite_is_exit_2(capsys):
    code, out, err = run(
        [*TINY, "--moe_a2a_overlap", "true", "-pp", "2", "-ep", "2", "model.num_layers=4"], capsys
    )
    assert code == 2
    assert "virtual_pipeline_model_parallel_size" in err


def test_moe_a2a_overlap_true_with_full_recompute_is_exit_2(capsys):
    code, out, err = run([*TINY, "--moe_a2a_overlap", "true", "-rl", "1"], capsys)
    assert code == 2
    assert "model.recompute_granularity" in err


# --- other flags ----------------------------------------------------------------------------------
def test_tp_flag_sets_sequence_parallel(capsys, jobs):
    code, out, err = run([*TINY, "-tp", "2"], capsys)
    assert code == 0, err
    m = jobs[-1].cfg.model
    assert m.tensor_model_parallel_size == 2 and m.sequence_parallel is True
    assert jobs[-1].resolution.layout.dp == 2 and jobs[-1].resolution.layout.sequence_parallel


def test_explicit_sequence_parallel_override_beats_the_tp_flags_implied_default(capsys, jobs):
    # -tp implies sequence parallelism (as the reference harness), but an explicit override says
    # what the user wants.
    dense = "explain -m qwen -mr dense_tiny -ng 4".split()
    code, out, err = run([*dense, "-tp", "2", "model.sequence_parallel=false"], capsys)
    assert code == 0, err
    assert jobs[-1].cfg.model.sequence_parallel is False
    code, out, err = run([*dense, "-tp", "2"], capsys)
    assert code == 0 and jobs[-1].cfg.model.sequence_parallel is True


def test_tp1_with_sequence_parallel_is_a_logged_decision(capsys, jobs):
    code, out, err = run([*TINY, "-tp", "1", "model.sequence_parallel=true"], capsys)
    assert code == 0, err
    # the model section keeps what was typed; the layout carries what runs
    assert jobs[-1].cfg.model.sequence_parallel is True
    assert jobs[-1].resolution.layout.sequence_parallel is False
    assert jobs[-1].resolution.decisions.get("model.sequence_parallel").requested is True


@pytest.mark.parametrize(
    "flag, override, field, value",
    [
        (["-tp", "1"], "model.tensor_model_parallel_size=2", "model.tensor_model_parallel_size", 2),
        (["-gb", "8"], "train.global_batch_size=16", "train.global_batch_size", 16),
        (["-mb", "1"], "train.micro_batch_size=2", "train.micro_batch_size", 2),
        (["-ep", "2"], "model.expert_model_parallel_size=4", "model.expert_model_parallel_size", 4),
        (["-sl", "32"], "model.seq_length=64", "model.seq_length", 64),
        (["-ms", "3"], "train.train_iters=5", "train.train_iters", 5),
        (["--vocab_size", "512"], "tokenizer.vocab_size=1024", "tokenizer.vocab_size", 1024),
        # the knob's other spelling (`overlap.config.aliases`): the override still wins, said
        (["--vocab_size", "512"], "model.vocab_size=1024", "tokenizer.vocab_size", 1024),
        (["-c", "fp32"], "mixed_precision=bf16_mixed", "mixed_precision", "bf16_mixed"),
        (
            ["--moe_flex_dispatcher_backend", "None"],
            "model.moe_token_dispatcher_type=flex",
            "model.moe_token_dispatcher_type",
            "flex",
        ),
        (
            ["--recompute_modules", "core_attn"],
            "model.recompute_modules=[mlp]",
            "model.recompute_modules",
            ["mlp"],
        ),
    ],
)
def test_every_flag_beaten_by_an_override_is_said_and_strict_refuses_it(
    capsys, caplog, jobs, flag, override, field, value
):
    caplog.set_level(logging.INFO, logger="overlap.config")
    base = (
        "explain -m qwen -mr dense_tiny -ng 4".split()
        if field == "model.tensor_model_parallel_size"
        else TINY
    )
    argv = [
        *base,
        *flag,
        override,
        *(["model.moe_flex_dispatcher_backend=torch"] if "flex" in override else []),
    ]
    code, out, err = run([*argv, "--json"], capsys)
    assert code == 0, err
    beaten = {r["field"]: r for r in json.loads(out)["command_line"]}[field]
    assert beaten["effective"] == value and beaten["decided_by"] == "override"
    assert f"beats {flag[0]}" in beaten["reason"] and f"beats {flag[0]}" in caplog.text
    code, out, err = run([*argv, "--strict"], capsys)
    assert code == 2 and flag[0] in err and field in err


def test_a_flag_agreeing_with_an_override_is_no_decision(capsys):
    code, out, err = run([*TINY, "-gb", "8", "train.global_batch_size=8", "--json"], capsys)
    assert code == 0, err
    assert not [
        r for r in json.loads(out)["command_line"] if r["field"] == "train.global_batch_size"
    ]


def test_parallel_and_batch_flags(capsys, jobs):
    code, out, err = run(
        [
            "explain",
            "-m",
            "qwen",
            "-mr",
            "dense_tiny",
            "-ng",
            "8",
            "-pp",
            "2",
            "-vp",
            "2",
            "-gb",
            "32",
            "-mb",
            "2",
            "-sl",
            "128",
            "-ms",
            "3",
        ],
        capsys,
    )
    assert code == 0, err
    cfg = jobs[-1].cfg
    assert (
        cfg.model.pipeline_model_parallel_size,
        cfg.model.virtual_pipeline_model_parallel_size,
    ) == (2, 2)
    assert (cfg.train.global_batch_size, cfg.train.micro_batch_size, cfg.train.train_iters) == (
        32,
        2,
        3,
    )
    assert cfg.model.seq_length == 128
    plan = cfg.resolved.overlap
    assert (plan.overlap_p2p_comm, plan.batch_p2p_comm) == (True, False)


def test_recompute_flags(capsys, jobs):
    code, out, err = run([*TINY, "--recompute_modules", "core_attn,mlp"], capsys)
    assert code == 0, err
    m = jobs[-1].cfg.model
    assert (m.recompute_granularity, m.recompute_modules) == ("selective", ["core_attn", "mlp"])
    code, out, err = run([*TINY, "-rl", "1"], capsys)
    assert code == 0, err
    m = jobs[-1].cfg.model
    assert (m.recompute_granularity, m.recompute_method, m.recompute_num_layers) == (
        "full",
        "uniform",
        1,
    )


def test_flex_backend_flag_torch(capsys, jobs):
    code, out, err = run([*TINY, "--moe_flex_dispatcher_backend", "torch", "--strict"], capsys)
    assert code == 0, err
    m = jobs[-1].cfg.model
    assert (m.moe_token_dispatcher_type, m.moe_flex_dispatcher_backend) == ("flex", "torch")


def test_flex_backend_flag_none_means_alltoall_and_an_override_beats_it(capsys, caplog, jobs):
    caplog.set_level(logging.INFO, logger="overlap.config")
    code, out, err = run([*TINY, "--moe_flex_dispatcher_backend", "None"], capsys)
    assert code == 0, err
    m = jobs[-1].cfg.model
    assert (m.moe_token_dispatcher_type, m.moe_flex_dispatcher_backend) == ("alltoall", None)
    code, out, err = run(
        [
            *TINY,
            "--moe_flex_dispatcher_backend",
            "None",
            "model.moe_token_dispatcher_type=flex",
            "model.moe_flex_dispatcher_backend=torch",
        ],
        capsys,
    )
    assert code == 0 and "beats --moe_flex_dispatcher_backend" in caplog.text
    m = jobs[-1].cfg.model
    assert (m.moe_token_dispatcher_type, m.moe_flex_dispatcher_backend) == ("flex", "torch")


def test_flex_backend_flag_none_on_dense_recipe_is_fine(capsys, jobs):
    # `--moe_flex_dispatcher_backend None` asks for no flex dispatch (the reference harness command
    # passes it); on a dense recipe there is nothing to switch off, so it must not be an error.
    code, out, err = run(
        [
            "explain",
            "-m",
            "qwen",
            "-mr",
            "dense_tiny",
            "-ng",
            "2",
            "--moe_flex_dispatcher_backend",
            "None",
        ],
        capsys,
    )
    assert code == 0, err
    assert jobs[-1].cfg.model.moe_flex_dispatcher_backend is None


def test_compute_dtype_flag_does_not_silently_drop_mixed_precision_override(capsys):
    # The reference harness always passes -c; a mixed_precision.* override on the same line must
    # either take effect on top of the chosen preset or be reported as a contradiction, never be
    # dropped without a word.
    code, out, err = run(
        [*TINY, "-c", "bf16", "mixed_precision.grad_reduce_in_fp32=false", "--json"], capsys
    )
    if code == 2:
        assert "mixed_precision.grad_reduce_in_fp32" in err
        return
    assert code == 0, err
    rows = {row["field"]: row for row in json.loads(out)["decisions"]}
    assert rows["ddp.grad_reduce_in_fp32"]["effective"] is False


def test_flex_backend_flag_on_dense_recipe_falls_back_and_strict_refuses(capsys):
    args = [
        "explain",
        "-m",
        "qwen",
        "-mr",
        "dense_tiny",
        "-ng",
        "2",
        "--moe_flex_dispatcher_backend",
        "deepep",
    ]
    code, out, err = run(args, capsys)
    # the fallback is a decision row (tests/test_config_flex.py checks its reason)
    assert code == 0, err
    code, out, err = run([*args, "--strict"], capsys)
    assert code == 2
    assert "MoE" in err


def test_flex_deepep_without_gpu_is_exit_2(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for command in (
        TINY,
        ["run", *TINY[1:]],
    ):  # -g cpu: the target has no GPU; run: this machine has none
        code, out, err = run([*command, "--moe_flex_dispatcher_backend", "deepep"], capsys)
        assert code == 2
        assert "needs a CUDA GPU" in err


@pytest.mark.parametrize(
    "gpu, backend, ok",
    [
        ("h100", "deepep", True),
        ("b200", "deepep", True),
        ("gb200", "deepep", False),
        ("gb200", "hybridep", True),
        ("vr200", "hybridep", False),
        ("h100", "hybridep", True),
    ],
)
def test_explain_describes_the_target_gpu_not_this_machine(capsys, monkeypatch, gpu, backend, ok):
    # this machine: no GPU, no deep_ep
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, err = run(
        [
            "explain",
            "-m",
            "qwen",
            "-mr",
            "qwen3_30b_a3b",
            "-g",
            gpu,
            "-ng",
            "16",
            "--moe_flex_dispatcher_backend",
            backend,
        ],
        capsys,
    )
    if not ok:  # the reference's fallback to alltoall, said; refused under --strict
        assert code == 0, err
        code, out, err = run(
            [
                "explain",
                "-m",
                "qwen",
                "-mr",
                "qwen3_30b_a3b",
                "-g",
                gpu,
                "-ng",
                "16",
                "--moe_flex_dispatcher_backend",
                backend,
                "--strict",
            ],
            capsys,
        )
        assert code == 2 and "supported for" in err
        return
    assert code == 0, err
    assert _env_line(out, "CUDA_DEVICE_MAX_CONNECTIONS")[1] == "32"
    # Qwen3-30B-A3B's H100 perf recipe sets the LayerNorm margins to 10 (the rule's is 20)
    assert _env_line(out, "NVTE_FWD_LAYERNORM_SM_MARGIN")[1] == ("10" if gpu == "h100" else "20")
    assert "`overlap run` will refuse" in out and "DeepEP kernels" in out


class _Props:
    def __init__(self, name, major):
        self.name, self.major = name, major


def test_flex_deepep_on_volta_is_exit_2_under_strict(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i: _Props("Tesla V100-SXM2-32GB", 7)
    )
    code, out, err = run(
        ["run", *TINY[1:], "--moe_flex_dispatcher_backend", "deepep", "--strict"], capsys
    )
    assert code == 2
    assert "DeepEP is supported for Ampere, Hopper, and Blackwell (B200/B300) GPUs" in err


def test_flex_deepep_on_hopper_without_library_is_exit_2(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i: _Props("NVIDIA H100 80GB HBM3", 9)
    )
    real = flex.importlib.util.find_spec
    monkeypatch.setattr(
        flex.importlib.util,
        "find_spec",
        lambda name, *a, **k: None if name == "deep_ep" else real(name, *a, **k),
    )
    code, out, err = run(["run", *TINY[1:], "--moe_flex_dispatcher_backend", "hybridep"], capsys)
    assert code == 2
    assert "deep_ep" in err


def test_strict_flag(capsys):
    code, out, err = run([*TINY, "comm_overlap.tp_comm_overlap=true", "--strict"], capsys)
    assert code == 2
    assert "strict" in err and "model.tp_comm_overlap" in err
    code, out, err = run([*TINY, "comm_overlap.tp_comm_overlap=true"], capsys)
    assert code == 0, err


def test_compute_dtype_flag_sets_mixed_precision(capsys, jobs):
    code, out, err = run([*TINY, "-c", "fp16"], capsys)
    assert code == 0, err
    precision = jobs[-1].cfg.resolved.precision
    assert precision.fp16 is True and precision.bf16 is False


def test_compute_dtype_bf16_satisfies_ep_precision_check(capsys):
    code, out, err = run(
        [
            "explain",
            "-m",
            "qwen",
            "-mr",
            "qwen3_moe_tiny",
            "-ng",
            "4",
            "comm_overlap.overlap_moe_expert_parallel_comm=true",
            "-c",
            "bf16",
        ],
        capsys,
    )
    assert code == 0, err
    # -c and a whole-preset override on one command line: the override wins (said), here failing
    # EP's precision check.
    code, out, err = run(
        [
            "explain",
            "-m",
            "qwen",
            "-mr",
            "qwen3_moe_tiny",
            "-ng",
            "4",
            "mixed_precision=fp32",
            "comm_overlap.overlap_moe_expert_parallel_comm=true",
            "-c",
            "bf16",
        ],
        capsys,
    )
    assert code == 2 and "model.bf16" in err
    code, out, err = run(
        [
            "explain",
            "-m",
            "qwen",
            "-mr",
            "qwen3_moe_tiny",
            "-ng",
            "4",
            "mixed_precision=fp32",
            "comm_overlap.overlap_moe_expert_parallel_comm=true",
        ],
        capsys,
    )
    assert code == 2
    assert "model.bf16" in err


# --- launch environment in explain ----------------------------------------------------------------
def _env_line(out: str, name: str) -> list[str]:
    return next(row for row in out.splitlines() if row.startswith(name)).split()


def test_explain_launch_env_h100_tp_without_ep_overlap_is_1(capsys):
    code, out, err = run(
        [
            "explain",
            "-m",
            "qwen",
            "-mr",
            "qwen3_30b_a3b",
            "-ng",
            "16",
            "-g",
            "h100",
            "-tp",
            "2",
            "--moe_a2a_overlap",
            "false",
        ],
        capsys,
    )
    assert code == 0, err
    # -tp given: the connections are the rule's again, as run_script derives them
    assert _env_line(out, "CUDA_DEVICE_MAX_CONNECTIONS")[1:3] == ["1", "rule"]
    # the margins stay the perf recipe's (run_script derives only the connections again)
    assert _env_line(out, "NVTE_FWD_LAYERNORM_SM_MARGIN")[1:3] == ["10", "recipe"]


def test_explain_launch_env_h100_tp_with_ep_overlap_is_8(capsys):
    code, out, err = run(
        [
            "explain",
            "-m",
            "qwen",
            "-mr",
            "qwen3_30b_a3b",
            "-ng",
            "16",
            "-g",
            "h100",
            "-tp",
            "2",
            "--moe_a2a_overlap",
            "true",
        ],
        capsys,
    )
    assert code == 0, err
    assert _env_line(out, "CUDA_DEVICE_MAX_CONNECTIONS")[1] == "8"


def test_explain_launch_env_recipe_override(capsys):
    code, out, err = run(
        [*HARNESS, "env_vars.CUDA_DEVICE_MAX_CONNECTIONS=32", "env_vars.NCCL_DEBUG=INFO"], capsys
    )
    assert code == 0, err
    assert _env_line(out, "CUDA_DEVICE_MAX_CONNECTIONS")[1:3] == ["32", "recipe"]
    assert _env_line(out, "NCCL_DEBUG")[1:3] == ["INFO", "recipe"]


def test_explain_launch_env_on_cpu_is_unset(capsys):
    code, out, err = run(TINY, capsys)
    assert code == 0, err
    assert _env_line(out, "CUDA_DEVICE_MAX_CONNECTIONS")[1] == "(unset)"


def test_explain_launch_env_shows_that_the_user_environment_wins(capsys, monkeypatch):
    # `overlap run` computes the worker environment with os.environ (the user's value is never
    # overridden); `explain` must print the same plan, or it shows a value that the launch will not
    # use.
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "4")
    code, out, err = run(
        ["explain", "-m", "qwen", "-mr", "qwen3_30b_a3b", "-ng", "16", "-g", "h100", "-tp", "2"],
        capsys,
    )
    assert code == 0, err
    assert _env_line(out, "CUDA_DEVICE_MAX_CONNECTIONS")[1:4] == ["4", "user", "environment"]


# --- user mistakes: exit 2, one message, no traceback ---------------------------------------------
def test_list_recipes(capsys):
    code, out, err = run(["explain", "--list-recipes"], capsys)
    assert code == 0
    for name in RECIPES:
        assert f"-mr {name}" in out
    assert "-m qwen" in out


def test_unknown_recipe_is_exit_2(capsys):
    code, out, err = run(["explain", "-m", "qwen", "-mr", "qwen4_1t", "-ng", "4"], capsys)
    assert code == 2
    assert "unknown recipe" in err and "qwen3_30b_a3b" in err


def test_wrong_family_is_exit_2(capsys):
    code, out, err = run(["explain", "-m", "llama", "-mr", "qwen3_30b_a3b", "-ng", "16"], capsys)
    assert code == 2


@pytest.mark.parametrize("dtype", ["fp8_cs", "fp8_mx", "nvfp4"])
def test_fp8_compute_dtype_is_not_built(capsys, dtype):
    code, out, err = run([*TINY, "-c", dtype], capsys)
    assert code == 2
    assert "not built" in err


def test_unknown_compute_dtype_is_exit_2(capsys):
    code, out, err = run([*TINY, "-c", "int4"], capsys)
    assert code == 2


def test_missing_num_gpus_is_exit_2(capsys):
    code, out, err = run(["explain", "-m", "qwen", "-mr", "qwen3_moe_tiny"], capsys)
    assert code == 2
    assert "-ng" in err


def test_missing_recipe_is_exit_2(capsys):
    code, out, err = run(["explain", "-ng", "4"], capsys)
    assert code == 2


def test_unknown_flag_is_exit_2(capsys):
    code, out, err = run([*TINY, "--bogus_flag", "3"], capsys)
    assert code == 2
    assert "--bogus_flag" in err


def test_unknown_subcommand_and_no_subcommand_are_exit_2(capsys):
    assert run(["bogus"], capsys)[0] == 2
    assert run([], capsys)[0] == 2


def test_usage_error_hint_names_the_subcommand(capsys, monkeypatch):
    # main(argv) must describe argv, not the interpreter's sys.argv.
    monkeypatch.setattr(sys, "argv", ["overlap"])
    code, out, err = run([*TINY, "--bogus_flag"], capsys)
    assert code == 2
    assert "overlap explain --help" in err


@pytest.mark.parametrize(
    "argv",
    [
        [*TINY, "model.num_layrs=4"],
        [*TINY, "model.num_layers=abc"],
        [*TINY, "model.bf16=3"],
        [*TINY, "+model.num_layers=4"],
        [*TINY, "--task", "sft"],
        [*TINY, "-cv", "large_scale"],
        [*TINY, "--tokenizer_type", "HuggingFaceTokenizer"],
        ["explain", "-m", "qwen", "-mr", "qwen3_moe_tiny", "-ng", "3", "-tp", "2"],
        ["explain", "-m", "qwen", "-mr", "qwen3_30b_a3b", "-ng", "16", "-tp", "3"],
        ["explain", "-m", "qwen", "-mr", "qwen3_30b_a3b", "-ng", "16", "-ep", "32"],
        [*TINY, "-vp", "2"],
        [*TINY, "-ng", "0"],
        [*TINY, "--moe_flex_dispatcher_backend", "magic"],
        [
            *TINY,
            "--moe_a2a_overlap",
            "true",
            "comm_overlap.delay_wgrad_compute=true",
            "model.mtp_num_layers=2",
        ],
        [*TINY, "comm_overlap.delay_wgrad_compute=true"],
    ],
)
def test_user_mistakes_exit_2_without_traceback(capsys, argv):
    code, out, err = run(argv, capsys)
    assert code == 2
    assert err.startswith("overlap: error:")


def test_malformed_override_value_exits_2_without_traceback(capsys):
    code, out, err = run([*TINY, "model.num_layers=[1,2"], capsys)
    assert code == 2


@pytest.mark.parametrize("mine, other", [("ddp", "optimizer"), ("optimizer", "ddp")])
def test_an_explicit_false_distributed_optimizer_flipped_warns_and_strict_refuses(
    capsys, caplog, mine, other
):
    args = [
        "explain",
        "-m",
        "qwen",
        "-mr",
        "dense_tiny",
        "-ng",
        "2",
        f"{other}.use_distributed_optimizer=true",
        f"{mine}.use_distributed_optimizer=false",
    ]
    with caplog.at_level("WARNING", logger="overlap"):
        code, out, err = run(args, capsys)
    assert code == 0, err
    assert (
        f"{mine}.use_distributed_optimizer=false: {other}.use_distributed_optimizer is true"
        in caplog.text
    )
    code, out, err = run([*args, "--strict"], capsys)
    assert code == 2 and f"{mine}.use_distributed_optimizer=False" in err and "kept in sync" in err


@pytest.mark.parametrize(
    "override", ["model.delay_wgrad_compute=false", "comm_overlap.delay_wgrad_compute=false"]
)
def test_an_override_in_either_spelling_beats_the_perf_recipe(override, capsys):
    """Qwen3-235B-A22B's H100 BF16 perf recipe turns delay_wgrad on (as comm_overlap's); the user's
    `false`, written in either of the knob's two Bridge spellings, is what runs: the recipe's
    setting is skipped for the override, not applied over it."""
    argv = ["explain", "-m", "qwen", "-mr", "qwen3_235b_a22b", "-g", "h100", "-c", "bf16"]
    rows = decisions([*argv, "-ng", "256", "-gn", "8", override], capsys)
    row = rows["model.delay_wgrad_compute"]
    assert row["effective"] is False, row


@pytest.mark.parametrize(
    "override, effective",
    [
        ("model.bf16=false", True),
        ("optimizer.fp16=true", False),
        ("model.params_dtype=float32", "bfloat16"),
    ],
)
def test_a_precision_override_the_preset_replaces_is_said_and_refused_under_strict(
    override, effective, capsys
):
    """The mixed-precision preset (-c bf16) writes its precision onto the model and optimizer, as
    Bridge's does; a different value typed there is not what runs: a row of the table (and a
    warning), an error under --strict, never silently beaten."""
    argv = ["explain", "-m", "qwen", "-mr", "dense_tiny", "-ng", "2", "-c", "bf16", override]
    key = override.partition("=")[0]
    row = decisions(argv, capsys)[key]
    assert row["effective"] == effective and row["requested"] != effective, row
    code, _, err = run([*argv, "--strict"], capsys)
    assert code == 2 and key in err and "mixed_precision" in err, err
