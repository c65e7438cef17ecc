"""The `--moe_flex_dispatcher_backend` flag: flex token dispatch with a backend, written onto the
model config as the reference harness does. Which dispatcher then runs on the run's device is
decided by finalize (`overlap.kernels.flex_backend`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from overlap.errors import ConfigError
from overlap.kernels.flex_backend import FLEX_BACKENDS

if TYPE_CHECKING:
    from overlap.config.model import ModelConfig

log = logging.getLogger("overlap.config")


def apply_flex_dispatcher_backend(model: ModelConfig, backend: str | None) -> None:
    """What the `--moe_flex_dispatcher_backend` flag does: select flex dispatch with `backend`
    (None: alltoall).

    As the reference, a dense model or an unsupported GPU falls back to the alltoall dispatcher -
    decided in the validation (`overlap.kernels.flex_backend.validate_flex_dispatcher_backend`),
    where it is a logged decision with a warning, an error under strict mode.
    """
    if backend is not None and backend not in FLEX_BACKENDS:
        raise ConfigError(
            "model.moe_flex_dispatcher_backend",
            backend,
            "unknown flex dispatcher backend.",
            f"use one of {', '.join(FLEX_BACKENDS)} or None.",
        )
    model.moe_flex_dispatcher_backend = backend
    if backend is None:
        model.moe_token_dispatcher_type = "alltoall"
        return
    model.moe_token_dispatcher_type = "flex"
    if model.moe_shared_expert_overlap:
        log.warning(
            "flex dispatch: turning moe_shared_expert_overlap off (the flex dispatcher does not "
            "support it)"
        )
        model.moe_shared_expert_overlap = False
