"""The replay of recorded communication programs under NCCL's rules (`overlap.parallel.program`), on
programs written by hand: each rule (collectives by position, messages in order per pair with tags
ignored, rendezvous sends, one stream per communicator, batches progress together) found where it is
broken and not where it holds."""

from __future__ import annotations

from overlap.parallel.program import (
    TIMING,
    OpRecord,
    Post,
    ProgramRecorder,
    StepEnd,
    Wait,
    early_send_waits,
    queue_stalls,
    replay,
    summarize,
)


def send(peer: int, n: int = 8, kind: str = "pp_send_fwd") -> OpRecord:
    return OpRecord(kind, "send", "float32", n, peer)


def recv(peer: int, n: int = 8, kind: str = "pp_recv_fwd") -> OpRecord:
    return OpRecord(kind, "recv", "float32", n, peer)


def coll(
    kind: str = "dp_ar", op: str = "all_reduce", n: int = 16, dtype: str = "float32"
) -> OpRecord:
    return OpRecord(kind, op, dtype, n)


def post(unit: int, group: str, *ops: OpRecord, members=(0, 1)) -> Post:
    return Post(unit, group, tuple(members), ops)


def test_two_ranks_that_each_send_first_on_one_group_deadlock():
    """PP = 2 with a virtual pipeline, both directions on one group: each send sits in front of the
    receive its peer's send needs."""
    programs = {
        0: [post(0, "pp", send(1)), post(1, "pp", recv(1)), Wait(1)],
        1: [post(0, "pp", send(0)), post(1, "pp", recv(0)), Wait(1)],
    }
    problems = replay(programs)
    assert problems and problems[0].startswith("deadlock")
    assert any("queued behind" in line for line in problems)


def test_the_same_exchange_as_one_batch_or_on_a_group_per_direction_completes():
    batched = {r: [post(0, "pp", send(1 - r), recv(1 - r)), Wait(0)] for r in (0, 1)}
    assert replay(batched) == []
    split = {
        0: [post(0, "up", send(1)), post(1, "down", recv(1)), Wait(1), Wait(0)],
        1: [post(0, "down", send(0)), post(1, "up", recv(0)), Wait(1), Wait(0)],
    }
    assert replay(split) == []


def test_a_ring_of_batches_completes_and_unbatched_sends_first_deadlock():
    ring = {
        r: [post(0, "tp", send((r + 1) % 3), recv((r - 1) % 3), members=(0, 1, 2)), Wait(0)]
        for r in range(3)
    }
    assert replay(ring) == []
    unbatched = {
        r: [
            post(0, "tp", send((r + 1) % 3), members=(0, 1, 2)),
            post(1, "tp", recv((r - 1) % 3), members=(0, 1, 2)),
            Wait(1),
        ]
        for r in range(3)
    }
    assert replay(unbatched)[0].startswith("deadlock")


def test_a_wait_before_the_peer_can_post_deadlocks_across_groups():
    """Rank 0 waits for its send on one group before posting the collective rank 1 waits for
    first."""
    programs = {
        0: [post(0, "pp", send(1)), Wait(0), post(1, "dp", coll())],
        1: [post(0, "dp", coll()), Wait(0), post(1, "pp", recv(0)), Wait(1)],
    }
    assert replay(programs)[0].startswith("deadlock")


def test_collectives_must_match_by_position():
    assert replay({r: [post(0, "dp", coll()), Wait(0)] for r in (0, 1)}) == []
    swapped = {
        0: [post(0, "dp", coll(n=16)), post(1, "dp", coll(n=32))],
        1: [post(0, "dp", coll(n=32)), post(1, "dp", coll(n=16))],
    }
    (problem,) = replay(swapped)
    assert "collective #0 differs" in problem and "rank 0" in problem and "rank 1" in problem
    kinds = {
        0: [post(0, "dp", coll(kind="dp_rs", op="reduce_scatter"))],
        1: [post(0, "dp", coll(kind="dp_ar"))],
    }
    assert "differs" in replay(kinds)[0]
    missing = {0: [post(0, "dp", coll()), post(1, "dp", coll())], 1: [post(0, "dp", coll())]}
    assert "never by ranks [1]" in replay(missing)[0]


def test_messages_meet_in_order_whatever_their_tags():
    """The k-th send meets the k-th receive: sizes that differ in that order are a finding, not a
    tag match."""
    programs = {
        0: [post(0, "pp", send(1, 8)), post(1, "pp", send(1, 4))],
        1: [post(0, "pp", recv(0, 4)), post(1, "pp", recv(0, 8)), Wait(0), Wait(1)],
    }
    problems = replay(programs)
    assert "message #0 from rank 0 to rank 1" in problems[0] and "tags are ignored" in problems[0]


def test_an_unmatched_send_is_named():
    programs = {0: [post(0, "pp", send(1))], 1: []}
    assert "that rank 1 never receives" in replay(programs)[0]


def test_all_to_all_splits_must_agree():
    def a2a(inp, out):
        return OpRecord(
            "ep_dispatch", "all_to_all", "bfloat16", sum(inp) * 4, None, (tuple(inp), tuple(out))
        )

    good = {0: [post(0, "ep", a2a([2, 3], [2, 1]))], 1: [post(0, "ep", a2a([1, 4], [3, 4]))]}
    assert replay(good) == []
    bad = {0: [post(0, "ep", a2a([2, 3], [2, 1]))], 1: [post(0, "ep", a2a([1, 4], [2, 4]))]}
    assert any("rank 0 sends 3 rows to rank 1, which expects 2" in p for p in replay(bad))


def test_a_rank_not_recorded_is_taken_as_taking_part():
    assert replay({0: [post(0, "pp", send(1)), Wait(0)]}) == []


def test_a_send_waited_before_it_is_known_to_have_arrived_is_found():
    """Rank 0 waits its send at once, before the gradient that proves rank 1 consumed it: on NCCL
    the send's whole transfer is then on the compute stream. Waited after that gradient (or at the
    step's end, after its last receive) it costs nothing."""
    early = {
        0: [
            post(0, "up", send(1)),
            Wait(0),
            post(1, "down", recv(1, kind="pp_recv_bwd")),
            Wait(1),
            StepEnd(),
        ],
        1: [
            post(0, "up", recv(0)),
            Wait(0),
            post(1, "down", send(0, kind="pp_send_bwd")),
            Wait(1),
            StepEnd(),
        ],
    }
    assert replay(early) == []
    (finding,) = early_send_waits(early)
    assert finding.startswith("rank 0 waits for pp_send_fwd")
    late = {
        0: [
            post(0, "up", send(1)),
            post(1, "down", recv(1, kind="pp_recv_bwd")),
            Wait(1),
            Wait(0),
            StepEnd(),
        ],
        1: early[1],
    }
    assert early_send_waits(late) == []


def test_the_recorder_numbers_units_and_records_only_while_on():
    rec = ProgramRecorder()
    assert rec.post("g", (0, 1), [coll()]) is None
    rec.start()
    unit = rec.post("g", (0, 1), [coll()])
    rec.wait(unit)
    rec.step_end()
    entries = rec.stop()
    assert entries == [Post(0, "g", (0, 1), (coll(),)), Wait(0), StepEnd()]
    assert summarize(entries) == {"dp_ar": {"ops": 1, "elements": 16}}


# --- one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1), issue 47 item 6 ------------------------
def _overlapped_exchange(timing_at_launch: bool) -> dict[int, list]:
    """Two pipeline neighbours on a group per direction, the receive posted early (overlapped p2p),
    compute, then the send; the tracer's timing waits at launch, or right after the compute stream's
    own waits."""
    programs = {}
    for r, (mine, theirs) in enumerate((("up", "down"), ("down", "up"))):
        entries = [post(0, theirs, recv(1 - r))]
        entries += [Wait(0, TIMING)] if timing_at_launch else []
        entries += [post(1, mine, send(1 - r))]
        entries += [Wait(1, TIMING)] if timing_at_launch else []
        entries += [Wait(0), Wait(1)]
        entries += [] if timing_at_launch else [Wait(0, TIMING), Wait(1, TIMING)]
        programs[r] = entries
    return programs


def test_a_timing_wait_at_launch_deadlocks_one_hardware_queue_and_stalls_posts():
    """With one queue, the timing stream's wait for the early receive holds the rank's own send,
    which the peer's receive needs: both ranks stop. With a queue per stream it blocks nothing."""
    at_launch = _overlapped_exchange(timing_at_launch=True)
    assert replay(at_launch) == []
    problems = replay(at_launch, one_queue=True)
    assert problems and "one hardware queue" in problems[0]
    assert any("timing stream waits for pp_recv_fwd" in line for line in problems)
    assert len(queue_stalls(at_launch)) == 2


def test_timing_waits_after_the_compute_waits_hold_nothing_in_one_hardware_queue():
    after = _overlapped_exchange(timing_at_launch=False)
    assert replay(after, one_queue=True) == [] and queue_stalls(after) == []
    assert early_send_waits(after) == []  # the analyses read compute waits only
