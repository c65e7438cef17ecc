"""Two runs in one process keep their run state apart: the state that used to be process-wide
belongs to the run's objects. A model's queued weight-gradient GEMMs (delay_wgrad_compute) are its
own, and another model alive beside it neither sees nor runs them; a run's communication session
(its mode, NCCL's rules, its recorded program, its modelled link with the link's clocks and launch
boards) and its tracer recorder (events, spans, timeline) are its own, and a session or recorder
active inside or after another sees neither its mode nor its records nor its link; a dry run's
balanced answers to the split-size reads are its own, and a run beside it reads for real. (The
tests' shared worlds run many jobs in one process per rank: a leak would carry one test's state into
the next.) What stays process-wide, and why, is said where it lives: the process groups
(`overlap.parallel.groups`), the ops in flight on them (`overlap.parallel.comm`), the CUDA surface
and its named streams (`overlap.parallel.streams`)."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from overlap.config.mixed_precision import Precision
from overlap.errors import ConfigError
from overlap.layers.moe import split_sizes
from overlap.layout import ParallelLayout, resolve_pipeline_layout
from overlap.model.gpt import GPTModel, model_chunks
from overlap.parallel import comm, link_model
from overlap.parallel.program import Post, ProgramRecorder
from overlap.parallel.state import ParallelState
from overlap.parallel.trace import Recorder, RulesTimeline, recorder, recording
from tests.configs import bare_kernels, bare_plan, moe_model
from tests.world import run_world


def _tiny_moe():
    return moe_model(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=64,
        seq_length=8,
        expert_model_parallel_size=1,
        moe_ffn_hidden_size=16,
        ffn_hidden_size=64,
    )


def _two_models_delaying_one() -> tuple[int, int, int, bool, bool]:
    """Two models built side by side, one backward each, the first's store delaying: (GEMMs queued
    in the first's store, in the second's, after the first's flush; the first's weights had no
    gradient before its flush, every weight of the second had one at once)."""
    ps = ParallelState(ParallelLayout(world_size=dist.get_world_size()))
    a, b = (
        GPTModel(_tiny_moe(), ps, bare_plan(), Precision.of(_tiny_moe()), bare_kernels(_tiny_moe()))
        for _ in range(2)
    )
    assert a.wgrad_store is not b.wgrad_store
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    for model in (a, b):
        model.init_weights(5)
    with a.wgrad_store.delaying(True):
        loss, aux = a(tokens[:, :-1], tokens[:, 1:])
        (loss + aux).backward()
        loss, aux = b(tokens[:, :-1], tokens[:, 1:])
        (loss + aux).backward()  # b's store is not delaying: its weight gradients run now
    queued_a, queued_b = len(a.wgrad_store.queue), len(b.wgrad_store.queue)
    a_delayed = a.layers[0].self_attention.linear_qkv.weight.grad is None
    a.wgrad_store.flush()
    b_complete = all(p.grad is not None for p in b.parameters())
    return queued_a, queued_b, len(a.wgrad_store.queue), a_delayed, b_complete


def test_two_models_keep_their_queued_weight_gradients_apart():
    """The first model's linears and experts queue in its own store (attention qkv and proj, and
    the experts' two grouped GEMMs, per layer, plus the output layer); the second model, built
    beside it with a store that is not delaying, computes every weight gradient in its backward and
    queues nothing."""
    ((queued_a, queued_b, left, a_delayed, b_complete),) = run_world(1, _two_models_delaying_one)
    assert queued_a >= 2 * 4 + 1 and a_delayed
    assert queued_b == 0 and b_complete
    assert left == 0


def _two_builds() -> bool:
    ps = ParallelState(ParallelLayout(world_size=dist.get_world_size()))
    model = _tiny_moe()
    pipeline = resolve_pipeline_layout(model, 1)
    (first,), (second,) = (
        model_chunks(model, ps, pipeline, bare_plan(), Precision.of(model), bare_kernels(model))
        for _ in range(2)
    )
    return first.wgrad_store is second.wgrad_store


def test_each_build_of_a_rank_s_chunks_has_its_own_store():
    """`model_chunks` gives the chunks of one build one store (the executor's queue spans them),
    and a second build a store of its own."""
    assert run_world(1, _two_builds) == [False]


def _kinds(program: ProgramRecorder) -> list[str]:
    return [op.kind for e in program.stop() if isinstance(e, Post) for op in e.ops]


def _two_sessions() -> dict:
    """A run whose session frees EP communication ("none:ep") records its program; a second
    session, real and recording its own, is made active inside it, then the first's continues, and
    after both the plain session is back."""
    world = dist.group.WORLD
    floor = comm.CommSession("none:ep", program=ProgramRecorder(enabled=True))
    real = comm.CommSession(program=ProgramRecorder(enabled=True))
    with comm.using(floor):
        freed = comm.all_reduce(torch.ones(2), world, "ep_dispatch").wait()
        with comm.using(real):
            summed = comm.all_reduce(torch.ones(2), world, "ep_dispatch").wait()
        comm.all_reduce(torch.ones(2), world, "dp_ar").wait()
    after = comm.session()
    return {
        "freed": freed.tolist(),
        "summed": summed.tolist(),
        "floor": _kinds(floor.program),
        "real": _kinds(real.program),
        "after": (after.program is None, after.is_free("ep_dispatch"), after.nccl_rules),
    }


def test_two_comm_sessions_keep_their_mode_and_records_apart():
    """The floor's EP all-reduce is free (nothing moves, nothing is posted), the inner real
    session's is summed over both ranks and posted in its own program only, the floor's DP
    all-reduce after it in the floor's program only; once both ended, the plain session is active
    (real, no rules, nothing recorded). Under OVERLAP_TEST_NCCL_RULES=1 the job's own rules session
    is what comes back, which this test does not read."""
    for rank in run_world(2, _two_sessions):
        assert rank["freed"] == [1.0, 1.0] and rank["summed"] == [2.0, 2.0]
        assert rank["floor"] == ["dp_ar"] and rank["real"] == ["ep_dispatch"]
        assert rank["after"][1] is False


def test_a_session_under_nccl_rules_refuses_a_modelled_link_and_leaves_no_trace():
    """NCCL's rules and the modelled link exclude each other: a session with both is refused
    (ConfigError naming --network) before it can become active."""
    with pytest.raises(ConfigError, match="--network"):
        comm.CommSession(nccl_rules=True, link=link_model.LinkModel(1e-3, 1e9, ("tp",)))
    assert not comm.session().nccl_rules and comm.session().network is None


def _timed(handle: comm.CommHandle) -> float:
    handle.wait()
    return handle.event.t_done - handle.event.t_launch


def _two_links() -> dict:
    """A run on a slow modelled TP link launches an all-reduce and leaves it in flight; inside it a
    second run on a fast link of its own, then a third on real links, each time one all-reduce;
    then the first run waits for its own."""
    world = dist.group.WORLD
    slow = comm.CommSession(link=link_model.LinkModel(0.6, 1e9, ("tp",)))
    fast = comm.CommSession(link=link_model.LinkModel(0.02, 1e9, ("tp",)))
    with comm.using(slow):
        held = comm.all_reduce(torch.ones(2), world, "tp_ar")
        with comm.using(fast):
            quick = _timed(comm.all_reduce(torch.ones(2), world, "tp_ar"))
            with comm.using(comm.CommSession()):
                real = _timed(comm.all_reduce(torch.ones(2), world, "tp_ar"))
        slowed = _timed(held)
    boards = {run.network.on(world).board.path for run in (slow, fast)}
    return {"slow": slowed, "fast": quick, "real": real, "boards": len(boards)}


def test_two_modelled_links_keep_their_clocks_and_boards_apart():
    """The slow run's all-reduce takes its link's 0.6 s; the fast run's, launched while the slow
    one is still on the slow run's link, takes its own 20 ms and does not queue behind it (on one
    shared clock it would complete after the slow op, 0.6 s on); the real run's is not held back at
    all. Each modelled run opened a launch board of its own."""
    for rank in run_world(2, _two_links):
        assert rank["slow"] >= 0.5999
        assert 0.0199 <= rank["fast"] < 0.5
        assert rank["real"] < 0.5
        assert rank["boards"] == 2


def test_a_dry_run_s_balanced_answers_stay_in_its_own_context():
    """While a dry run answers the split-size reads with balanced routing, a run beside it (another
    thread) reads for real, and once the dry run's block ends nothing answers any more."""
    answered: list[str] = []
    seen: dict[str, list[int] | None] = {}

    def real_run() -> None:
        seen["beside"] = split_sizes.loop_permutation_counts(8, 2, 4)

    with split_sizes.balanced_routing(answered.append):
        beside = threading.Thread(target=real_run)
        beside.start()
        beside.join()
        seen["dry"] = split_sizes.loop_permutation_counts(8, 2, 4)
    seen["after"] = split_sizes.loop_permutation_counts(8, 2, 4)
    assert seen == {"beside": None, "dry": [4, 4, 4, 4], "after": None}
    assert answered == [split_sizes.LOOP_PERMUTATION] * 4


def _two_recorders() -> dict:
    """The job's recorder, a second run's recorder active inside it with NCCL's rules' timeline,
    one collective and one span in each."""
    world = dist.group.WORLD
    outer = recorder()
    outer.drain()
    inner = Recorder(timeline=RulesTimeline())
    with outer.span("outer"):
        comm.all_reduce(torch.ones(2), world, "dp_ar").wait()
    with recording(inner):
        with recorder().span("inner"):
            comm.all_reduce(torch.ones(2), world, "tp_ar").wait()
        inner_sees = comm.completion_visible()
    outer_sees = comm.completion_visible()
    out_events, out_spans = outer.drain()
    in_events, in_spans = inner.drain()
    return {
        "outer": ([e.kind for e in out_events], [s.name for s in out_spans], outer_sees),
        "inner": ([e.kind for e in in_events], [s.name for s in in_spans], inner_sees),
    }


def test_two_recorders_keep_their_events_and_timelines_apart():
    """Each collective and span lands in the recorder active where it ran; the inner run's rules
    timeline hides completion from the host only while it is active."""
    for rank in run_world(2, _two_recorders):
        assert rank["inner"] == (["tp_ar"], ["inner"], False)
        outer_kinds, outer_spans, _sees = rank["outer"]
        assert "tp_ar" not in outer_kinds and "dp_ar" in outer_kinds
        assert outer_spans == ["outer"]


def _in_a_fresh_thread(fn):
    """`fn()` on a new thread, which starts from an empty context as autograd's device threads do:
    its result, or the exception it raised."""
    import threading

    out = {}

    def body():
        try:
            out["value"] = fn()
        except RuntimeError as exc:
            out["value"] = exc

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    return out["value"]


def test_a_thread_without_the_run_s_context_finds_the_one_active_run():
    """Torch's autograd engine runs CUDA backward on its own device threads, which never see the
    caller's context variables: such a thread gets the process's one active session and recorder,
    a plain session where none is active, and an error naming the problem where two are (it cannot
    tell which is its own)."""
    from overlap.parallel.trace import Recorder, recorder, recording

    run, rec = comm.CommSession("none:ep"), Recorder()
    with recording(rec), comm.using(run):
        assert _in_a_fresh_thread(comm.session) is run
        assert _in_a_fresh_thread(recorder) is rec
        with comm.using(run):  # the same run entered again is still one run
            assert _in_a_fresh_thread(comm.session) is run
        with comm.using(comm.CommSession()):
            refused = _in_a_fresh_thread(comm.session)
            assert comm.session() is not run  # a thread with the context gets its own
    assert isinstance(refused, RuntimeError) and "2 runs are active" in str(refused)
    after = _in_a_fresh_thread(comm.session)
    assert after is not run and not after.is_free("ep_dispatch")
