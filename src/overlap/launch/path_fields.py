"""Every path a run reads or writes, expanded once, the same way everywhere.

`checkpoint.save=~/x` reaches us unexpanded (the shell expands `~` only at the start of a word),
and a path relative to the launch folder means something else in a Slurm job that starts
elsewhere. If one part of the run expanded it (the pre-run check) and another did not (the ranks),
the run wrote into a literal `./~/x` and a restartable job started again from iteration 0. So the
process that first reads the command line expands every path field - `~`, then `$VAR` / `${VAR}`
(an unset one is an error, never left in the path), then made absolute against the launch folder -
before anything else reads it; the ranks it starts and the Slurm script it writes get the expanded
words (`overlap.commands`), on which expanding again changes nothing.
"""

from __future__ import annotations

import os
import re
from typing import Any

from overlap.errors import ConfigError

# the settings that name a file or folder (dataset.blend: its prefixes)
PATH_FIELDS = (
    "checkpoint.save",
    "checkpoint.load",
    "checkpoint.pretrained_checkpoint",
    "logger.tensorboard_dir",
    "logger.wandb_save_dir",
    "tokenizer.tokenizer_model",
)
BLEND_FIELD = "dataset.blend"
_UNSET = re.compile(r"\$(\w+|\{\w+\})")


def expand_path(field: str, value: str) -> str:
    """`value` with `~` and environment variables expanded, absolute (against the current folder,
    the launch folder); `field` names the setting or flag in the error for an unset variable."""
    expanded = os.path.expandvars(os.path.expanduser(value))
    unset = _UNSET.search(expanded)
    if unset:
        name = unset.group(1).strip("{}")
        raise ConfigError(
            field,
            value,
            f"it names the environment variable ${name}, which is not set here (left in, it would "
            "become part of the folder's name).",
            f"set {name} in the launching environment, or write the path out.",
        )
    return os.path.abspath(expanded) if expanded else expanded


def expand_path_fields(cfg: Any) -> dict[str, Any]:
    """Expand every path field of the configuration `cfg` in place; returns the changed fields and
    their new values (what the command line's words must say from now on)."""
    from overlap.data.gpt_dataset import parse_blend

    changed: dict[str, Any] = {}
    for key in PATH_FIELDS:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if isinstance(value, str) and value.strip():
            new = expand_path(key, value)
            if new != value:
                setattr(getattr(cfg, section), name, new)
                changed[key] = new
    blend = cfg.dataset.blend
    if blend is not None:
        prefixes, weights = parse_blend(blend)
        new = [[expand_path(BLEND_FIELD, p) for p in prefixes], weights]
        if blend != new:
            cfg.dataset.blend = new
            changed[BLEND_FIELD] = new
    return changed
