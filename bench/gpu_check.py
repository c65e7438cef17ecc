"""The GPU check: one short prepared run on a machine with one CUDA GPU (bench/gpu_check.sh runs
it), from the source tree against that machine's own PyTorch (torch >= 2.11), every GPU step started
through torchrun as a GPU run is. One GPU cannot host two NCCL ranks, so every step is single-rank:

1. env       - the machine: GPU, torch, CUDA, NCCL versions, the torch APIs the runtime relies on
               and the path each took (`torch_apis`); the experts' grouped GEMM against their
               per-expert loop in bf16 (forward + backward, one Qwen3-30B-A3B fc1 of 8 local
               experts): agreement and ms each; each elementwise chain compiled (torch.compile,
               inductor) against eager at Qwen3-30B-A3B's shapes in bf16 (forward + backward):
               agreement and ms each (the evidence for the fusions' CUDA default).
2. nccl      - a one-rank NCCL world (device-bound): `batch_isend_irecv` gives one work for a whole
   batch (our handles
               share it, the GPU timeline times it, and a send is dropped only once the device
               reports it complete), a collective queued behind GEMMs has a future that completes at
               enqueue and a `wait()` that does not block the host, and the GPU-timeline tracer
               (CUDA events) times it on the device: launched after the GEMMs, done after its
               launch, with a positive duration.
3. sync      - one training step of the tiny MoE recipe (one rank: the all-to-all path without
   peers) under
               `torch.cuda.set_sync_debug_mode("warn")`: every host synchronisation by source line,
               each intended one (the split sizes, the logged loss, the gradient norm) allowed by
               name; any other fails the step.
4. moe_tiny  - `overlap run` of the tiny MoE recipe, bf16, 5 steps, with --trace (the GPU timeline's
   exposure table).
5. dense_tiny- the same for the dense recipe.
6. calibrate - `overlap plan --calibrate` for this GPU type on Qwen3-30B-A3B's shapes
   (docs/planner.md).
7. plan      - the MoE guide's plan (EP16 on two nodes of 8) with that profile, every overlap switch
   off and on.
8. sync_free - the sync step again with the sync-free MoE dispatch
   (`model.moe_expert_rank_capacity_factor=1.5`): no split-size read may show up (only the loss and
   the grad norm, which carries its overflow count).
9. moe_sync_free - the moe_tiny run again with that dispatch: its steady step time beside
   moe_tiny's (the dropless all-to-all's) on the same GPU. Last, so that the original steps keep
   their time when the deadline is short.

Each step runs with a timeout and the next runs whatever happened. The steps work in a scratch
folder; OUT gets six files (the device tool brings back eight at most): gpu_check.json (every step's
status, seconds and findings, the runs' summaries and the plan's predictions), gpu_check.log (every
step's output), the calibrated profile, the plan, and the tiny MoE run's trace and timeline.
`--device cpu` runs the same steps on CPU ranks (gloo; the CUDA-only facts not applicable, the sync
check and the calibration skipped) to check the script itself; `--dry` prints the commands.

Usage: python bench/gpu_check.py run [--gpu h100] [--device cuda|cpu] [--out DIR] [--dry]
       (the `nccl` and `sync` subcommands are the steps' own, started by `run` under torchrun)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEP_TIMEOUT_S = {
    "env": 150,
    "nccl": 90,
    "sync": 120,
    "moe_tiny": 90,
    "dense_tiny": 90,
    "calibrate": 200,
    "plan": 60,
    "sync_free": 120,
    "moe_sync_free": 90,
}
# all steps together: the device tool runs one command for 10 minutes at most, 15 in a session
DEADLINE_S = 480
INTENDED_SYNCS = {  # (file, function) of the host reads a step needs, and why
    (
        "split_sizes.py",
        "read_split_sizes",
    ): "the MoE split sizes (NCCL's all-to-all takes them on the host)",
    ("trainer.py", "train_step"): "the logged loss",
    (
        "adam.py",
        "global_grad_norm",
    ): "the gradient norm (clipping, the log, the fp16 overflow skip)",
}


def _torchrun(*args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=1",
        *args,
    ]


def _overlap(*args: str) -> list[str]:
    return [sys.executable, "-m", "overlap.cli", *args]


KEPT = {
    "cluster_{gpu}.json": "cluster_{gpu}.json",
    "plan_qwen3_30b_a3b_{gpu}.json": "plan_qwen3_30b_a3b_{gpu}.json",
    "moe_tiny_trace/trace.json": "moe_tiny_trace.json",
    "moe_tiny_trace/timeline.png": "moe_tiny_timeline.png",
}
# ^ scratch file -> its name in OUT, beside gpu_check.json and gpu_check.log
FINDINGS = {
    "moe_tiny": "moe_tiny.jsonl.summary.json",
    "dense_tiny": "dense_tiny.jsonl.summary.json",
    "plan": "plan_qwen3_30b_a3b_{gpu}.json",
    "moe_sync_free": "moe_sync_free.jsonl.summary.json",
}  # a step's findings file where it is not NAME.json


def steps(gpu: str, device: str, out: Path) -> list[tuple[str, list[str] | None, str]]:
    """(name, command or None, why it is skipped) of every step, in order; `out` is the scratch
    folder."""
    cpu = device == "cpu"
    g = "cpu" if cpu else gpu
    tiny = [
        "-g",
        g,
        "-ng",
        "1",
        *(["-ms", "3", "-c", "fp32"] if cpu else ["-ms", "5", "-c", "bf16"]),
    ]
    plan = [
        "plan",
        "-m",
        "qwen",
        "-mr",
        "qwen3_30b_a3b",
        "-g",
        gpu,
        "-ng",
        "16",
        "-gn",
        "8",
        "-ep",
        "16",
        "-c",
        "bf16",
    ]
    cluster = out / f"cluster_{gpu}.json"
    sync_free = "model.moe_expert_rank_capacity_factor=1.5"

    def moe_run(name: str, *extra: str) -> list[str]:
        return _torchrun(
            "-m",
            "overlap.cli",
            "run",
            "-m",
            "qwen",
            "-mr",
            "qwen3_moe_tiny",
            *tiny,
            "--metrics",
            str(out / f"{name}.jsonl"),
            *extra,
        )

    return [
        ("env", [sys.executable, __file__, "env", "--device", device, "--out", str(out)], ""),
        ("nccl", _torchrun(__file__, "nccl", "--device", device, "--out", str(out)), ""),
        (
            "sync",
            None if cpu else _torchrun(__file__, "sync", "--gpu", gpu, "--out", str(out)),
            "CUDA's sync debug mode needs a GPU",
        ),
        ("moe_tiny", moe_run("moe_tiny", "--trace", str(out / "moe_tiny_trace")), ""),
        (
            "dense_tiny",
            _torchrun(
                "-m",
                "overlap.cli",
                "run",
                "-m",
                "qwen",
                "-mr",
                "dense_tiny",
                *tiny,
                "--metrics",
                str(out / "dense_tiny.jsonl"),
            ),
            "",
        ),
        (
            "calibrate",
            None if cpu else _overlap(*plan, "--calibrate", "--cluster", str(cluster)),
            "a GPU type's efficiency is measured on that GPU",
        ),
        (
            "plan",
            _overlap(
                *plan,
                *(["--cluster", str(cluster)] if not cpu else []),
                "--json",
                str(out / f"plan_qwen3_30b_a3b_{gpu}.json"),
            ),
            "",
        ),
        (
            "sync_free",
            None
            if cpu
            else _torchrun(
                __file__, "sync", "--gpu", gpu, "--out", str(out), "--override", sync_free
            ),
            "CUDA's sync debug mode needs a GPU",
        ),
        ("moe_sync_free", moe_run("moe_sync_free", sync_free), ""),
    ]


def cmd_run(args: argparse.Namespace) -> int:
    import tempfile

    out = Path(args.out)
    with tempfile.TemporaryDirectory(prefix="overlap-gpu-check-") as scratch:
        work = Path(scratch)
        plan = steps(args.gpu, args.device, work)
        if args.dry:
            for name, command, why in plan:
                print(f"{name}: {' '.join(command) if command else 'skipped: ' + why}")
            return 0
        out.mkdir(parents=True, exist_ok=True)
        failed = _run_steps(plan, args, work, out)
    return 1 if failed else 0


def _run_steps(
    plan: list[tuple[str, list[str] | None, str]], args: argparse.Namespace, work: Path, out: Path
) -> list[str]:
    """Run every step within DEADLINE_S; after each one, OUT/gpu_check.json, .log and the kept files
    are written (a run killed from outside keeps what it had); the names of the steps that
    failed."""
    import shutil

    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        PYTHONUNBUFFERED="1",
    )
    results, log = {}, (out / "gpu_check.log").open("w")
    deadline = time.monotonic() + DEADLINE_S
    for name, command, why in plan:
        left = deadline - time.monotonic()
        if command is None or left < 20:
            results[name] = {
                "status": "skipped",
                "why": why if command is None else "out of time (DEADLINE_S)",
            }
            continue
        start, timeout = time.monotonic(), min(STEP_TIMEOUT_S[name], left)
        try:
            done = subprocess.run(
                command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
            )
            status, output = (
                "pass" if done.returncode == 0 else f"fail (exit {done.returncode})",
                done.stdout + done.stderr,
            )
        except subprocess.TimeoutExpired as exc:
            status, output = (
                f"fail (timed out after {timeout:.0f} s)",
                f"{exc.stdout or ''}{exc.stderr or ''}",
            )
        seconds = round(time.monotonic() - start, 1)
        log.write(f"===== {name}: {' '.join(command)}\n{output}\n")
        log.flush()
        found = work / FINDINGS.get(name, f"{name}.json").format(gpu=args.gpu)
        results[name] = {
            "status": status,
            "seconds": seconds,
            "command": command,
            **({"findings": json.loads(found.read_text())} if found.exists() else {}),
            **({"last_lines": output.strip().splitlines()[-15:]} if status != "pass" else {}),
        }
        if (
            found.exists()
            and isinstance(results[name]["findings"], dict)
            and results[name]["findings"].get("failed")
        ):
            results[name]["status"] = (
                "fail (" + "; ".join(results[name]["findings"]["failed"]) + ")"
            )
        print(f"{name:<11} {results[name]['status']} ({seconds} s)", flush=True)
        (out / "gpu_check.json").write_text(
            json.dumps({"gpu": args.gpu, "device": args.device, "steps": results}, indent=1) + "\n"
        )
        for source, kept in KEPT.items():
            if (work / source.format(gpu=args.gpu)).exists():
                shutil.copy(work / source.format(gpu=args.gpu), out / kept.format(gpu=args.gpu))
    log.close()
    (out / "gpu_check.json").write_text(
        json.dumps({"gpu": args.gpu, "device": args.device, "steps": results}, indent=1) + "\n"
    )
    failed = [n for n, r in results.items() if r["status"].startswith("fail")]
    print(
        f"gpu check: {len(results) - len(failed)} of {len(results)} steps passed or skipped"
        + (f"; failed: {', '.join(failed)}" if failed else "")
        + f" -> {out / 'gpu_check.json'}"
    )
    return failed


def cmd_env(args: argparse.Namespace) -> int:
    import torch

    info = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        info |= {
            "gpu": torch.cuda.get_device_name(),
            "capability": list(torch.cuda.get_device_capability()),
            "memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        }
    info["torch_apis"] = _torch_apis()
    missing = []
    for module in ("omegaconf", "yaml", "rich", "numpy", "matplotlib", "tokenizers", "safetensors"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    info["missing_packages"] = missing
    info["failed"] = (
        [f"missing {', '.join(missing)} (carry their wheels: bench/gpu_check.sh)"]
        if missing
        else []
    )
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    info["grouped_gemm"] = _grouped_vs_loop(device, info["failed"])
    info["fused_elementwise"] = _fused_vs_eager(device, info["failed"])
    Path(args.out, "env.json").write_text(json.dumps(info, indent=1))
    print(json.dumps(info))
    return 0


def _torch_apis() -> dict:
    """The torch APIs the runtime relies on and the path each took on this torch (the supported
    range is 2.11 up to the pin): the collectives' entry points (`comm.torch_apis`, chosen by
    feature detection), the experts' grouped GEMM, fused AdamW's `grad_scale`, and the connection
    count that decides where the tracer times a collective."""
    import torch.nn.functional as F
    from torch.optim import adam

    from overlap.parallel import comm, streams

    return {
        **comm.torch_apis(),
        "grouped_mm": "torch.nn.functional.grouped_mm" if hasattr(F, "grouped_mm") else None,
        "adamw_grad_scale": "grad_scale" in adam._fused_adam.__code__.co_varnames,
        "timing_at": "compute wait (one hardware queue)" if streams.one_queue() else "launch",
    }


def _grouped_vs_loop(device, failed: list[str]) -> dict:
    """The experts' grouped GEMM (`F.grouped_mm`, what the architecture rule picks on CUDA in bf16)
    against the per-expert loop, forward + backward at one Qwen3-30B-A3B fc1 of 8 local experts
    (4096 routed rows, uneven, one expert empty): the largest difference relative to the loop's
    largest value, and the median ms of each (CUDA events; host clock on CPU, where the shape is cut
    8x so the CPU check stays short)."""
    import torch

    from overlap.kernels.grouped_gemm import GROUPED, grouped_gemm_kernel
    from overlap.layers.linear_functions import GroupedLinear, grouped_offsets

    cut = 1 if device.type == "cuda" else 8
    experts, hidden, width = 8, 2048 // cut, 2 * 768 // cut
    counts = [0, 900, 300, 700, 500, 800, 296, 600]
    counts = [c // cut for c in counts]
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(sum(counts), hidden, generator=gen).to(device, torch.bfloat16)
    weight = (torch.randn(experts, width, hidden, generator=gen) * 0.02).to(device, torch.bfloat16)
    grad = torch.randn(sum(counts), width, generator=gen).to(device, torch.bfloat16)
    major = torch.cuda.get_device_capability(device)[0] if device.type == "cuda" else None
    grouped = grouped_gemm_kernel(device.type, major, "bfloat16")[0] == GROUPED
    offs = grouped_offsets(torch.tensor(counts, device=device), rows, (weight,), grouped)
    if offs is None:
        failed.append(f"grouped_gemm: the experts' GEMMs take the loop on {device} in bf16")
        return {"device": str(device), "grouped": False}

    def run(kernel_offs):
        x, w = rows.clone().requires_grad_(), weight.clone().requires_grad_()
        out = GroupedLinear.apply(x, w, counts, kernel_offs, None)
        out.backward(grad)
        return out.detach(), x.grad, w.grad

    def timed(kernel_offs) -> float:
        return _timed_ms(device, lambda: run(kernel_offs))

    worst = 0.0
    for a, b in zip(run(offs), run(None)):  # out, grad_rows, grad_weight
        worst = max(
            worst,
            float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30)),
        )
    result = {
        "device": str(device),
        "grouped": True,
        "shape": [experts, sum(counts), hidden, width],
        "max_rel_diff": worst,
        "grouped_ms": timed(offs),
        "loop_ms": timed(None),
    }
    if worst > 2e-2:  # bf16 GEMMs of different kernels: a few units of bf16's 2^-8 at most
        failed.append(f"grouped_gemm: grouped and loop differ by {worst:.3g} of the largest value")
    return result


def _timed_ms(device, fn, reps: int = 10) -> float:
    """Median ms of `fn()` over `reps` runs (CUDA events on a GPU, the host clock on the CPU)."""
    import torch

    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return round(sorted(times)[len(times) // 2], 3)


def _fused_vs_eager(device, failed: list[str]) -> dict:
    """Each elementwise chain (`overlap.layers.fused.Chain`) compiled as the layers compile it
    against itself eager - its forward and its backward function, in bf16 at Qwen3-30B-A3B's shapes
    (4096 tokens, hidden 2048, 32 heads of 128, top-8 of experts 768 wide, the experts' SwiGLU
    weighted by the router's probabilities): the largest difference relative to eager's largest
    value, and the median ms of each. On the CPU (the script's own check) the shapes are cut 16x and
    the graphs go through "aot_eager" (captured whole, not compiled: inductor's CPU compile is
    tests/test_fused_elementwise.py's)."""
    import torch

    from overlap.layers import fused
    from overlap.layers.mlp import SWIGLU
    from overlap.layers.norm import RMS_NORM
    from overlap.layers.rotary import APPLY_ROPE

    cuda = device.type == "cuda"
    cut, backend = (1, fused.BACKEND) if cuda else (16, "aot_eager")
    tokens, hidden, rows, ffn = 4096 // cut, 2048 // cut, 8 * 4096 // cut, 768 // cut
    gen = torch.Generator().manual_seed(0)

    def rand(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    angles = torch.rand(tokens, 1, 1, 128, generator=gen).to(device) * 6
    chains = {
        "rms_norm": (RMS_NORM, (rand(tokens, 1, hidden), rand(hidden), 1e-6)),
        "apply_rope": (APPLY_ROPE, (rand(tokens, 1, 32, 128), angles.cos(), angles.sin())),
        "swiglu": (SWIGLU, (rand(rows, ffn), rand(rows, ffn), None)),
        "weighted_swiglu": (
            SWIGLU,
            (rand(rows, ffn), rand(rows, ffn), rand(rows, dtype=torch.float32)),
        ),
    }
    result = {"device": str(device), "backend": backend, "tokens": tokens, "hidden": hidden}
    for name, (chain, args) in chains.items():
        out, *extras = chain.forward(*args)
        constants = tuple(
            a
            for i, a in enumerate(args)
            if i not in chain.saves and not isinstance(a, torch.Tensor)
        )
        saved = (*(args[i] for i in chain.saves), *extras, *constants)
        grad = rand(*out.shape, dtype=out.dtype)

        def run(forward, backward, args=args, grad=grad, saved=saved):
            return (*forward(*args), *(g for g in backward(grad, *saved) if g is not None))

        compiled = (fused.compiled(chain.forward, backend), fused.compiled(chain.backward, backend))
        try:
            got, want = run(*compiled), run(chain.forward, chain.backward)
        # a chain that cannot compile here is a finding, not the end of the step
        except Exception as exc:
            failed.append(
                f"fused_elementwise: {name} did not compile: {type(exc).__name__}: {exc}"[:300]
            )
            continue
        worst = max(
            float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30))
            for a, b in zip(got, want)
        )
        result[name] = {
            "max_rel_diff": worst,
            "compiled_ms": _timed_ms(device, lambda compiled=compiled: run(*compiled)),
            "eager_ms": _timed_ms(device, lambda c=chain: run(c.forward, c.backward)),
        }
        if worst > 2e-2:  # bf16 roundings placed differently: a few units of bf16's 2^-8 at most
            failed.append(f"fused_elementwise: {name} compiled and eager differ by {worst:.3g}")
    return result


def _check(facts: dict, failed: list[str], name: str, ok: bool, value) -> None:
    facts[name] = value
    if not ok:
        failed.append(f"{name}: {value}")


def cmd_nccl(args: argparse.Namespace) -> int:
    """The NCCL facts and the GPU timeline, on a one-rank world (module docstring, step 2)."""
    import torch
    import torch.distributed as dist

    from overlap.parallel import comm, groups, teardown
    from overlap.parallel.trace import CommEvent, DeviceTimeline, recorder

    cuda = args.device == "cuda"
    facts, failed = {"device": args.device}, []
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    )
    if cuda:
        torch.cuda.set_device(device)
    groups.init_world("nccl" if cuda else "gloo", 60, device)
    try:
        # what a GPU rank's tracer uses
        recorder().timeline = DeviceTimeline() if cuda else recorder().timeline
        recorder().drain()
        # One work per batch: our handles of a call share it (and its future on the GPU timeline);
        # dropped once the device reports it complete, with a query that never waits.
        if cuda:  # a send to itself and its receive in one group call (gloo has no send to self)
            a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
            for _ in range(30):  # the batch queues behind these on its stream
                a = (a @ a).clamp_(-1, 1)
            x, y = (
                torch.arange(1 << 20, dtype=torch.float32, device=device),
                torch.zeros(1 << 20, device=device),
            )
            works = dist.batch_isend_irecv(
                [dist.P2POp(dist.isend, x, 0), dist.P2POp(dist.irecv, y, 0)]
            )
            _check(facts, failed, "works_per_batch_of_2", len(works) == 1, len(works))
            # comm's private handle: in a one-rank world comm's own calls skip a group of 1
            posted = comm._Posted(works)
            events = [
                CommEvent("pp_send_fwd", "p2p", 1, x.numel() * 4, recorder().mark()),
                CommEvent("pp_recv_fwd", "p2p", 1, 0, recorder().mark()),
            ]
            for e in events:
                recorder().add_comm(e)
            handles = [
                comm.CommHandle(events[0], posted, None),
                comm.CommHandle(events[1], posted, y),
            ]
            reaped_while_busy = handles[0].reap()
            torch.cuda.synchronize()
            _check(
                facts,
                failed,
                "send_reaped_only_once_complete",
                not reaped_while_busy and handles[0].reap(),
                {"while_busy": reaped_while_busy},
            )
            got = handles[1].wait()
            _check(
                facts,
                failed,
                "batched_self_exchange_correct",
                bool(torch.equal(got, x)),
                float(got.sum()),
            )
            traced, _spans = recorder().drain()
            # the timing stream waited for the batch's one work (its future completes empty at
            # launch): the batch ends after its launch on the device
            _check(
                facts,
                failed,
                "batch_done_on_gpu_timeline",
                all(e.t_done is not None and e.t_done >= e.t_launch for e in traced),
                [
                    None if e.t_done is None else round((e.t_done - e.t_launch) * 1e3, 4)
                    for e in traced
                ],
            )
        # A collective behind queued GEMMs, traced on the GPU timeline.
        a = torch.randn(
            (4096, 4096) if cuda else (512, 512),
            device=device,
            dtype=torch.bfloat16 if cuda else torch.float32,
        )
        inp = torch.randn(1 << (28 if cuda else 20), device=device)
        outp = torch.empty_like(inp)
        with recorder().span("gemms"):
            for _ in range(50 if cuda else 2):
                a = (a @ a).clamp_(-1, 1)
        event = CommEvent("dp_ag", "all_gather", 1, inp.numel() * 4, recorder().mark())
        recorder().add_comm(event)
        work = dist.all_gather_into_tensor(outp, inp, async_op=True)
        enqueued_done = work.get_future().done()
        busy = cuda and not torch.cuda.current_stream().query()
        handle = comm.CommHandle(event, comm._Posted([work]), outp)  # noqa: SLF001 (as above)
        t0 = time.perf_counter()
        handle.wait()
        host_wait_ms = (time.perf_counter() - t0) * 1e3
        still_busy = cuda and not torch.cuda.current_stream().query()
        if cuda:
            _check(
                facts,
                failed,
                "future_done_at_enqueue_while_gpu_busy",
                enqueued_done and busy,
                {"future_done": enqueued_done, "gpu_busy": busy},
            )
            _check(
                facts,
                failed,
                "wait_did_not_block_host",
                still_busy,
                {"host_wait_ms": round(host_wait_ms, 3), "gpu_busy_after_wait": still_busy},
            )
        (traced,), spans = recorder().drain()
        gemms = spans[0]
        timeline = {
            "gemms_ms": (gemms.t_end - gemms.t_start) * 1e3,
            "launch_after_gemms_ms": (traced.t_launch - gemms.t_end) * 1e3,
            "collective_ms": None
            if traced.t_done is None
            else (traced.t_done - traced.t_launch) * 1e3,
            "wait_ms": (traced.t_wait_end - traced.t_wait_start) * 1e3,
        }
        ok = (
            (
                timeline["collective_ms"] is not None
                and timeline["collective_ms"] > 0
                and timeline["launch_after_gemms_ms"] >= -1e-3
                and traced.t_done >= traced.t_launch
            )
            if cuda
            else True
        )
        _check(
            facts,
            failed,
            "gpu_timeline",
            ok,
            {k: None if v is None else round(v, 4) for k, v in timeline.items()},
        )
        facts["gathered_correct"] = bool(torch.equal(outp, inp))
    except Exception:  # every fact so far is kept; the failure is one of them
        failed.append(traceback.format_exc(limit=3).strip().splitlines()[-1])
    finally:
        facts["failed"] = failed
        Path(args.out, "nccl.json").write_text(json.dumps(facts, indent=1))
        teardown.shutdown()
    print(json.dumps(facts))
    return 0


def cmd_sync(args: argparse.Namespace) -> int:
    """A tiny MoE training step under CUDA's sync debug mode (module docstring, step 3)."""
    import warnings

    import torch

    from overlap.harness import resolve_run
    from overlap.parallel import groups, teardown
    from overlap.parallel.state import ParallelState
    from overlap.parallel.trace import DeviceTimeline, recorder
    from overlap.training.trainer import Trainer

    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    job = resolve_run(
        [
            "-m",
            "qwen",
            "-mr",
            "qwen3_moe_tiny",
            "-g",
            args.gpu,
            "-ng",
            "1",
            "-ms",
            "2",
            "-c",
            "bf16",
        ],
        args.override,
    )
    # the sync-free dispatch reads no split sizes: there, that read is not intended
    sync_free = any(o.startswith("model.moe_expert_rank_capacity_factor=") for o in args.override)
    intended = {
        k: v for k, v in INTENDED_SYNCS.items() if not (sync_free and k[1] == "read_split_sizes")
    }
    groups.init_world("nccl", 60, device)
    recorder().timeline = DeviceTimeline()
    sites: dict[str, dict] = {}

    def seen(message, category, filename, lineno, file=None, line=None) -> None:
        """Called by `warnings` while the synchronising op runs: the stack is the op's."""
        if "synchroniz" not in str(message):
            return
        ours = [f for f in traceback.extract_stack() if f"{os.sep}overlap{os.sep}" in f.filename]
        where = ours[-1] if ours else traceback.FrameSummary(filename, lineno, "?")
        key = f"{Path(where.filename).name}:{where.lineno} {where.name}"
        entry = sites.setdefault(
            key,
            {"count": 0, "intended": intended.get((Path(where.filename).name, where.name))},
        )
        entry["count"] += 1

    try:
        trainer = Trainer(job.cfg, ParallelState(job.resolution.layout, device))
        trainer.train_step(0)  # warm-up: first-use allocations and lazy inits are not the step's
        torch.cuda.synchronize()
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = seen
            torch.cuda.set_sync_debug_mode("warn")
            try:
                trainer.train_step(1)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        teardown.shutdown()
    unintended = sorted(k for k, v in sites.items() if not v["intended"])
    result = {
        "syncs": sites,
        "failed": [
            f"{len(unintended)} unintended host synchronisation site(s): " + ", ".join(unintended)
        ]
        if unintended
        else [],
    }
    Path(args.out, "sync_free.json" if sync_free else "sync.json").write_text(
        json.dumps(result, indent=1)
    )
    print(json.dumps(result))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="every step, each in its own process")
    run.add_argument(
        "--gpu",
        default="h100",
        help="the -g name of this machine's GPU type (an H200 runs as h100)",
    )
    run.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    run.add_argument(
        "--out",
        default=str(ROOT / "bench" / "results" / "gpu_check"),
        help="where the six result files go (the steps work in a scratch folder)",
    )
    run.add_argument("--dry", action="store_true", help="print the steps' commands, run nothing")
    run.set_defaults(func=cmd_run)
    for name, func in (("env", cmd_env), ("nccl", cmd_nccl), ("sync", cmd_sync)):
        p = sub.add_parser(name)
        p.add_argument("--out", required=True)
        p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
        p.add_argument("--gpu", default="h100")
        p.add_argument(
            "--override", action="append", default=[], help="a config override for the step"
        )
        p.set_defaults(func=func)
    args = parser.parse_args()
    from overlap.parallel.trace import Recorder, recording

    with recording(Recorder()):  # each step is one run, with a tracer recorder of its own
        return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
