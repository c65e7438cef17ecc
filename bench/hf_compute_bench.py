"""Our single-rank compute next to the reference implementation: forward + backward of one
micro-batch, our model vs transformers' eager `Qwen3MoeForCausalLM` / `Qwen3ForCausalLM`, with the
same weights (saved by transformers with `save_pretrained`, loaded into ours through `overlap.hf`),
one compute thread, fp32 and bf16.

Each repeat times one step of each implementation, the order alternating between repeats (A B, B A,
...), so drift of the machine lands on both; the table gives the median per step and the ratio ours
/ transformers. The first `--warmup` steps of each are not counted. The loss of both is printed once
as a check that the weights arrived.

    python bench/hf_compute_bench.py --markdown bench/results/hf_compute.md --json
    bench/results/hf_compute.json

Both run in one process, so each step starts from the heap the other's step left. With glibc's
default (a large allocation is mmapped below a threshold that moves with what was freed), our step
paid 4096 minor page faults after every transformers step - the 16 MB embedding gradient's pages,
fresh each time, about 20 ms or 2% of the step
- and 4 when run alone; transformers' step paid none. `--heap fixed` (the default) therefore fixes
  glibc's mmap
threshold at its maximum (32 MB) and its trim threshold at 1 GB for the whole process, for both
implementations alike, so that neither pays for the other's heap (the mmap threshold alone is not
enough: fixing it also fixes the trim threshold at its 128 KB default, and transformers' step then
paid ~12000 faults); `--heap default` leaves the allocator alone. The table reports the minor faults
per step of each; with the heap fixed, both pay about none.

What it measures is compute only (one rank, no communication): the cost of our layer structure
(pieces with autograd cut at their boundaries are not used here: the plain model forward), the
grouped experts and the loss, against the library our users know.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from overlap.perf.machine import describe_machine, machine_line


def _hf_model(kind: str, args: argparse.Namespace, dtype: torch.dtype):
    import transformers

    common = dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        attn_implementation="eager",
        max_position_embeddings=max(4096, args.seq),
    )
    torch.manual_seed(0)
    if kind == "moe":
        cfg = transformers.Qwen3MoeConfig(
            **common,
            moe_intermediate_size=args.moe_ffn,
            num_experts=args.experts,
            num_experts_per_tok=args.topk,
            norm_topk_prob=True,
        )
        model = transformers.Qwen3MoeForCausalLM(cfg)
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    return model.to(dtype)


def _ours(folder: Path, seq: int, dtype: torch.dtype, attention_backend: str):
    from overlap.config import ConfigContainer
    from overlap.hf.config_json import model_config_from_hf, read_hf_config
    from overlap.hf.load import load_hf_weights
    from overlap.model.gpt import model_chunks
    from overlap.parallel.state import ParallelState

    model = model_config_from_hf(read_hf_config(folder), seq_length=seq)
    model.moe_aux_loss_coeff = 0.0  # transformers computes no aux loss without output_router_logits
    # the vectorised permutation, as the Qwen3 recipes run it (config.json has no say)
    model.moe_permute_fusion = True
    model.attention_backend = attention_backend
    precision = "bf16_mixed" if dtype == torch.bfloat16 else "fp32"
    cfg = ConfigContainer(model=model, mixed_precision=precision)
    res = cfg.finalize(1, on_cuda=False)  # the comparison runs on this CPU
    ps = ParallelState(res.layout)
    (chunk,) = model_chunks(res.model, ps, res.pipeline, res.overlap, res.precision, res.kernels)
    load_hf_weights(res.model, dict(chunk.named_parameters()), folder)
    return chunk


def _step_hf(model, tokens, labels) -> float:
    logits = model(input_ids=tokens).logits
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1)
    )
    loss.backward()
    return loss.item()


def _step_ours(model, tokens, labels) -> float:
    loss, _aux = model(tokens, labels)
    loss.backward()
    return loss.item()


def _fix_heap_thresholds() -> None:
    """glibc's mallopt: M_MMAP_THRESHOLD 32 MB (allocations up to 32 MB come from the heap, and the
    threshold stops moving with what was freed) and M_TRIM_THRESHOLD 1 GB (freed heap stays mapped);
    see the module docstring."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError as err:
        raise SystemExit(f"--heap fixed needs glibc ({err}); run with --heap default") from err
    for name, option, value in (
        ("M_MMAP_THRESHOLD", -3, 32 << 20),
        ("M_TRIM_THRESHOLD", -1, 1 << 30),
    ):
        if libc.mallopt(option, value) != 1:
            raise SystemExit(f"--heap fixed: mallopt({name}) was refused; run with --heap default")


def _measure(kind: str, dtype: torch.dtype, args: argparse.Namespace) -> list[dict]:
    """One row per attention backend of ours, each against the same transformers steps (all
    alternated)."""
    backends = args.attention_backends.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        hf = _hf_model(kind, args, dtype)
        hf.save_pretrained(tmp)
        models = {"transformers": hf, **{b: _ours(Path(tmp), args.seq, dtype, b) for b in backends}}
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    labels = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    times: dict[str, list[float]] = {name: [] for name in models}
    faults: dict[str, list[int]] = {name: [] for name in models}
    losses = {}
    for i in range(args.warmup + args.repeats):
        order = list(models) if i % 2 == 0 else list(reversed(models))
        for name in order:
            model = models[name]
            for p in model.parameters():
                p.grad = None
            step = _step_hf if name == "transformers" else _step_ours
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            losses[name] = step(model, tokens, labels)
            elapsed = time.perf_counter() - t0
            if i >= args.warmup:
                times[name].append(elapsed * 1e3)
                faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    med = {name: statistics.median(t) for name, t in times.items()}
    ref = "transformers"
    return [
        {
            "model": kind,
            "dtype": str(dtype).removeprefix("torch."),
            "attention_backend": b,
            "ours_ms": med[b],
            "transformers_ms": med[ref],
            "ratio": med[b] / med[ref],
            "ours_min_ms": min(times[b]),
            "transformers_min_ms": min(times[ref]),
            "loss_ours": losses[b],
            "loss_transformers": losses[ref],
            # Each repeat's steps ran back to back, so their ratio is free of the machine's slower
            # drift.
            "pair_ratio_median": statistics.median(a / r for a, r in zip(times[b], times[ref])),
            "ours_faults_per_step": statistics.median(faults[b]),
            "transformers_faults_per_step": statistics.median(faults[ref]),
            "ours_all_ms": times[b],
            "transformers_all_ms": times[ref],
        }
        for b in backends
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=1536, help="dense MLP width")
    parser.add_argument("--moe-ffn", type=int, default=384, help="expert MLP width")
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--models", default="moe,dense")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument(
        "--attention-backends",
        default="auto",
        help="comma-separated model.attention_backend values of ours, each its own row (auto, "
        "flash, unfused; see overlap.kernels.attention)",
    )
    parser.add_argument(
        "--heap",
        choices=("fixed", "default"),
        default="fixed",
        help="fixed: glibc's mmap (32 MB) and trim (1 GB) thresholds fixed for both (see above); "
        "default: as is",
    )
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.heap == "fixed":
        _fix_heap_thresholds()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    rows = [
        row
        for kind in args.models.split(",")
        for dt in args.dtypes.split(",")
        for row in _measure(kind, getattr(torch, dt), args)
    ]
    dist.destroy_process_group()
    command = "python bench/hf_compute_bench.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    machine = describe_machine()
    lines = [
        f"Command: `{command}`  ",
        f"{machine_line(machine)}  ",
        f"Shapes: hidden {args.hidden}, {args.layers} layers, {args.heads} heads ({args.kv_heads} "
        "KV), "
        f"sequence {args.seq}, micro-batch {args.batch}, vocabulary {args.vocab}; MoE: "
        f"{args.experts} experts top-{args.topk}, expert width {args.moe_ffn}; dense MLP width "
        f"{args.ffn}. One thread, {args.repeats} alternated steps each after {args.warmup} warm-up "
        "steps; median ms per forward + "
        'backward; "per pair": the median of each repeat\'s ours / transformers (the steps of one '
        "repeat ran "
        f"back to back). Heap: {args.heap} (see the script's docstring); faults: median minor page "
        "faults per "
        f"step.",
        "",
        "| model | dtype | attention (ours) | ours ms | transformers ms | ours / transformers | "
        "per pair | loss ours | loss transformers | faults ours | faults transformers |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['dtype']} | {r['attention_backend']} | {r['ours_ms']:.1f} | "
            f"{r['transformers_ms']:.1f} | {r['ratio']:.3f} | {r['pair_ratio_median']:.3f} | "
            f"{r['loss_ours']:.4f} | {r['loss_transformers']:.4f} | "
            f"{r['ours_faults_per_step']:.0f} | {r['transformers_faults_per_step']:.0f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)
    if args.json:
        Path(args.json).write_text(
            json.dumps({"command": command, "machine": machine, "rows": rows}, indent=2) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
