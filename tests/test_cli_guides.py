"""The guides' own commands work as written, `explain` describes the target cluster, and no switch
is "on" while it does nothing (issue 9): each case as a CLI call, checking the exit code, the
message and that no traceback shows."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

import pytest

from overlap.cli import main
from overlap.harness import add_harness_flags


def run(argv, capsys):
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "Traceback" not in out
    return code, out, err


def explain_json(argv, capsys) -> dict:
    code, out, err = run(["explain", *argv, "--json"], capsys)
    assert code == 0, err
    return json.loads(out)


# --- explain describes the target -----------------------------------------------------------------
def test_the_tp_dp_pp_guides_shape_rederives_the_recipes_ep(capsys):
    doc = explain_json("-m qwen -mr qwen3_30b_a3b -g h100 -ng 32 -tp 4 -pp 4 -vp 2".split(), capsys)
    assert doc["layout"]["ep"] == 8 and doc["layout"]["pp"] == 4 and doc["layout"]["vpp"] == 2
    rule = {r["field"]: r for r in doc["command_line"]}["model.expert_model_parallel_size"]
    assert rule["decided_by"] == "recipe" and "ranks per pipeline stage 8" in rule["reason"]
    # PP is built
    assert not any(r["field"] == "model.pipeline_model_parallel_size" for r in doc["run_refuses"])


def test_an_explicit_ep_is_never_rederived(capsys):
    doc = explain_json("-m qwen -mr qwen3_30b_a3b -g h100 -ng 32 -pp 2 -ep 4".split(), capsys)
    assert doc["layout"]["ep"] == 4
    assert "model.expert_model_parallel_size" not in {r["field"] for r in doc["command_line"]}


def test_a_configuration_only_the_runtime_refuses_is_explained_and_refused_by_run(capsys):
    argv = "-m qwen -mr qwen3_moe_tiny -ng 2 -tp 2 -ep 1 model.sequence_parallel=false".split()
    code, out, err = run(["explain", *argv], capsys)
    assert code == 0, err
    assert "`overlap run` will refuse" in out and "model.sequence_parallel=False" in out
    code, out, err = run(["run", *argv], capsys)
    assert code == 2 and "model.sequence_parallel" in err and "not built" in err


def test_moe_tp_without_sp_with_ep_is_the_references_error(capsys):
    code, out, err = run(
        "explain -m qwen -mr qwen3_moe_tiny -ng 4 -tp 2 -ep 2 "
        "model.sequence_parallel=false".split(),
        capsys,
    )
    assert code == 2 and "sequence parallelism must be used" in err


# --- the decision table is consistent -------------------------------------------------------------
def test_explicit_shared_expert_overlap_false_is_the_users_request(capsys):
    doc = explain_json(
        "-m qwen -mr qwen3_moe_tiny -ng 4 model.moe_shared_expert_overlap=false".split(), capsys
    )
    row = {r["field"]: r for r in doc["decisions"]}["model.moe_shared_expert_overlap"]
    assert (row["requested"], row["effective"], row["decided_by"]) == (False, False, "override")
    doc = explain_json("-m qwen -mr qwen3_moe_tiny -ng 4".split(), capsys)
    row = {r["field"]: r for r in doc["decisions"]}["model.moe_shared_expert_overlap"]
    assert (row["requested"], row["effective"], row["decided_by"]) == (None, False, "default")


def test_other_settings_name_their_source(capsys):
    doc = explain_json(
        "-m qwen -mr qwen3_moe_tiny -ng 4 -c bf16 -mb 1 model.moe_permute_fusion=false".split(),
        capsys,
    )
    other = {r["field"]: r for r in doc["other_settings"]}
    assert other["model.moe_permute_fusion"] == {
        "field": "model.moe_permute_fusion",
        "value": False,
        "source": "override",
    }
    assert (
        other["mixed_precision"]["value"] == "bf16_mixed"
        and other["mixed_precision"]["source"] == "flag -c"
    )
    assert other["train.micro_batch_size"]["source"] == "flag -mb"
    assert other["ddp.use_distributed_optimizer"]["source"] == "recipe"


# --- no silent no-ops -----------------------------------------------------------------------------
DENSE2 = "-m qwen -mr dense_tiny -ng 2".split()


@pytest.mark.parametrize(
    "switch",
    [
        "ddp.overlap_grad_reduce=true",
        "ddp.use_distributed_optimizer=true optimizer.use_distributed_optimizer=true "
        "ddp.overlap_param_gather=true ddp.overlap_grad_reduce=false",
    ],
)
def test_dp_overlap_with_a_single_bucket_is_a_noop_with_a_suggested_bucket_size(capsys, switch):
    doc = explain_json([*DENSE2, *switch.split(), "ddp.bucket_size=100000000"], capsys)
    (noop,) = doc["noops"]
    field = (
        "ddp.overlap_grad_reduce" if "grad_reduce=true" in switch else "ddp.overlap_param_gather"
    )
    assert noop["field"] == field
    assert "1 bucket of" in noop["why"] and "nothing overlaps" in noop["why"]
    suggested = noop["fix"].split("ddp.bucket_size=")[1].split()[0]
    # The suggestion really gives several buckets, and then nothing is reported.
    doc = explain_json([*DENSE2, *switch.split(), f"ddp.bucket_size={suggested}"], capsys)
    assert doc["noops"] == []
    code, out, err = run(
        ["explain", *DENSE2, *switch.split(), "ddp.bucket_size=100000000", "--strict"], capsys
    )
    assert code == 2 and field in err and "does nothing" in err


def test_the_noop_section_is_in_the_text_table(capsys):
    code, out, err = run(["explain", *DENSE2, "ddp.overlap_grad_reduce=true"], capsys)
    assert code == 0, err
    assert "Switches that are on but do nothing here:" in out and "ddp.overlap_grad_reduce" in out


@pytest.mark.parametrize(
    "argv, field",
    [
        (
            "-m qwen -mr qwen3_moe_tiny -ng 1 model.moe_shared_expert_intermediate_size=64 "
            "model.moe_shared_expert_overlap=true",
            "model.moe_shared_expert_overlap",
        ),
        ("-m qwen -mr dense_tiny -ng 2 model.overlap_p2p_comm=true", "model.overlap_p2p_comm"),
        ("-m qwen -mr dense_tiny -ng 2 ddp.align_param_gather=true", "ddp.align_param_gather"),
    ],
)
def test_layout_noops_are_said_and_refused_under_strict(capsys, argv, field):
    doc = explain_json(argv.split(), capsys)
    assert field in {n["field"] for n in doc["noops"]}
    code, out, err = run(["explain", *argv.split(), "--strict"], capsys)
    assert code == 2 and field in err


def test_a_working_overlap_reports_no_noop(capsys):
    doc = explain_json([*DENSE2, "ddp.overlap_grad_reduce=true", "ddp.bucket_size=500000"], capsys)
    assert doc["noops"] == []


# --- help, version, listings ----------------------------------------------------------------------
def test_every_harness_flag_has_help():
    parser = argparse.ArgumentParser()
    add_harness_flags(parser)
    missing = [
        a.option_strings or a.dest for a in parser._actions if not a.help and a.dest != "help"
    ]
    assert missing == []


def test_version(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.startswith("overlap ")


def test_list_recipes_and_keys_end_with_a_newline(capsys):
    code, out, _ = run(["explain", "--list-recipes"], capsys)
    assert code == 0 and out.endswith("\n") and "qwen3_moe_tiny" in out
    code, out, _ = run(["explain", "--list-keys"], capsys)
    assert code == 0 and out.endswith("\n")
    keys = {line.split()[0]: line.split()[1] for line in out.splitlines()}
    assert keys["model.num_layers"] == "int" and keys["ddp.bucket_size"] == "int"
    assert "comm_overlap.overlap_moe_expert_parallel_comm" in keys and "env_vars.NAME" in keys


def test_the_start_up_log_of_a_run_repeats_the_beaten_flag():
    """A real run (1 rank, 1 tiny step): the sections are logged at start-up, on stderr."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "overlap.cli",
            "run",
            "-m",
            "qwen",
            "-mr",
            "dense_tiny",
            "-ng",
            "1",
            "-ms",
            "2",
            "-gb",
            "1",
            "-mb",
            "1",
            "-sl",
            "32",
            "train.train_iters=1",
            "model.num_layers=1",
            "model.hidden_size=64",
            "model.ffn_hidden_size=128",
            "model.vocab_size=256",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "train.train_iters=1 beats -ms/--max_steps 2" in out.stderr
    # the override really won: one iteration of one
    assert re.search(r"iteration\s+1/1\s", out.stderr)
    assert "Overlap decisions:" in out.stderr and "Other settings" in out.stderr
