"""Real ``runworkpump`` processes sharing one database.

Handlers (tests/app/workpump.py) record every execution in mp_execution with the
process id and attempt, so the tests can check the guarantees: no row lost, per-stream
order kept, duplicates only for rows in flight at a kill. Timings are shortened through
WORKPUMP_JSON; waits are on database conditions with deadlines.
"""

from __future__ import annotations

import json
import signal
import uuid
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pytest

from tests.helpers import FAST_PROCESS, got_going, run_sql, scalar, unfinished_runs, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


FAST = FAST_PROCESS


@pytest.fixture
def spawn(pump_process: Callable[..., Any]) -> Callable[..., Any]:
    """Start runworkpump processes with FAST timings, overridden per call."""
    return lambda *args, **settings: pump_process(*args, timings={**FAST, **settings})


def produce_backlog(streams: int, per_stream: int, seconds: float = 0.0, instances: int = 0) -> int:
    """Rows of all four categories, ordered per stream; returns the number of work rows.

    With ``instances`` a row's handler, once it has recorded its start, holds until that
    many processes have started rows.
    """
    subscribers = json.dumps(
        [
            {"category": "perspective_event", "name": "mp.perspective"},
            {"category": "receptor", "name": "mp.receptor"},
        ]
    )
    for n in range(per_stream):
        for s in range(streams):
            payload = json.dumps({"n": n, "seconds": seconds, "instances": instances})
            run_sql("SELECT workpump.send('mp.outbox', %s::jsonb, %s)", [payload, f"out-{s}"])
            run_sql(
                "SELECT workpump.receive(%s, 'mp.inbox', %s::jsonb, %s)",
                [uuid.uuid4(), payload, f"in-{s}"],
            )
            run_sql(
                "SELECT workpump.emit('mp.event', %s::jsonb, %s, %s::jsonb)",
                [payload, f"ev-{s}", subscribers],
            )
    return streams * per_stream * 4


def undone() -> int:
    return scalar(
        "SELECT (SELECT count(*) FROM workpump_outbox WHERE done_at IS NULL)"
        " + (SELECT count(*) FROM workpump_inbox WHERE done_at IS NULL)"
        " + (SELECT count(*) FROM workpump_perspective_event WHERE done_at IS NULL)"
        " + (SELECT count(*) FROM workpump_receptor_processing WHERE done_at IS NULL)"
    )


def assert_stream_order() -> None:
    """Within every (category, stream), first executions started in n order."""
    rows = run_sql(
        "SELECT category, stream, n, min(started_at) AS first FROM mp_execution "
        "GROUP BY category, stream, n, work_id ORDER BY category, stream, first"
    )
    seen: dict[tuple[str, str], list[int]] = defaultdict(list)
    for row in rows:
        seen[(row["category"], row["stream"])].append(row["n"])
    assert seen
    for key, ns in seen.items():
        assert ns == sorted(ns), f"stream {key} ran out of order: {ns}"


def test_two_processes_share_a_backlog_and_every_row_runs_exactly_once(executions, spawn):
    # 50 ms a row: the first instance holds at most a few streams' runs at a time, so the
    # backlog outlasts the second one's start (at 10 ms, a loaded machine's second
    # instance could find the first had taken every stream)
    total = produce_backlog(streams=6, per_stream=5, seconds=0.05, instances=2)

    first = spawn("--drain", "--concurrency", "3")
    second = spawn("--drain", "--concurrency", "3")
    out_first, _ = first.communicate(timeout=120)
    out_second, _ = second.communicate(timeout=120)

    assert first.returncode == 0, out_first
    assert second.returncode == 0, out_second
    assert undone() == 0
    assert scalar("SELECT count(DISTINCT work_id) FROM mp_execution") == total
    assert scalar("SELECT count(*) FROM mp_execution") == total  # no duplicates without faults
    pids = {row["pid"] for row in run_sql("SELECT DISTINCT pid FROM mp_execution")}
    assert pids == {first.pid, second.pid}, "both processes should have taken work"
    assert_stream_order()
    assert "started:" in out_first and "stopped: drained" in out_first
    assert scalar("SELECT count(*) FROM workpump_service_instance") == 0


def test_kill_9_moves_the_killed_instances_rows_to_the_survivor(executions, spawn):
    # 150 ms handlers: on a loaded machine the kill still finds the victim mid-handler
    # (at 50 ms, a slow poll of got_going let the backlog drain first, once in CI)
    total = produce_backlog(streams=8, per_stream=6, seconds=0.15)
    # A 3 s lock-loss grace (one fast beat): the survivor evicts the victim 3-4 s after
    # the kill, time enough to read what the victim held.
    timings = {
        "HEARTBEAT_INTERVAL_SECONDS": 3,
        "HEARTBEAT_SLOW_INTERVAL_SECONDS": 6,
        "STALE_AFTER_SECONDS": 6,
    }
    victim = spawn("--concurrency", "4", **timings)
    survivor = spawn("--concurrency", "4", **timings)
    assert wait_until(lambda: got_going(victim.pid, 10)), "the victim never got going"

    victim_id = scalar(
        "SELECT instance_id FROM workpump_service_instance WHERE process_id = %s", [victim.pid]
    )
    victim.send_signal(signal.SIGKILL)
    killed_at = scalar("SELECT clock_timestamp()")
    victim.wait(10)
    # A statement the victim sent just before the kill (a handler recording its start)
    # still commits on the server; its sessions end only after. Read what it left then.
    assert wait_until(
        lambda: (
            scalar(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE application_name LIKE %s OR application_name = %s",
                [f"workpump:{str(victim_id)[:8]}:%", f"workpump-{victim_id}"],
            )
            == 0
        ),
        timeout=10,
    ), "the killed instance's database sessions did not end"
    # Rows whose outcome the kill lost: started by the victim and still leased to it (a
    # handler may have finished with its completion not yet flushed). Eviction has not
    # run yet: it waits for a probe to see the victim's lock missing, then the grace.
    in_flight = {
        row["work_id"]
        for row in run_sql(
            "SELECT e.work_id FROM mp_execution e WHERE e.pid = %(pid)s AND e.work_id IN ("
            " SELECT work_id FROM workpump_outbox WHERE instance_id = %(i)s"
            " UNION ALL SELECT work_id FROM workpump_inbox WHERE instance_id = %(i)s"
            " UNION ALL SELECT work_id FROM workpump_perspective_event"
            "   WHERE instance_id = %(i)s"
            " UNION ALL SELECT work_id FROM workpump_receptor_processing"
            "   WHERE instance_id = %(i)s)",
            {"pid": victim.pid, "i": victim_id},
        )
    }
    assert in_flight
    assert (
        scalar("SELECT count(*) FROM workpump_service_instance WHERE instance_id = %s", [victim_id])
        == 1
    ), "evicted before the lost outcomes were read: raise HEARTBEAT_INTERVAL_SECONDS"

    assert wait_until(lambda: undone() == 0, timeout=90), "the survivor did not finish the work"
    survivor.send_signal(signal.SIGTERM)
    output, _ = survivor.communicate(timeout=60)
    assert survivor.returncode == 0, output

    # Nothing lost; every row ran; a second run only for rows in flight at the kill.
    assert scalar("SELECT count(DISTINCT work_id) FROM mp_execution") == total
    twice = {
        row["work_id"]
        for row in run_sql("SELECT work_id FROM mp_execution GROUP BY work_id HAVING count(*) > 1")
    }
    unexplained = run_sql(
        "SELECT work_id, category, stream, n, pid, attempt, started_at, finished_at"
        " FROM mp_execution WHERE work_id = ANY(%s) ORDER BY work_id, started_at",
        [list(twice - in_flight)],
    )
    assert twice <= in_flight, (
        f"victim pid {victim.pid} killed at {killed_at}, survivor pid {survivor.pid}; "
        f"executions of re-run rows the victim did not hold: {unexplained}"
    )
    # Handlers the kill interrupted certainly lost their outcome: each ran again.
    interrupted = {
        row["work_id"]
        for row in run_sql(
            "SELECT work_id FROM mp_execution WHERE pid = %s AND finished_at IS NULL", [victim.pid]
        )
    }
    assert interrupted
    assert interrupted <= twice
    failover = scalar(
        "SELECT extract(epoch FROM min(started_at) - %s) FROM mp_execution "
        "WHERE pid = %s AND work_id = ANY(%s)",
        [killed_at, survivor.pid, list(twice)],
    )
    print(
        f"\nfailover after kill -9: {float(failover):.2f} s "
        f"(stale after {FAST['STALE_AFTER_SECONDS']} s, probe every "
        f"{FAST['STALE_PEER_PROBE_INTERVAL_SECONDS']} s); {len(twice)} rows re-run"
    )
    assert float(failover) < FAST["STALE_AFTER_SECONDS"] + 5
    assert_stream_order()


def test_sigterm_lets_in_flight_handlers_finish_and_deregisters(executions, spawn):
    produce_backlog(streams=4, per_stream=3, seconds=1.0)
    process = spawn("--concurrency", "2")
    assert wait_until(lambda: unfinished_runs(process.pid) == 2)
    instance_id = scalar(
        "SELECT instance_id FROM workpump_service_instance WHERE process_id = %s", [process.pid]
    )

    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=60)

    assert process.returncode == 0, output
    assert "received SIGTERM" in output
    # the handlers that were running finished; nothing was abandoned half-way
    assert unfinished_runs(process.pid) == 0
    # its rows are released and its instance row is gone
    assert scalar("SELECT count(*) FROM workpump_service_instance") == 0
    held = scalar(
        "SELECT (SELECT count(*) FROM workpump_outbox WHERE instance_id = %(i)s)"
        " + (SELECT count(*) FROM workpump_inbox WHERE instance_id = %(i)s)"
        " + (SELECT count(*) FROM workpump_perspective_event WHERE instance_id = %(i)s)"
        " + (SELECT count(*) FROM workpump_receptor_processing WHERE instance_id = %(i)s)",
        {"i": instance_id},
    )
    assert held == 0
    # what it did not start is claimable again, with its attempt given back
    assert (
        scalar("SELECT count(*) FROM workpump_outbox WHERE done_at IS NULL AND attempts > 0") == 0
    )


def test_handlers_raising_base_exceptions_fail_their_attempts_and_drain_exits_zero(spawn):
    import django_workpump as workpump

    kinds = ["SystemExit", "KeyboardInterrupt", "Halt"]
    ids = {kind: workpump.send("mp.raise", {"raise": kind}, max_attempts=2) for kind in kinds}
    process = spawn("--drain", "--concurrency", "1", "--topics", "mp.raise")
    output, _ = process.communicate(timeout=60)

    # One dispatch thread ran all six attempts and the worker drained: none killed it.
    assert process.returncode == 0, output
    assert "drained: nothing left to claim (exit 0)" in output
    rows = {
        r["work_id"]: r
        for r in run_sql(
            "SELECT work_id, attempts, instance_id, failure_reason, last_error,"
            " dead_lettered_at FROM workpump_outbox"
        )
    }
    for kind, message_id in ids.items():
        stored = rows[message_id]
        assert stored["attempts"] == 2, (kind, stored)
        assert stored["instance_id"] is None
        assert stored["dead_lettered_at"] is not None
        assert stored["failure_reason"] == "max_attempts"
        assert kind in stored["last_error"].splitlines()[0]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_during_startup_stops_it_cleanly_and_deregisters(executions, pump_process, signum):
    produce_backlog(streams=1, per_stream=1)
    process = pump_process(timings=FAST, extra_env={"WORKPUMP_TEST_PAUSE_AFTER_REGISTERING": "1"})
    assert process.stdout is not None and process.stdin is not None
    # Registered, not yet claiming: the moment a deploy's stop can come.
    assert process.stdout.readline().strip() == "paused after registering"
    assert scalar("SELECT count(*) FROM workpump_service_instance") == 1

    process.send_signal(signum)
    process.stdin.write("go on\n")
    process.stdin.flush()
    output, _ = process.communicate(timeout=60)

    assert process.returncode == 0, output
    assert f"received {signal.Signals(signum).name}" in output
    # Nothing ran, nothing is held, and the instance row is gone.
    assert scalar("SELECT count(*) FROM mp_execution") == 0
    assert scalar("SELECT count(*) FROM workpump_service_instance") == 0
    assert undone() == 4
    assert (
        scalar(
            "SELECT (SELECT count(*) FROM workpump_outbox WHERE instance_id IS NOT NULL)"
            " + (SELECT count(*) FROM workpump_inbox WHERE instance_id IS NOT NULL)"
            " + (SELECT count(*) FROM workpump_perspective_event WHERE instance_id IS NOT NULL)"
            " + (SELECT count(*) FROM workpump_receptor_processing WHERE instance_id IS NOT NULL)"
        )
        == 0
    )


def test_kill_9_mid_run_the_survivor_runs_the_stream_on_from_its_first_unfinished_row(
    executions, spawn
):
    for n in range(30):
        payload = json.dumps({"n": n, "seconds": 0.1})
        run_sql("SELECT workpump.send('mp.outbox', %s::jsonb, 'hot')", [payload])
    victim = spawn("--concurrency", "2")
    assert wait_until(
        lambda: scalar("SELECT count(*) FROM mp_execution WHERE pid = %s", [victim.pid]) >= 5
    ), "the victim never got going"
    victim_id = scalar(
        "SELECT instance_id FROM workpump_service_instance WHERE process_id = %s", [victim.pid]
    )
    # The victim holds a run: the stream's rows after the running one are leased to it too.
    assert scalar("SELECT count(*) FROM workpump_outbox WHERE instance_id = %s", [victim_id]) > 1
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)
    survivor = spawn("--concurrency", "2")
    assert wait_until(lambda: undone() == 0, timeout=90), "the survivor did not finish the run"
    survivor.send_signal(signal.SIGTERM)
    output, _ = survivor.communicate(timeout=60)
    assert survivor.returncode == 0, output

    by_victim = run_sql(
        "SELECT n, finished_at FROM mp_execution WHERE pid = %s ORDER BY started_at", [victim.pid]
    )
    by_survivor = [
        row["n"]
        for row in run_sql(
            "SELECT n FROM mp_execution WHERE pid = %s ORDER BY started_at", [survivor.pid]
        )
    ]
    # The victim ran a prefix in order; the survivor the rest, in order, from the first row
    # whose completion the kill may have lost: nothing skipped, nothing reordered.
    assert [row["n"] for row in by_victim] == list(range(len(by_victim)))
    start = by_survivor[0]
    assert by_survivor == list(range(start, 30))
    assert start <= len(by_victim)
    assert all(row["finished_at"] is not None for row in by_victim[:start])
    assert_stream_order()
