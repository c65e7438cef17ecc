"""The compatibility-only knobs: Megatron-Bridge settings a user may type that this runtime refuses
by name instead of ignoring, in one table.

Three kinds: a key kept elsewhere here (`MOVED`: the error names where), a Bridge switch that is not
carried (`NOT_CARRIED`: nothing here would act on it), and a value the reference accepts whose
implementation is not built (`UNBUILT_VALUES`: a `NotBuiltError`). The override parser and the
section checks raise from this table; `overlap explain --list-keys` lists it.
"""

from __future__ import annotations

from typing import Any

from overlap.errors import NotBuiltError, Rule

_FIXED_SET = (
    "TensorBoard and W&B always get the --metrics scalars (loss, grad norm, learning rate, step "
    "time, throughput, communication by kind, peak memory), and only those"
)

# key -> the key that holds the setting here
MOVED = {"train.log_interval": "logger.log_interval"}  # where Bridge keeps it

# key -> why there is nothing for it to do
NOT_CARRIED = {
    f"logger.{name}": _FIXED_SET
    for name in (
        "log_timers_to_tensorboard",
        "log_memory_to_tensorboard",
        "log_throughput",
        "log_throughput_to_tensorboard",
        "log_params_norm",
        "log_num_zeros_in_grad",
        "log_loss_scale_to_tensorboard",
        "log_validation_ppl_to_tensorboard",
        "log_world_size_to_tensorboard",
        "log_l2_norm_grad_to_tensorboard",
        "log_runtime_to_tensorboard",
        "log_energy",
        "log_progress",
        "timing_log_level",
        "timing_log_option",
        "throughput_window_size",
        "memory_keys",
    )
}

# key -> {a value the reference accepts: what it needs that is not built here}
UNBUILT_VALUES: dict[str, dict[Any, str]] = {
    "model.recompute_modules": {
        "mla_up_proj": "Multi-latent attention (MLA), whose up projection mla_up_proj recomputes,",
        "gdn_norm_out": "The gated delta net (gdn_norm_out recomputes its output norm)",
        "gdp_in_proj": "The gated delta product (gdp_in_proj recomputes its input projection)",
        "gdp_qkv": "The gated delta product (gdp_qkv recomputes its convolution and QKV)",
        "mhc": "Hyper-connections (mhc recomputes their activations)",
    },
    "checkpoint.ckpt_format": {
        name: f"The {name!r} checkpoint format"
        for name in ("torch", "torch_dcp", "fsdp_dtensor", "zarr")
    },
    "tokenizer.tokenizer_type": {"SentencePieceTokenizer": "The SentencePiece tokenizer"},
}


def unbuilt(key: str, value: Any) -> str | None:
    """What `key=value` needs that is not built here (the NotBuiltError's subject), or None."""
    return UNBUILT_VALUES.get(key, {}).get(value)


def one_of(key: str, value: Any, allowed: tuple, why: str, fix: str, unbuilt_fix: str) -> Rule:
    """The rule that `value` is one of `allowed`: a value the reference accepts whose runtime is not
    built here (`UNBUILT_VALUES`) breaks it as a NotBuiltError fixed by `unbuilt_fix`, any other as
    a ConfigError (`why`, `fix`)."""
    what = value not in allowed and unbuilt(key, value)
    if what:
        return (key, value, False, what, unbuilt_fix, NotBuiltError)
    return (key, value, value in allowed, why, fix)


def refusal_rows() -> list[tuple[str, str]]:
    """(key or key=value, why it is refused) for every entry of the table, for `--list-keys`."""
    rows = [(key, f"the setting is {where} here") for key, where in MOVED.items()]
    rows += [(key, f"not carried: {why}") for key, why in NOT_CARRIED.items()]
    rows += [
        (f"{key}={value}", f"{what.rstrip(',')} is not built")
        for key, values in UNBUILT_VALUES.items()
        for value, what in values.items()
    ]
    return rows
