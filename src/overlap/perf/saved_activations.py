"""What one transformer layer keeps for its backward, measured on real tensors, block by block.

`saved_bytes_by_block(layer, x)` runs the layer's forward with a saved-tensor hook that sees every
tensor autograd keeps, and adds each distinct storage once (its whole size: a view keeps its whole
base alive), under the block that saved it first: the norms, the attention block, the dense MLP,
the router, the dispatch (the MoE layer's permutation, all-to-all and sort), the routed experts,
the combine, the shared expert; what is saved outside every block is what selective recompute's
layer-level checkpoints keep (their inputs: they run around the norms and the MLP, before those
modules' hooks). Parameters and buffers (weights, the RoPE tables) are not
activations and are left out. The blocks are the layer's submodules and the dispatcher's steps,
timed by forward hooks and by wrapping the steps for the duration of the measurement only.

This is the measured side of the per-layer table (`overlap.launch.activations`: the bytes the
memory model counts per block, next to Megatron-Core's accounting); tests/test_activation_memory.py
holds the two to each other at small shapes on CPU tensors.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from overlap.launch.activations import (
    ATTENTION,
    CHECKPOINTS,
    COMBINE,
    DISPATCH,
    EXPERTS,
    MLP,
    NORMS,
    ROUTER,
)
from overlap.launch.activations import SHARED_EXPERT as SHARED

MODULE_BLOCKS = {
    "input_layernorm": NORMS,
    "pre_mlp_layernorm": NORMS,
    "self_attention": ATTENTION,
    "mlp": MLP,
    "mlp.router": ROUTER,
    "mlp.experts": EXPERTS,
    "mlp.shared_experts": SHARED,
}
"""A layer's submodules -> the block their saved tensors count under (innermost wins)."""

DISPATCHER_BLOCKS = {
    "dispatch_preprocess": DISPATCH,
    "token_dispatch": DISPATCH,
    "dispatch_postprocess": DISPATCH,
    "combine_preprocess": COMBINE,
    "token_combine": COMBINE,
    "combine_postprocess": COMBINE,
}
"""The MoE dispatcher's steps -> their block."""


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


@contextmanager
def _blocks_timed(layer: nn.Module, stack: list[str]) -> Iterator[None]:
    """Push a block's name on `stack` while it runs: forward hooks on the submodules, the MoE
    dispatcher's steps wrapped on the instance (removed on exit)."""
    with ExitStack() as undo:
        for path, block in MODULE_BLOCKS.items():
            try:
                module = layer.get_submodule(path)
            except AttributeError:
                continue
            if path == "mlp" and hasattr(module, "router"):
                continue  # an MoE layer: its parts are the blocks
            pre = module.register_forward_pre_hook(lambda m, a, b=block: _push(stack, b))
            post = module.register_forward_hook(lambda m, a, o: _pop(stack))
            undo.callback(pre.remove)
            undo.callback(post.remove)
        dispatcher = getattr(getattr(layer, "mlp", None), "dispatcher", None)
        if dispatcher is not None:
            for name, block in DISPATCHER_BLOCKS.items():
                setattr(dispatcher, name, _timed(getattr(dispatcher, name), block, stack))
                undo.callback(delattr, dispatcher, name)
        yield


def _push(stack: list[str], block: str) -> None:
    stack.append(block)  # a hook's result would replace the module's input


def _pop(stack: list[str]) -> None:
    stack.pop()  # a hook's result would replace the module's output


def _timed(fn: Callable[..., Any], block: str, stack: list[str]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        stack.append(block)
        try:
            return fn(*args, **kwargs)
        finally:
            stack.pop()

    return run


def saved_bytes_by_block(layer: nn.Module, x: torch.Tensor) -> dict[str, int]:
    """Bytes of the distinct storages `layer(x)`'s autograd graph keeps, by block (module
    docstring). The layer's output is returned to no one: the graph is freed on return."""
    static = {_storage_key(t) for t in (*layer.parameters(), *layer.buffers())}
    stack = [CHECKPOINTS]
    seen: set[tuple[int, int]] = set()
    by_block: dict[str, int] = defaultdict(int)

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key[1] and key not in seen and key not in static:
            seen.add(key)
            by_block[stack[-1]] += key[1]
        return t

    with _blocks_timed(layer, stack), saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    return dict(by_block)
