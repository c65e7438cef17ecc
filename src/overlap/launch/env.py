"""Launch-time environment for worker processes: which variables, which values, and who decided.

Why this lives in the launcher and not in the training config: CUDA reads
``CUDA_DEVICE_MAX_CONNECTIONS`` once, when a process creates its CUDA context. Setting it from
Python inside a worker that already touched CUDA has no effect, which is why Megatron-Bridge removed
the ``os.environ`` writes from ``CommOverlapConfig.setup()`` (PR #925). The variables here are
therefore computed by the launcher and written into the worker environment *before* the workers
start.

The rules follow Bridge HEAD (``run_script.py::_apply_flat_cli_environment_compatibility``, the same
logic as the perf ``PerfEnvPlugin`` in Bridge's ``scripts/performance``):

- ``CUDA_DEVICE_MAX_CONNECTIONS`` starts at 8; 32 with flex dispatch on the deepep/hybridep
  backends; then 32 on SM100-class GPUs (b200, b300, gb200, gb300, vr200); otherwise 1 when TP>1 or
  CP>1 and MoE all-to-all overlap is off.
- ``NVTE_FWD_LAYERNORM_SM_MARGIN`` / ``NVTE_BWD_LAYERNORM_SM_MARGIN``: 20 with deepep/hybridep flex
  dispatch, else 16.

Precedence, lowest to highest: rule, recipe (the config's ``env_vars``), user environment. A
variable already set in the environment the user launched from is never overridden: it is the only
way to override a rule without editing a recipe, and silently replacing it would hide the user's own
experiment.

Everything here is a pure function of plain values and the run's parallel layout (no torch, no
config package), so the launcher can print the plan before anything starts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass

from overlap.errors import ConfigError
from overlap.kernels.flex_backend import GPU_BACKENDS  # DeepEP's: more hardware queues, free SMs
from overlap.layout import ParallelLayout

CUDA_DEVICE_MAX_CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"
NVTE_FWD_LAYERNORM_SM_MARGIN = "NVTE_FWD_LAYERNORM_SM_MARGIN"
NVTE_BWD_LAYERNORM_SM_MARGIN = "NVTE_BWD_LAYERNORM_SM_MARGIN"

#: The variables the rules decide, in output order.
RULE_VARIABLES = (
    CUDA_DEVICE_MAX_CONNECTIONS,
    NVTE_FWD_LAYERNORM_SM_MARGIN,
    NVTE_BWD_LAYERNORM_SM_MARGIN,
)

#: Values of ``-g/--gpu``. "cpu" runs all ranks on the local machine over gloo.
VALID_ACCELERATORS = ("cpu", "h100", "b200", "b300", "gb200", "gb300", "vr200", "r100")

#: GPUs for which Bridge HEAD sets 32 connections unconditionally (SM100 and newer in its list).
SM100_CLASS_ACCELERATORS = frozenset({"b200", "b300", "gb200", "gb300", "vr200"})

# GPUs per node of the standard systems (Bridge ``-gn`` inference): DGX H100/B200/B300 have 8,
# GB200/GB300/VR200 NVL trays 4, R100 is counted per GPU.
_GPUS_PER_NODE = {"h100": 8, "b200": 8, "b300": 8, "gb200": 4, "gb300": 4, "vr200": 4, "r100": 1}

_USER_ENV_REASON = "set in the launching environment; never overridden"


@dataclass(frozen=True)
class EnvSetting:
    """One environment variable for the workers.

    ``source`` is "rule", "recipe" or "user environment". ``value`` None means "leave unset".
    """

    name: str
    value: str | None
    source: str
    reason: str


@dataclass(frozen=True)
class LaunchEnvInputs:
    """What the rules look at: the resolved layout's sizes and plain values, so this module does
    not depend on the config package."""

    accelerator: str
    layout: ParallelLayout
    moe_flex_dispatcher_backend: str | None
    moe_token_dispatcher_type: str
    overlap_moe_expert_parallel_comm: bool


def _check_accelerator(accelerator: str) -> str:
    name = accelerator.strip().lower() if isinstance(accelerator, str) else accelerator
    if name not in VALID_ACCELERATORS:
        raise ConfigError(
            field="--gpu",
            value=accelerator,
            why=(
                "unknown accelerator; the launch rules and node layout are defined per accelerator."
            ),
            fix=f"pass -g/--gpu with one of: {', '.join(VALID_ACCELERATORS)}.",
        )
    return name


def _fast_flex_backend(inp: LaunchEnvInputs) -> str | None:
    """The deepep/hybridep backend name when tokens go through the flex dispatcher with it, else
    None."""
    backend = (inp.moe_flex_dispatcher_backend or "").lower()
    if inp.moe_token_dispatcher_type == "flex" and backend in GPU_BACKENDS:
        return backend
    return None


def _connections_rule(
    inp: LaunchEnvInputs, accelerator: str, flex_backend: str | None
) -> EnvSetting:
    """CUDA_DEVICE_MAX_CONNECTIONS: the number of hardware work queues CUDA uses per device."""
    if flex_backend is not None:
        value = "32"
        reason = (
            f"flex dispatcher with the {flex_backend} backend: 32 connections so its "
            "dispatch/combine kernels are not serialized behind compute streams"
        )
    else:
        value = "8"
        reason = (
            "default: 8 connections (the CUDA default) let compute and communication streams run "
            "concurrently"
        )

    sizes = (("TP", inp.layout.tp), ("CP", inp.layout.cp))
    labels = [label for label, size in sizes if size > 1]
    tp_or_cp = [f"{label}>1" for label in labels]
    if accelerator in SM100_CLASS_ACCELERATORS:
        value = "32"
        reason = (
            f"{accelerator} is SM100-class: 32 connections avoid stream serialization "
            "(Bridge sets 32 unconditionally on these GPUs)"
        )
    elif tp_or_cp and not inp.overlap_moe_expert_parallel_comm:
        value = "1"
        reason = (
            f"{' and '.join(tp_or_cp)} without EP overlap on {accelerator} (pre-SM100 rule): 1 "
            "connection keeps "
            f"kernel queue order = launch order so the {'/'.join(labels)} comm "
            "kernel is scheduled before the overlapping GEMM"
        )
    elif tp_or_cp:
        reason += (
            f"; kept with {' and '.join(tp_or_cp)} because MoE all-to-all overlap is on and needs "
            "its communication and compute streams to run concurrently, which a single connection "
            "would serialize"
        )
    return EnvSetting(CUDA_DEVICE_MAX_CONNECTIONS, value, "rule", reason)


def _layernorm_margin_rules(flex_backend: str | None) -> list[EnvSetting]:
    """Transformer Engine LayerNorm SM margins: SMs the LayerNorm kernels leave free for overlapping
    communication."""
    if flex_backend is not None:
        value = "20"
        reason = (
            f"leave 20 SMs free while LayerNorm runs: DP communication overlap plus {flex_backend} "
            "dispatch kernels need SMs of their own"
        )
    else:
        value = "16"
        reason = "leave 16 SMs free while LayerNorm runs, for DP communication overlap"
    return [
        EnvSetting(name, value, "rule", reason)
        for name in (NVTE_FWD_LAYERNORM_SM_MARGIN, NVTE_BWD_LAYERNORM_SM_MARGIN)
    ]


def _recipe_value(name: str, value: object) -> str:
    # Hydra overrides such as env_vars.CUDA_DEVICE_MAX_CONNECTIONS=32 can arrive as int; the
    # environment holds text.
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(
        field=f"env_vars.{name}",
        value=value,
        why="environment variables hold text; this value is neither a string nor an integer.",
        fix=f"give env_vars.{name} a string value, e.g. env_vars.{name}='1'.",
    )


def compute_launch_env(
    inp: LaunchEnvInputs,
    recipe_env: Mapping[str, str] | None = None,
    user_env: Mapping[str, str] | None = None,
) -> list[EnvSetting]:
    """Decide the worker environment: rule values, replaced by the recipe's ``env_vars``, then by
    the user's env.

    ``user_env`` is the environment the launcher was started from (normally ``os.environ``); any
    variable named by a rule or the recipe that is already set there keeps the user's value. Output
    order is stable: the three rule variables first, then the recipe's other variables sorted by
    name.

    On "cpu" the three rule variables are CUDA / Transformer Engine settings with no effect, so they
    are reported with value None (left unset) rather than silently omitted.
    """
    accelerator = _check_accelerator(inp.accelerator)

    settings: dict[str, EnvSetting] = {}
    if accelerator == "cpu":
        for name in RULE_VARIABLES:
            settings[name] = EnvSetting(
                name,
                None,
                "rule",
                "CUDA/Transformer Engine setting, not applicable on CPU (gloo); left unset",
            )
    else:
        flex_backend = _fast_flex_backend(inp)
        settings[CUDA_DEVICE_MAX_CONNECTIONS] = _connections_rule(inp, accelerator, flex_backend)
        for setting in _layernorm_margin_rules(flex_backend):
            settings[setting.name] = setting

    for name, raw in (recipe_env or {}).items():
        value = _recipe_value(name, raw)
        previous = settings.get(name)
        if previous is None:
            reason = "set by the recipe's env_vars"
        else:
            shown = "unset" if previous.value is None else previous.value
            reason = f"set by the recipe's env_vars (replaces the rule value {shown})"
        settings[name] = EnvSetting(name, value, "recipe", reason)

    if user_env:
        for name in list(settings):
            if name in user_env:
                settings[name] = EnvSetting(
                    name, user_env[name], "user environment", _USER_ENV_REASON
                )

    extra = sorted(name for name in settings if name not in RULE_VARIABLES)
    return [settings[name] for name in (*RULE_VARIABLES, *extra)]


def apply_launch_env(settings: Iterable[EnvSetting], env: MutableMapping[str, str]) -> None:
    """Write the decided values into a worker environment ``env`` before the workers are started.

    Settings with value None are skipped, and a name already present in ``env`` is never
    overwritten: the worker environment is normally a copy of the launcher's own, where the user's
    values must win.
    """
    for setting in settings:
        if setting.value is None or setting.name in env:
            continue
        env[setting.name] = setting.value


def format_launch_env(settings: Iterable[EnvSetting]) -> str:
    """An aligned text table (variable, value, source, reason) for the start-up log."""
    rows = [("variable", "value", "source", "reason")]
    rows += [
        (s.name, "(unset)" if s.value is None else s.value, s.source, s.reason) for s in settings
    ]
    widths = [max(len(row[col]) for row in rows) for col in range(3)]
    lines = []
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row[:3], widths)]
        lines.append("  ".join([*cells, row[3]]).rstrip())
    return "\n".join(lines)


def default_gpus_per_node(accelerator: str, num_gpus: int) -> int:
    """Ranks per node when ``-gn/--gpus_per_node`` is not given.

    GPU systems use the node size of the standard machine (h100/b200/b300: 8; gb200/gb300/vr200: 4;
    r100: 1), as Bridge infers it. On "cpu" every rank runs on the local machine, so the answer is
    ``num_gpus`` itself.
    """
    name = _check_accelerator(accelerator)
    if name == "cpu":
        if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 1:
            raise ConfigError(
                field="--num_gpus",
                value=num_gpus,
                why="the number of ranks must be a positive integer.",
                fix="pass -ng/--num_gpus N with N >= 1 (the number of local CPU ranks).",
            )
        return num_gpus
    return _GPUS_PER_NODE[name]
