"""The instruments that prove an overlap works: exposed-communication arithmetic, the modelled link,
the emulated interconnect, traces from a real run, and the A/B harness's parsing and formulas."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from overlap.errors import ConfigError
from overlap.launch import network as net
from overlap.parallel import comm, link_model
from overlap.parallel.trace import CommEvent, Recorder, Span
from overlap.perf import bench
from overlap.perf.machine import describe_machine, machine_line
from overlap.profiling.chrome_trace import rank_events
from overlap.profiling.collector import Collector, IterationTrace, RankTrace
from overlap.profiling.exposed import ALL, exposure, mean_exposure, subtract, union
from overlap.profiling.sinks import JsonLines
from tests.world import run_world


def _ev(kind, launch, done, wait=None, ready=None):
    """A hand-made op: launched at `launch`, data complete at `done`, caller blocked over `wait`
    (start, end), every member posted at `ready` (None: not known, as on a real link)."""
    ws, we = wait if wait else (None, None)
    return CommEvent(kind, "all_reduce", 2, 1000, launch, done, ws, we, ready)


# ---- interval arithmetic (times in seconds, results in ms) ----


def test_union_and_subtract():
    assert union([(3, 4), (0, 1), (0.5, 2), (5, 5), (4, 4.5)]) == [(0, 2), (3, 4.5)]
    assert subtract([(0, 10)], [(1, 2), (4, 6), (9, 12)]) == [(0, 1), (2, 4), (6, 9)]
    assert subtract([(0, 2), (3, 5)], [(1, 4)]) == [(0, 1), (4, 5)]
    assert subtract([(0, 1)], []) == [(0, 1)]


def test_async_comm_hidden_behind_compute_is_not_exposed():
    rows = exposure([_ev("dp_rs", 0.0, 0.010, wait=(0.010, 0.010))], [Span("backward", 0.0, 0.010)])
    assert rows["dp_rs"].total_ms == pytest.approx(10.0)
    assert rows["dp_rs"].exposed_ms == pytest.approx(0.0)
    assert rows["dp_rs"].hidden_pct == pytest.approx(100.0)


def test_partly_hidden_comm_exposes_the_wait():
    rows = exposure(
        [_ev("ep_dispatch", 0.0, 0.010, wait=(0.006, 0.010))], [Span("fwd", 0.0, 0.006)]
    )
    assert rows["ep_dispatch"].exposed_ms == pytest.approx(4.0)
    assert rows["ep_dispatch"].hidden_pct == pytest.approx(60.0)


def test_comm_outside_any_span_is_fully_exposed():
    rows = exposure([_ev("dp_loss", 0.020, 0.030)], [Span("optimizer", 0.0, 0.020)])
    assert rows["dp_loss"].exposed_ms == pytest.approx(10.0)


def test_sync_collective_inside_a_span_is_exposed():
    rows = exposure(
        [_ev("tp_ag", 0.005, 0.015, wait=(0.005, 0.015))], [Span("fwd.layer0", 0.0, 0.020)]
    )
    assert rows["tp_ag"].total_ms == pytest.approx(10.0)
    assert rows["tp_ag"].exposed_ms == pytest.approx(10.0)


def test_all_row_unions_kinds_and_mean_over_iterations():
    events = [_ev("a", 0.0, 0.010), _ev("b", 0.005, 0.015), _ev("a", 0.002, 0.004)]
    rows = exposure(events, [Span("c", 0.0, 0.008)])
    assert rows["a"].total_ms == pytest.approx(10.0) and rows["a"].count == 2
    assert rows[ALL].total_ms == pytest.approx(15.0)  # overlapping kinds are not double counted
    assert rows[ALL].exposed_ms == pytest.approx(7.0)
    mean = mean_exposure([rows, {}])
    assert mean["b"].total_ms == pytest.approx(5.0)


def test_peer_wait_is_the_exposed_time_before_every_member_posted_with_nothing_on_the_link():
    # Op 1 waits from 0 to 8 ms for a late peer, then 2 ms on the link; op 2 is on the link from 3
    # to 5 ms. The rank computes until 1 ms and waits from 1 ms: of the 9 exposed ms, 1-3 and 5-8
    # are peer wait (5 ms).
    events = [
        _ev("ep_dispatch", 0.0, 0.010, wait=(0.001, 0.010), ready=0.008),
        _ev("ep_combine", 0.003, 0.005, ready=0.003),
    ]
    rows = exposure(events, [Span("fwd", 0.0, 0.002)])
    assert rows["ep_dispatch"].exposed_ms == pytest.approx(9.0)
    # its own kind had nothing on the link
    assert rows["ep_dispatch"].peer_wait_ms == pytest.approx(7.0)
    assert rows["ep_combine"].peer_wait_ms == pytest.approx(0.0)
    # the combine's transfer is link time of the union
    assert rows[ALL].peer_wait_ms == pytest.approx(5.0)
    real = exposure([_ev("dp_rs", 0.0, 0.010, wait=(0.0, 0.010))], [])
    assert real["dp_rs"].peer_wait_ms is None  # unknown on a real link, not zero
    mean = mean_exposure([rows, {}])
    assert (
        mean["ep_dispatch"].peer_wait_ms == pytest.approx(3.5)
        and mean_exposure([real])["dp_rs"].peer_wait_ms is None
    )


def test_recorder_sink_and_collector_skip_the_reset_drain(tmp_path):
    rec = Recorder()
    lines = JsonLines(str(tmp_path / "c.jsonl"))
    col = Collector(0, "real", keep_events=True, comm_metrics=lines)
    rec.on_drain = col
    rec.add_comm(_ev("x", 0.0, 0.001))
    rec.drain()  # the trainer's reset before iteration 0
    rec.add_comm(_ev("dp_ar", 0.0, 0.002))
    with rec.span("backward"):
        pass
    rec.drain()
    lines.close()
    col.check_iterations(1)
    with pytest.raises(RuntimeError):
        col.check_iterations(2)
    row = json.loads((tmp_path / "c.jsonl").read_text())
    assert row["iteration"] == 1 and row["total_comm_ms"]["dp_ar"] == pytest.approx(2.0)
    assert "x" not in row["total_comm_ms"] and len(col.trace.iterations) == 1


def test_chrome_trace_puts_concurrent_ops_of_one_kind_on_separate_lanes():
    trace = RankTrace(
        1,
        "real",
        [
            IterationTrace(
                0,
                [
                    _ev("dp_rs", 0.0, 0.01),
                    _ev("dp_rs", 0.005, 0.02),
                    _ev("dp_rs", 0.011, 0.03, wait=(0.02, 0.03)),
                ],
                [Span("backward", 0.0, 0.03)],
            )
        ],
    )
    events = rank_events(trace, origin=0.0)
    lanes = {e["args"]["name"]: e["tid"] for e in events if e.get("name") == "thread_name"}
    assert {"compute", "iteration", "dp_rs", "dp_rs #2"} <= set(lanes)
    ops = [e for e in events if e.get("ph") == "X" and e["name"] == "all_reduce"]
    assert [e["tid"] for e in ops] == [lanes["dp_rs"], lanes["dp_rs #2"], lanes["dp_rs"]]
    assert all(e["pid"] == 1 for e in events)
    assert any(e["name"] == "wait dp_rs" and e["tid"] == lanes["compute"] for e in events)
    # a real link: not known
    assert all("for_late_peer_ms" not in e.get("args", {}) for e in events)
    late = RankTrace(
        0,
        "model",
        [IterationTrace(0, [_ev("ep_dispatch", 0.0, 0.01, wait=(0.002, 0.01), ready=0.006)], [])],
    )
    events = rank_events(late, origin=0.0)
    (wait,) = [e for e in events if e["name"] == "wait ep_dispatch"]
    (op,) = [e for e in events if e["name"] == "all_reduce"]
    assert wait["args"]["for_late_peer_ms"] == pytest.approx(4.0)
    assert op["args"]["ready_after_launch_ms"] == pytest.approx(6.0)


# ---- modelled link ----


def _on_link(latency_s: float, families: tuple[str, ...] | None = None):
    """A run's session on a modelled link of 10 MB/s."""
    link = link_model.LinkModel(latency_s=latency_s, bandwidth_Bps=1e7, families=families)
    return comm.using(comm.CommSession(link=link))


def _modelled_link_case():
    group = dist.group.WORLD
    with _on_link(0.01):
        # 1 MB: 0.01 + 1 x 1e6 / 1e7 = 0.11 s (W=2)
        x = torch.full((250_000,), float(dist.get_rank() + 1))
        wall, cpu = time.perf_counter(), time.process_time()
        h = comm.all_reduce(x, group, "t_single")
        h.wait()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        single = h.event.t_done - h.event.t_launch
        a, b = torch.ones(250_000), torch.ones(250_000)
        h1, h2 = comm.all_reduce(a, group, "t_first"), comm.all_reduce(b, group, "t_second")
        h2.wait()
        h1.wait()
        queued = h2.event.t_done - h1.event.t_launch
    with _on_link(0.5, ("ep",)):
        h_dp, h_ep = (
            comm.all_reduce(torch.ones(4), group, "dp_ar"),
            comm.all_reduce(torch.ones(4), group, "ep_x"),
        )
        h_dp.wait()
        h_ep.wait()
    scoped = (h_dp.event.t_done - h_dp.event.t_launch, h_ep.event.t_done - h_ep.event.t_launch)
    return single, wall, cpu, queued, x[0].item(), b[0].item(), scoped


def test_modelled_link_holds_completion_back_without_burning_cpu_and_queues_ops():
    for single, wall, cpu, queued, value, summed, (dp, ep) in run_world(2, _modelled_link_case):
        assert dp < 0.25 <= 0.5 <= ep  # a link scoped to "ep" leaves dp on the plain loopback
        assert value == 3.0 and summed == 2.0  # the real collective still ran
        assert 0.1099 <= single < 0.2 and wall >= 0.1099
        assert cpu < 0.5 * wall, f"waiting on the modelled link used {cpu:.3f}s CPU in {wall:.3f}s"
        assert queued >= 0.2199  # the second op waited for the link behind the first


def _modelled_late_peer_case():
    """Rank 1 launches a 1 MB all-to-all (0.01 + 1/2 x 1e6 / 1e7 = 0.06 s of link at W=2) 0.3 s
    after rank 0. Returns (launch, done) of each rank's op and the received value."""
    group = dist.group.WORLD
    with _on_link(0.01):
        comm.barrier()
        if dist.get_rank() == 1:
            time.sleep(0.3)
        h = comm.all_to_all(
            torch.full((250_000,), float(dist.get_rank() + 1)), group, "ep_dispatch"
        )
        out = h.wait()
        comm.barrier()
        return (
            h.event.t_launch,
            h.event.t_done,
            h.event.t_wait_end,
            (out[0].item(), out[-1].item()),
            h.event.t_ready,
            exposure([h.event], [])["ep_dispatch"],
        )


def test_modelled_collective_starts_when_the_last_rank_has_launched():
    (
        (early, early_done, early_end, v0, ready0, rows0),
        (late, late_done, late_end, v1, ready1, rows1),
    ) = run_world(2, _modelled_late_peer_case)
    assert v0 == v1 == (1.0, 2.0)  # the real all-to-all ran: rank 0's half first, then rank 1's
    assert late - early >= 0.29
    # Both ranks complete a link time after the late launch: the early rank's wait for its peer
    # hides none of it.
    for done, end in ((early_done, early_end), (late_done, late_end)):
        assert done - late >= 0.0599 and end >= done
    # Both know when the last member launched; the early rank's exposed time splits into its wait
    # for the peer and the link's 60 ms, the late rank waited for no one.
    assert ready0 == ready1 == pytest.approx(late, abs=1e-6)
    assert rows0.peer_wait_ms == pytest.approx((late - early) * 1e3, abs=1.0)
    assert rows0.exposed_ms - rows0.peer_wait_ms >= 59.9
    assert rows1.peer_wait_ms == pytest.approx(0.0, abs=1e-6) and rows1.exposed_ms >= 59.9


def _modelled_p2p_case():
    """Rank 1 posts its receive at once; rank 0 sends 1 MB (0.01 + 1e6 / 1e7 = 0.11 s of link) 0.3 s
    later, then again with the receive posted only after the send. Returns (receive posted -> done,
    send posted -> done) of each receive, from the host's one monotonic clock (the sender's posting
    times travel in the reply)."""
    group = dist.group.WORLD
    with _on_link(0.01, ("pp",)):
        payload = torch.ones(250_000)
        if dist.get_rank() == 0:
            sent = []
            for delay in (0.3, 0.0):
                comm.barrier()
                time.sleep(delay)
                sent.append(comm.now())
                (h,) = comm.p2p([("pp_send_fwd", comm.P2P_SEND, payload, 1, 5)], group)
                h.wait()
            comm.barrier()
            return sent
        out = []
        for late in (False, True):
            comm.barrier()
            if late:
                time.sleep(0.3)
            buf = torch.zeros(250_000)
            (h,) = comm.p2p([("pp_recv_fwd", comm.P2P_RECV, buf, 0, 5)], group)
            h.wait()
            out.append((h.event.t_launch, h.event.t_done, buf[0].item(), h.event.t_ready))
        comm.barrier()
        return out


def test_modelled_p2p_starts_when_both_sides_have_posted():
    sent, received = run_world(2, _modelled_p2p_case)
    (early_post, early_done, v1, early_ready), (late_post, late_done, v2, late_ready) = received
    assert v1 == v2 == 1.0
    # Posted early: the link carries the data only from the send (0.3 s later), never before it.
    assert early_done - sent[0] >= 0.1099 and early_done - early_post >= 0.35
    assert early_ready == pytest.approx(sent[0], abs=0.005)  # ready when the sender posted
    assert late_ready == late_post  # the send was already there
    # Posted after the send: from its own posting.
    assert late_post > sent[1] and late_done - late_post >= 0.1099


# ---- --network parsing and the emulated interconnect ----


def test_parse_network():
    scoped = net.parse_network("model:1ms,10MB/s,ep+dp")
    assert scoped.families == ("ep", "dp") and "only ep/dp collectives use it" in scoped.describe()
    m = net.parse_network("model:100us,1GB/s")
    assert (m.kind, m.latency_s, m.bandwidth_Bps) == ("model", pytest.approx(1e-4), 1e9)
    assert net.parse_network("model:1ms,800mbit").bandwidth_Bps == 1e8
    t = net.parse_network("tbf:800mbit")
    assert (t.kind, t.rate, t.rate_Bps) == ("tbf", "800mbit", 1e8)
    assert "tbf:800mbit" in t.describe() and net.parse_network(None).kind == "real"
    n = net.parse_network("nic:200mbit")
    assert (n.kind, n.rate, n.rate_Bps) == ("nic", "200mbit", 2.5e7)
    assert "full-duplex" in n.describe() and "25 MB/s" in n.describe()
    for bad in (
        "tbf:fast",
        "nic:fast",
        "nic:0mbit",
        "model:1ms",
        "model:1,1GB/s",
        "wifi:1",
        "model:1ms,1GB/s,e_p",
        "model:1ms,1GB/s,ep,dp",
        "model:1ms,1GB/s,foo",
    ):
        with pytest.raises(ConfigError):
            net.parse_network(bad)


def test_tbf_without_tools_or_root_names_the_fallback(monkeypatch):
    monkeypatch.setattr(net.shutil, "which", lambda tool: None)
    with pytest.raises(ConfigError, match="model:"):
        net.check_netns_support()
    monkeypatch.setattr(net.shutil, "which", lambda tool: f"/usr/sbin/{tool}")
    monkeypatch.setattr(net.os, "geteuid", lambda: 1000)
    with pytest.raises(ConfigError, match="root.*model:"):
        net.check_netns_support()
    with pytest.raises(
        ConfigError, match="--network='nic:200mbit': creating a network namespace needs root"
    ):
        net.check_netns_support("nic:200mbit")


def test_emulated_links_are_refused_in_ranks_the_local_launcher_did_not_start(monkeypatch):
    """torchrun or srun ranks (one per node, or a launcher of their own) are in no namespace of
    ours: `nic:` and `tbf:` refuse there, before any connection is tried."""
    from overlap import commands

    monkeypatch.delenv(net.NETNS_ENV, raising=False)
    for text in ("tbf:800mbit", "nic:200mbit"):
        with pytest.raises(ConfigError, match="not inside the emulated interconnect"):
            commands._modelled_link(net.parse_network(text))


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="needs root and iproute2",
)
def test_emulated_interconnect_creates_and_always_deletes_the_namespace():
    name = f"overlap-test-{os.getpid()}"
    try:
        with pytest.raises(KeyError):
            with net.emulated_interconnect("800mbit", name) as (ns, prefix):
                assert ns == name and prefix == ["ip", "netns", "exec", name]
                qdisc = subprocess.run(
                    [*prefix, "tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True
                ).stdout
                assert "tbf" in qdisc and "800Mbit" in qdisc
                raise KeyError("a failing body must still remove the namespace")
        assert name not in _namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


# ---- a real run with the instruments on ----


def test_run_with_modelled_link_writes_traces_and_exposure(tmp_path):
    metrics, trace = tmp_path / "m.jsonl", tmp_path / "trace"
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
            "-g",
            "cpu",
            "-ng",
            "2",
            "-ms",
            "2",
            "--network",
            "model:100us,1GB/s",
            "--trace",
            str(trace),
            "--metrics",
            str(metrics),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Network: model:100us,1GB/s" in out.stdout + out.stderr and "hidden %" in out.stderr
    assert "of it peer wait ms" in out.stderr  # the modelled link knows when every member posted
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl.comm.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2]
    assert rows[1]["total_comm_ms"]["dp_ar"] >= 17.0  # 17.8 MB of grads over a modelled 1 GB/s ring
    assert rows[1]["exposed_comm_ms"]["dp_ar"] <= rows[1]["total_comm_ms"]["dp_ar"]
    assert 0.0 <= rows[1]["exposed_peer_wait_ms"]["dp_ar"] <= rows[1]["exposed_comm_ms"]["dp_ar"]
    summary = json.loads((tmp_path / "m.jsonl.summary.json").read_text())
    assert summary["network"].startswith("model:100us,1GB/s") and summary["steady_step_ms"] > 0
    assert set(summary["exposed_peer_wait_ms"]) <= set(summary["exposed_comm_ms"])
    chrome = json.loads((trace / "trace.json").read_text())
    assert {e["pid"] for e in chrome["traceEvents"]} == {0, 1}
    assert any(e.get("name") == "wait dp_ar" for e in chrome["traceEvents"])
    assert (trace / "timeline.png").stat().st_size > 10_000
    assert all((trace / f"rank{r}.events.json").exists() for r in (0, 1))


# ---- the A/B harness ----


def test_parse_ab_and_configs():
    assert bench.parse_ab("ddp.overlap_grad_reduce=false,true") == (
        "ddp.overlap_grad_reduce",
        ["false", "true"],
    )
    for bad in (
        "ddp.overlap_grad_reduce=true",
        "overlap=true,false",
        "--moe_a2a_overlap=false,true",
        "ddp.x=a,a",
        "ddp.x=a,,b",
    ):
        with pytest.raises(ConfigError):
            bench.parse_ab(bad)
    configs = bench.build_configs("ddp.x", ["false", "true"], ideal=True)
    assert [c.name for c in configs] == ["ddp.x=false", "ddp.x=true", bench.IDEAL_NAME]
    assert configs[2].overrides == ["ddp.x=false"] and configs[2].run_flags == [
        "--comm-mode",
        "none",
    ]


def test_bench_strips_its_own_flags_and_moves_overrides_last():
    argv = [
        "-m",
        "qwen",
        "--ab",
        "ddp.x=a,b",
        "model.num_layers=2",
        "--ideal",
        "--repeats=2",
        "--json",
        "o.json",
        "-ng",
        "2",
        "--network",
        "model:1ms,1GB/s",
    ]
    assert bench.common_run_options(argv, ["model.num_layers=2"]) == [
        "-m",
        "qwen",
        "-ng",
        "2",
        "--network",
        "model:1ms,1GB/s",
    ]


def test_overlap_efficiency_and_summary_table():
    assert bench.overlap_efficiency(100.0, 80.0, 60.0) == pytest.approx(0.5)
    assert bench.overlap_efficiency(100.0, 60.0, 60.0) == pytest.approx(1.0)
    assert bench.overlap_efficiency(100.0, 90.0, 100.0) is None
    configs = bench.build_configs("ddp.x", ["false", "true"], ideal=True)

    def run(ms, exposed):
        return bench.RunResult(ms, {"all": exposed}, {"all": 20.0}, 400.0, [1, 4], "real")

    results = {
        configs[0].name: [run(100, 20), run(102, 20)],
        configs[1].name: [run(80, 4), run(82, 4)],
        configs[2].name: [run(60, 0), run(62, 0)],
    }
    doc = bench.summarize(configs, results, "real", "overlap bench ...")
    assert doc["ideal_step_time_ms"] == pytest.approx(61.0) and doc["window_iterations"] == [1, 4]
    assert doc["overlap_efficiency"] == {"ddp.x=true": pytest.approx(0.5)}
    on = doc["configs"][1]
    assert on["step_time_ms"]["min"] == 80 and on["step_time_ms"]["max"] == 82
    assert on["step_time_ratio_to_first"] == pytest.approx(81 / 101) and on["exposed_comm_ms"] == {
        "all": 4.0
    }
    table = bench.format_markdown(doc)
    assert "| ddp.x=true | 81.0 | 80.0 | 82.0 | 0.802 | 0.802 (0.80-0.80) |" in table
    assert "| 0.50 (per round 0.50) |" in table
    assert doc["machine"] == describe_machine() and machine_line(doc["machine"]) in table


def test_per_round_ratios_pair_each_repeat_with_the_first_configs_in_the_same_round():
    """A slow round moves both configurations of that round: the pairs cancel it where the ratio of
    means does not."""
    configs = bench.build_configs("x", ["off", "on"], ideal=False)

    def run(ms):
        return bench.RunResult(ms, {"all": 1.0}, {"all": 1.0}, 1.0, [1, 4], "real")

    # round 2 ran on a machine 3x slower for both; the on configuration is 10% faster in every round
    doc = bench.summarize(
        configs,
        {"x=off": [run(100), run(300), run(100)], "x=on": [run(90), run(270)]},
        "real",
        "...",
    )
    floored = bench.build_configs("x", ["off", "on"], ideal=True)
    with_floor = bench.summarize(
        floored,
        {
            "x=off": [run(100), run(300)],
            "x=on": [run(90), run(270)],
            bench.IDEAL_NAME: [run(80), run(240)],
        },
        "real",
        "...",
    )
    # the means: (200 - 180) / (200 - 160)
    assert with_floor["overlap_efficiency"]["x=on"] == pytest.approx(40 / 80)
    assert with_floor["overlap_efficiency_by_floor_per_round"][bench.IDEAL_NAME][
        "x=on"
    ] == pytest.approx(0.5)
    # round 1 had no cost
    assert bench.per_round_efficiency([100, 100], [90, 95], [100, 80]) == pytest.approx(0.25)
    on = doc["configs"][1]
    assert on["step_time_ratio_to_first_per_round"]["rounds"] == pytest.approx([0.9, 0.9])
    assert on["step_time_ratio_to_first_per_round"]["median"] == pytest.approx(0.9)
    # the means: 1.08, a slowdown
    assert on["step_time_ratio_to_first"] == pytest.approx(180 / (500 / 3))
    table = bench.format_markdown(doc)
    assert "| 1.080 | 0.900 (0.90-0.90) |" in table and "read the per-round ratios" in table
    assert doc["configs"][0]["step_time_ratio_to_first_per_round"]["median"] == pytest.approx(1.0)
    assert bench._per_round({}) == "-"  # results written before the column


def test_the_machine_description_names_the_cpu_and_its_bf16_flags(tmp_path):
    """The CPU model and the flags that set bf16 speed, from /proc/cpuinfo's format; unreadable:
    "unknown"-safe."""
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nmodel name\t: Example CPU 9000\nflags\t\t: fpu sse avx512_bf16 amx_tile\n"
    )
    machine = describe_machine(info)
    assert machine["cpu"] == "Example CPU 9000" and machine["bf16_flags"] == [
        "avx512_bf16",
        "amx_tile",
    ]
    assert machine_line(machine).startswith(
        "Machine: Example CPU 9000, "
    ) and "avx512_bf16, amx_tile" in machine_line(machine)
    missing = describe_machine(tmp_path / "absent")
    assert missing["bf16_flags"] == [] and "bf16 flags: none" in machine_line(missing)


def test_bench_calls_a_configuration_whose_repeats_spread_noisy():
    configs = bench.build_configs("x", ["off", "on"], ideal=False)

    def run(ms):
        return bench.RunResult(ms, {"all": 1.0}, {"all": 1.0}, 1.0, [1, 4], "real")

    # One slow round of "off" (10567 against 7969 / 8290, as measured once on this machine) moves
    # its mean by 10%.
    doc = bench.summarize(
        configs,
        {"x=off": [run(10567), run(8290), run(7969)], "x=on": [run(7027), run(7355)]},
        "real",
        "overlap bench ...",
    )
    assert doc["noisy"] == {"x=off": pytest.approx((10567 - 7969) / ((10567 + 8290 + 7969) / 3))}
    table = bench.format_markdown(doc)
    assert (
        "**NOISY**" in table
        and "`x=off` 7969-10567 ms (29% of its mean)" in table
        and "x=on`" not in table
    )
    quiet = bench.summarize(
        configs, {"x=off": [run(8000), run(8100)], "x=on": [run(7000)]}, "real", "..."
    )
    assert quiet["noisy"] == {} and "NOISY" not in bench.format_markdown(quiet)


def test_bench_splits_the_modelled_links_exposure_into_peer_wait_and_link():
    configs = bench.build_configs("x", ["off", "on"], ideal=False)
    peer = {"ep_dispatch": 30.0, "all": 30.0}
    off = bench.RunResult(
        100, {"ep_dispatch": 50.0, "dp_rs": 5.0, "all": 55.0}, {}, 1.0, [1, 4], "model", {}, peer
    )
    on = bench.RunResult(
        90, {"ep_dispatch": 32.0, "dp_rs": 5.0, "all": 37.0}, {}, 1.0, [1, 4], "model", {}, peer
    )
    doc = bench.summarize(configs, {"x=off": [off], "x=on": [on]}, "model", "overlap bench ...")
    row = doc["configs"][1]
    assert row["exposed_hidden_share_vs_first"] == {
        "dp": pytest.approx(0.0),
        "ep": pytest.approx(18 / 50),
    }
    # The link exposed 20 ms without and 2 ms with: it hides 90% of the link's part; dp has no known
    # split.
    assert row["link_exposed_hidden_share_vs_first"] == {"ep": pytest.approx(0.9)}
    table = bench.format_markdown(doc)
    assert "| x=on | 32.0 | 30.0 | 2.0 | ep 0.90 |" in table
    real = bench.summarize(
        configs,
        {
            "x=off": [bench.RunResult(100, {"all": 5.0}, {}, 1.0, [1, 4], "real")],
            "x=on": [bench.RunResult(90, {"all": 4.0}, {}, 1.0, [1, 4], "real")],
        },
        "real",
        "overlap bench ...",
    )
    assert "link_exposed_hidden_share_vs_first" not in real["configs"][1]
    assert "peer wait" not in bench.format_markdown(real)


def test_family_floor_gives_its_own_efficiency_column():
    configs = bench.build_configs("x.y", ["false", "true"], ideal=True, families=["ep"])
    assert [c.name for c in configs][2:] == [bench.IDEAL_NAME, "ideal (no ep communication)"]
    assert configs[3].run_flags == ["--comm-mode", "none:ep"] and configs[3].floor
    for bad in (["ep_dispatch"], ["ep", "ep"], ["foo"]):
        with pytest.raises(ConfigError, match="--ideal-family"):
            bench.build_configs("x.y", ["a", "b"], ideal=False, families=bad)
    assert bench.build_configs("x.y", ["a", "b"], ideal=False, families=["EP"])[2].run_flags == [
        "--comm-mode",
        "none:ep",
    ]

    def run(ms):
        return bench.RunResult(ms, {"all": 1.0}, {"all": 1.0}, 400.0, [1, 4], "real")

    results = {
        "x.y=false": [run(100)],
        "x.y=true": [run(80)],
        bench.IDEAL_NAME: [run(60)],
        "ideal (no ep communication)": [run(70)],
    }
    doc = bench.summarize(configs, results, "real", "overlap bench ...")
    assert doc["overlap_efficiency"] == {
        "x.y=true": pytest.approx(0.5)
    }  # the full floor stays the headline
    assert doc["overlap_efficiency_by_floor"]["ideal (no ep communication)"] == {
        "x.y=true": pytest.approx(2 / 3)
    }
    assert doc["floors_step_time_ms"] == {bench.IDEAL_NAME: 60, "ideal (no ep communication)": 70}
    table = bench.format_markdown(doc)
    assert "eff. vs ideal (no communication) | eff. vs ideal (no ep communication) |" in table
    assert "| 0.50 | 0.67 |" in table


def test_link_floor_runs_the_baseline_on_the_plain_loopback():
    """`--ideal-link`: the baseline again with `--network real`, which replaces the common
    `--network` (run refuses a flag given twice), every other option kept; it gets its own
    efficiency column like the other floors."""
    configs = bench.build_configs("x.y", ["false", "true"], ideal=False, families=["pp"], link=True)
    floor = configs[-1]
    assert floor.name == bench.LINK_FLOOR_NAME and floor.floor
    assert floor.overrides == ["x.y=false"] and floor.run_flags == ["--network", "real"]
    options = [
        "-ng",
        "2",
        "--network",
        "model:1ms,10MB/s,pp",
        "-pp",
        "2",
        "--network=tbf:1gbit",
        "--max_steps",
        "6",
    ]
    assert bench.common_run_options(options, [], with_value=("--network",)) == [
        "-ng",
        "2",
        "-pp",
        "2",
        "--max_steps",
        "6",
    ]
    assert bench.common_run_options(options, []) == options

    def run(ms):
        return bench.RunResult(ms, {"all": 1.0}, {"all": 1.0}, 400.0, [1, 4], "real")

    results = {
        "x.y=false": [run(100)],
        "x.y=true": [run(80)],
        "ideal (no pp communication)": [run(60)],
        bench.LINK_FLOOR_NAME: [run(75)],
    }
    doc = bench.summarize(configs, results, "model", "overlap bench ...")
    assert doc["overlap_efficiency_by_floor"][bench.LINK_FLOOR_NAME] == {
        "x.y=true": pytest.approx(0.8)
    }
    assert "eff. vs ideal (no link time) |" in bench.format_markdown(doc)


def test_comm_mode_none_for_one_family_only():
    from overlap.parallel import comm

    assert comm.parse_mode("none:ep,dp") == ("none", frozenset({"ep", "dp"}))
    assert comm.parse_mode("none:EP") == ("none", frozenset({"ep"}))
    assert comm.parse_mode("real") == ("real", None)
    for bad in ("none:", "real:ep", "fake", "none:ep_dispatch", "none:xyz", "none:ep,ep"):
        with pytest.raises(ConfigError, match="--comm-mode"):
            comm.parse_mode(bad)
    with comm.using(comm.CommSession("none:ep")):
        assert comm.session().is_free("ep_dispatch") and not comm.session().is_free("dp_rs")
    assert not comm.session().is_free("ep_dispatch")


def test_named_configs_peers_and_hidden_share_by_family():
    configs = bench.with_ideal(
        [
            bench.parse_named_config("off:ddp.overlap_grad_reduce=false"),
            bench.parse_named_config("on:ddp.overlap_grad_reduce=true;ddp.bucket_size=10"),
            bench.parse_named_config("torch DDP:ddp.impl=torch_ddp"),
        ],
        ideal=False,
    )
    assert configs[1].overrides == ["ddp.overlap_grad_reduce=true", "ddp.bucket_size=10"]
    with pytest.raises(ConfigError):
        bench.parse_named_config("no colon here")

    def run(ms, exposed):
        return bench.RunResult(ms, exposed, exposed, 400.0, [1, 4], "real", {"all": 1.0})

    results = {
        "off": [run(100, {"all": 30.0, "dp_rs": 20.0, "ep_dispatch": 10.0})],
        "on": [run(90, {"all": 15.0, "dp_rs": 5.0, "ep_dispatch": 10.0})],
        "torch DDP": [run(85, {})],
    }
    doc = bench.summarize(configs, results, "real", "overlap bench ...")
    on, peer = doc["configs"][1], doc["configs"][2]
    assert on["exposed_hidden_share_vs_first"] == {
        "dp": pytest.approx(0.75),
        "ep": pytest.approx(0.0),
    }
    assert peer["comm_traced"] is False and "exposed_hidden_share_vs_first" not in peer
    assert "n/a (peer" in bench.format_markdown(doc)
