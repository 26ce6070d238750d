"""Batches and dependencies in SQL: every way a row ends is counted in its batch, the
callback row is produced once by the ending that takes the last member, and a row sent
with p_after waits until its dependencies end (then runs, or is cancelled per policy).

Rows are produced with workpump.send, leased with claim_work and ended with the outcome
and operator functions; time is passed as p_now.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable, Iterable
from typing import Any

import pytest
from django.db import DataError, transaction

from tests.helpers import T0, at, enroll, run_sql, scalar

pytestmark = pytest.mark.django_db

INSTANCE = uuid.UUID("00000000-0000-0000-0000-0000000000b1")
CALLBACK = json.dumps({"topic": "reports.ready", "payload": {"report": 7}})
FAILED = json.dumps({"topic": "reports.failed", "payload": {}})


def open_batch(
    on_complete: str | None = CALLBACK,
    on_failure: str | None = None,
    parent: uuid.UUID | None = None,
) -> uuid.UUID:
    return scalar(
        "SELECT workpump.open_batch(%s::jsonb, %s::jsonb, %s, p_now => %s)",
        [on_complete, on_failure, parent, T0],
    )


def send(
    batch: uuid.UUID | None = None,
    *,
    max_attempts: int = 10,
    topic: str = "jobs.step",
    after: list[uuid.UUID] | None = None,
    policy: str = "cancel",
) -> uuid.UUID:
    return scalar(
        "SELECT workpump.send(%s, '{}'::jsonb, p_max_attempts => %s, p_batch_id => %s,"
        " p_after => %s::uuid[], p_after_policy => %s)",
        [topic, max_attempts, batch, after, policy],
    )


def seal(batch: uuid.UUID) -> None:
    run_sql("SELECT workpump.seal_batch(%s, %s)", [batch, T0])


def claim(now: Any = T0, max_rows: int = 100) -> dict[uuid.UUID, uuid.UUID]:
    enroll(INSTANCE)
    rows = run_sql(
        "SELECT work_id, lease_token FROM workpump.claim_work(p_instance_id => %s,"
        " p_max_rows => %s, p_categories => ARRAY['outbox'], p_now => %s)",
        [INSTANCE, max_rows, now],
    )
    return {r["work_id"]: r["lease_token"] for r in rows if r["lease_token"] is not None}


def complete(held: dict[uuid.UUID, uuid.UUID], ids: list[uuid.UUID]) -> None:
    rows = run_sql(
        "SELECT status FROM workpump.complete_work(%s, 'outbox', %s::uuid[], %s::uuid[],"
        " p_now => %s)",
        [INSTANCE, ids, [held[i] for i in ids], T0],
    )
    assert [r["status"] for r in rows] == ["done"] * len(ids)


def status(batch: uuid.UUID) -> dict[str, Any]:
    return run_sql("SELECT * FROM workpump_batch WHERE id = %s", [batch])[0]


def callbacks(topic: str = "reports.ready") -> list[dict[str, Any]]:
    rows = run_sql(
        "SELECT work_id, payload::text AS payload, batch_id FROM workpump_outbox WHERE topic = %s",
        [topic],
    )
    return [r | {"payload": json.loads(r["payload"])} for r in rows]


def row(work_id: uuid.UUID) -> dict[str, Any]:
    return run_sql(
        "SELECT scheduled_for::text AS scheduled_for, end_state, failure_reason, last_error,"
        " dead_lettered_at, done_at FROM workpump_outbox WHERE work_id = %s",
        [work_id],
    )[0]


def fail(held: dict[uuid.UUID, uuid.UUID], work_id: uuid.UUID) -> str:
    """Fail a held row's attempt; the status of its outcome."""
    return scalar(
        "SELECT status FROM workpump.fail_work(%s, 'outbox', %s::uuid[], %s::uuid[],"
        " ARRAY['boom'], p_now => %s)",
        [INSTANCE, [work_id], [held[work_id]], T0],
    )


def discard(held: dict[uuid.UUID, uuid.UUID], work_id: uuid.UUID) -> str:
    """Discard a held row; the status of its outcome."""
    return scalar(
        "SELECT status FROM workpump.discard_work(%s, 'outbox', %s::uuid[], %s::uuid[],"
        " ARRAY['no'], p_now => %s)",
        [INSTANCE, [work_id], [held[work_id]], T0],
    )


def dead_letter(work_id: uuid.UUID) -> None:
    run_sql(
        "SELECT * FROM workpump.dead_letter('outbox', %s::uuid[], p_now => %s)", [[work_id], T0]
    )


def requeue(work_id: uuid.UUID) -> None:
    run_sql(
        "SELECT * FROM workpump.requeue_dead('outbox', %s::uuid[], p_now => %s)", [[work_id], T0]
    )


def cancel(work_id: uuid.UUID) -> None:
    run_sql(
        "SELECT * FROM workpump.cancel_work('outbox', %s::uuid[], p_now => %s)", [[work_id], T0]
    )


def enrolled(raw_connect: Callable[..., Any], count: int) -> tuple[list[Any], list[uuid.UUID]]:
    """``count`` connections, each with an instance of its own that has beaten."""
    conns = [raw_connect() for _ in range(count)]
    instances = [uuid.uuid4() for _ in range(count)]
    for pid, (conn, instance) in enumerate(zip(conns, instances, strict=True)):
        conn.execute(
            "SELECT workpump.record_heartbeat(%s, 'tests', 'localhost', %s, p_now => %s)",
            (instance, pid, T0),
        )
    return conns, instances


def run_together(target: Callable[..., None], calls: Iterable[tuple[Any, ...]]) -> None:
    """Run ``target`` once per argument tuple, each on a thread of its own; wait for all."""
    threads = [threading.Thread(target=target, args=args) for args in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)


# --- batches -----------------------------------------------------------------------------


def test_the_last_completion_produces_the_callback_once_with_the_counts():
    batch = open_batch()
    ids = [send(batch) for _ in range(3)]
    seal(batch)
    held = claim()
    complete(held, ids[:2])
    assert callbacks() == []
    assert (status(batch)["pending"], status(batch)["done"]) == (1, 2)

    complete(held, ids[2:])

    [callback] = callbacks()
    assert callback["payload"] == {
        "report": 7,
        "batch": {
            "id": str(batch),
            "total": 3,
            "done": 3,
            "dead": 0,
            "discarded": 0,
            "cancelled": 0,
            "succeeded": True,
        },
    }
    assert status(batch)["callback_id"] == callback["work_id"]
    assert status(batch)["finished_at"] is not None


def test_an_unsealed_batch_does_not_finish_and_sealing_an_ended_one_finishes_it():
    batch = open_batch()
    [member] = [send(batch)]
    complete(claim(), [member])
    assert callbacks() == []  # the producer may still add members
    seal(batch)
    assert len(callbacks()) == 1
    seal(batch)
    assert len(callbacks()) == 1


def test_an_empty_batch_calls_back_when_sealed():
    batch = open_batch()
    seal(batch)
    [callback] = callbacks()
    assert callback["payload"]["batch"]["total"] == 0


def test_every_ending_path_is_counted_and_on_failure_is_chosen():
    batch = open_batch(on_failure=FAILED)
    done, discarded, failed, parked, lettered, cancelled = (
        send(batch),
        send(batch),
        send(batch, max_attempts=1),
        send(batch, max_attempts=1),
        send(batch),
        send(batch),
    )
    seal(batch)
    held = claim()
    complete(held, [done])
    assert discard(held, discarded) == "discarded"
    assert fail(held, failed) == "dead"
    # the claim parks a row whose lease expired after its last attempt
    run_sql(
        "SELECT * FROM workpump.claim_work(p_instance_id => %s, p_max_rows => 1,"
        " p_categories => ARRAY['outbox'], p_now => %s)",
        [INSTANCE, at(10**6)],
    )
    dead_letter(lettered)
    assert status(batch)["pending"] == 1
    assert callbacks("reports.failed") == []
    cancel(cancelled)

    assert row(parked)["dead_lettered_at"] is not None
    counts = status(batch)
    assert (counts["done"], counts["dead"], counts["discarded"], counts["cancelled"]) == (
        1,
        3,
        1,
        1,
    )
    assert counts["pending"] == 0
    [callback] = callbacks("reports.failed")
    assert callback["payload"]["batch"]["succeeded"] is False
    assert callbacks() == []


def test_a_requeued_dead_member_reopens_an_unfinished_batch_and_cancelling_a_dead_one_moves_it():
    batch = open_batch()
    first, second = send(batch), send(batch)
    seal(batch)
    dead_letter(first)
    assert (status(batch)["dead"], status(batch)["pending"]) == (1, 1)
    requeue(first)
    assert (status(batch)["dead"], status(batch)["pending"]) == (0, 2)
    dead_letter(first)
    cancel(first)
    assert (status(batch)["dead"], status(batch)["cancelled"], status(batch)["pending"]) == (
        0,
        1,
        1,
    )
    complete(claim(), [second])
    assert len(callbacks()) == 1


def test_a_finished_batch_takes_no_members_and_a_late_requeue_makes_no_second_callback():
    batch = open_batch()
    member = send(batch)
    seal(batch)
    dead_letter(member)
    assert len(callbacks()) == 1
    requeue(member)
    complete(claim(), [member])
    assert len(callbacks()) == 1
    assert status(batch)["done"] == 1  # the counts follow the late change
    with pytest.raises(DataError, match="has finished"), transaction.atomic():
        send(batch)


def test_a_nested_batch_counts_in_its_parent_when_its_callback_ends():
    parent = open_batch()
    own = send(parent)
    child = open_batch(json.dumps({"topic": "child.done", "payload": {}}), parent=parent)
    grandchild_members = [send(child) for _ in range(2)]
    seal(child)
    seal(parent)
    assert status(parent)["total"] == 2  # its own member and the child batch
    held = claim()
    complete(held, [own, *grandchild_members])
    [child_callback] = callbacks("child.done")
    assert child_callback["batch_id"] == parent  # the child's callback is the parent's member
    assert callbacks() == []

    complete(claim(), [child_callback["work_id"]])

    [callback] = callbacks()
    assert callback["payload"]["batch"]["done"] == 2


def test_a_nested_batch_without_a_callback_counts_in_its_parent_when_it_finishes():
    parent = open_batch()
    child = open_batch(None, parent=parent)
    member = send(child)
    seal(child)
    seal(parent)
    cancel(member)
    [callback] = callbacks()
    assert callback["payload"]["batch"]["dead"] == 1  # a child that did not all end done


def test_a_bad_callback_spec_is_refused_at_open():
    with pytest.raises(DataError, match="callback must be"), transaction.atomic():
        open_batch(json.dumps({"payload": {}}))
    with pytest.raises(DataError, match="payload"), transaction.atomic():
        open_batch(json.dumps({"topic": "x", "payload": [1]}))


def test_a_spoiled_stored_spec_costs_the_callback_not_the_ending():
    batch = open_batch()
    member = send(batch)
    seal(batch)
    run_sql(
        'UPDATE workpump_batch SET on_complete = \'{"topic": "x", "priority": "hi"}\''
        " WHERE id = %s",
        [batch],
    )
    complete(claim(), [member])
    assert row(member)["done_at"] is not None
    assert status(batch)["callback_error"]
    assert status(batch)["callback_id"] is None


@pytest.mark.django_db(transaction=True)
def test_racing_completions_on_separate_connections_produce_one_callback(raw_connect):
    rounds, members, racers = 15, 8, 4
    setup = raw_connect()
    conns, instances = enrolled(raw_connect, racers)
    for _ in range(rounds):
        batch = setup.execute(
            "SELECT workpump.open_batch(%s::jsonb) AS id", (CALLBACK,)
        ).fetchone()["id"]
        setup.execute(
            "SELECT workpump.send_many('jobs.step', array_fill('{}'::jsonb, ARRAY[%s]),"
            " p_batch_id => %s)",
            (members, batch),
        )
        setup.execute("SELECT workpump.seal_batch(%s)", (batch,))
        held = []
        for conn, instance in zip(conns, instances, strict=True):
            held.append(
                conn.execute(
                    "SELECT work_id, lease_token FROM workpump.claim_work(p_instance_id => %s,"
                    " p_max_rows => %s, p_categories => ARRAY['outbox'], p_now => %s)",
                    (instance, members // racers, T0),
                ).fetchall()
            )
        barrier = threading.Barrier(racers, timeout=30)
        errors: list[BaseException] = []

        def finish(
            conn: Any,
            instance: uuid.UUID,
            rows: list[dict[str, Any]],
            barrier: threading.Barrier = barrier,
            errors: list[BaseException] = errors,
        ) -> None:
            try:
                barrier.wait()
                for r in rows:  # one transaction per row: the last ending may be anyone's
                    conn.execute(
                        "SELECT * FROM workpump.complete_work(%s, 'outbox',"
                        " ARRAY[%s]::uuid[], ARRAY[%s]::uuid[])",
                        (instance, r["work_id"], r["lease_token"]),
                    )
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)
                barrier.abort()

        run_together(finish, zip(conns, instances, held, strict=True))
        assert not errors, errors
        made = setup.execute(
            "SELECT payload FROM workpump_outbox WHERE topic = 'reports.ready'"
            " AND payload -> 'batch' ->> 'id' = %s",
            (str(batch),),
        ).fetchall()
        assert len(made) == 1
        assert made[0]["payload"]["batch"]["done"] == members
        setup.execute("DELETE FROM workpump_outbox WHERE topic = 'reports.ready'")


# --- dependencies ------------------------------------------------------------------------


def test_a_chain_runs_one_link_at_a_time():
    first = send(topic="chain.a")
    second = send(topic="chain.b", after=[first])
    third = send(topic="chain.c", after=[second])
    held = claim()
    assert set(held) == {first}
    assert row(second)["scheduled_for"] == "infinity"
    complete(held, [first])
    assert row(second)["scheduled_for"] is None
    held = claim()
    assert set(held) == {second}
    complete(held, [second])
    assert set(claim()) == {third}


def claim_runs(
    run_max: int, now: Any = T0, max_rows: int = 100, topics: list[str] | None = None
) -> list[dict[str, Any]]:
    """claim_work with runs of up to ``run_max`` rows: each row's id, token and after_id,
    in the order returned."""
    enroll(INSTANCE)
    return run_sql(
        "SELECT work_id, lease_token, after_id FROM workpump.claim_work(p_instance_id => %s,"
        " p_max_rows => %s, p_categories => ARRAY['outbox'], p_stream_run_max => %s,"
        " p_topics => %s::jsonb, p_now => %s) WHERE lease_token IS NOT NULL",
        [
            INSTANCE,
            max_rows,
            run_max,
            None if topics is None else json.dumps({"outbox": topics}),
            now,
        ],
    )


def chain(length: int, topic: str = "chain.step") -> list[uuid.UUID]:
    ids = [send(topic=topic)]
    for _ in range(length - 1):
        ids.append(send(topic=topic, after=[ids[-1]]))
    return ids


def held_by_claim(work_id: uuid.UUID) -> dict[str, Any]:
    return run_sql(
        "SELECT instance_id, attempts, scheduled_for::text AS scheduled_for"
        " FROM workpump_outbox WHERE work_id = %s",
        [work_id],
    )[0]


def test_a_claim_leases_a_chain_behind_its_first_row_and_each_row_still_waits():
    a, b, c, d = chain(4)
    rows = claim_runs(run_max=3)
    # the first row, then its chain in order, each naming the row it waits for
    assert [(r["work_id"], r["after_id"]) for r in rows] == [(a, None), (b, a), (c, b)]
    for work_id in (b, c):
        assert held_by_claim(work_id) == {
            "instance_id": INSTANCE,
            "attempts": 1,
            "scheduled_for": "infinity",
        }
    assert held_by_claim(d)["instance_id"] is None  # past the run's length


def test_without_runs_a_chain_is_claimed_one_row_at_a_time():
    a, _, _ = chain(3)
    assert [r["work_id"] for r in claim_runs(run_max=1)] == [a]


def test_the_chain_runs_share_the_claims_budget():
    first = chain(5, topic="chain.one")
    second = chain(5, topic="chain.two")
    rows = claim_runs(run_max=100, max_rows=6)
    assert len(rows) == 6
    # each chain's run gets its share of what the two first rows left
    assert {r["work_id"] for r in rows} == {*first[:3], *second[:3]}


def test_a_chain_run_stops_at_a_fan_out_a_join_and_a_topic_not_claimed():
    fan = send(topic="fan")
    send(topic="fan.a", after=[fan])
    send(topic="fan.b", after=[fan])
    left, right = send(topic="join.left"), send(topic="join.right")
    send(topic="join", after=[left, right])
    head = send(topic="mine")
    send(topic="theirs", after=[head])
    rows = claim_runs(
        run_max=10, topics=["fan", "fan.a", "fan.b", "join.left", "join.right", "join", "mine"]
    )
    assert {r["work_id"] for r in rows} == {fan, left, right, head}
    assert all(r["after_id"] is None for r in rows)


def test_a_chain_row_whose_lease_ran_out_waits_for_its_dependency_all_the_same():
    a, b, c = chain(3)
    claim_runs(run_max=3)
    later = at(3_600)  # every lease of that claim ran out; the claimer is alive
    run_sql(
        "UPDATE workpump_service_instance SET last_heartbeat_at = %s WHERE instance_id = %s",
        [later, INSTANCE],
    )
    assert [r["work_id"] for r in claim_runs(run_max=1, now=later)] == [a]
    held = {r["work_id"]: r["lease_token"] for r in claim_runs(run_max=1, now=later)}
    assert held == {}  # b and c still wait for a, whose new attempt runs
    [taken] = run_sql("SELECT lease_token FROM workpump_outbox WHERE work_id = %s", [a])
    complete({a: taken["lease_token"]}, [a])
    # b's wait is over: its expired lease is taken over, as any other
    assert [r["work_id"] for r in claim_runs(run_max=1, now=later)] == [b]
    assert held_by_claim(c)["scheduled_for"] == "infinity"


def test_released_chain_rows_get_their_attempt_back_and_keep_waiting():
    a, b, c = chain(3)
    tokens = {r["work_id"]: r["lease_token"] for r in claim_runs(run_max=3)}
    statuses = run_sql(
        "SELECT status FROM workpump.release_work(%s, 'outbox', %s::uuid[], %s::uuid[],"
        " p_now => %s)",
        [INSTANCE, [b, c], [tokens[b], tokens[c]], T0],
    )
    assert [r["status"] for r in statuses] == ["released", "released"]
    for work_id in (b, c):
        assert held_by_claim(work_id) == {
            "instance_id": None,
            "attempts": 0,
            "scheduled_for": "infinity",
        }
    assert claim_runs(run_max=3) == []  # a is held; b and c wait for it
    complete(tokens, [a])
    assert [(r["work_id"], r["after_id"]) for r in claim_runs(run_max=3)] == [(b, None), (c, b)]


def test_a_chain_run_completed_in_one_statement_ends_every_row_and_every_wait():
    ids = chain(4)
    tokens = {r["work_id"]: r["lease_token"] for r in claim_runs(run_max=4)}
    assert set(tokens) == set(ids)
    # the later rows first: the statement ends them all before any row's dependents resolve
    complete(tokens, list(reversed(ids)))
    states = run_sql(
        "SELECT work_id, done_at IS NOT NULL AS done, scheduled_for FROM workpump_outbox"
        " WHERE work_id = ANY (%s::uuid[])",
        [ids],
    )
    assert {r["work_id"]: (r["done"], r["scheduled_for"]) for r in states} == {
        work_id: (True, None) for work_id in ids
    }
    assert run_sql("SELECT * FROM workpump_dependency") == []


@pytest.mark.django_db(transaction=True)
def test_an_ending_dependency_wakes_claimers_only_for_a_dependent_nobody_holds(raw_connect):
    a, b, _ = chain(3)
    tokens = {r["work_id"]: r["lease_token"] for r in claim_runs(run_max=3)}
    listener = raw_connect()
    listener.execute("LISTEN workpump_outbox")

    complete(tokens, [a])
    assert row(b)["scheduled_for"] is None  # its wait is over; its holder runs it next
    assert list(listener.notifies(timeout=0.3)) == []

    x = send(topic="free")
    y = send(topic="free.next", after=[x])
    list(listener.notifies(timeout=0.3))  # the inserts' own
    assert [r["work_id"] for r in claim_runs(run_max=1, topics=["free"])] == [x]
    [taken] = run_sql("SELECT lease_token FROM workpump_outbox WHERE work_id = %s", [x])
    complete({x: taken["lease_token"]}, [x])
    got = list(listener.notifies(timeout=5, stop_after=1))
    assert [(n.channel, n.payload) for n in got] == [("workpump_outbox", "outbox")]
    assert row(y)["scheduled_for"] is None


def test_a_dead_chain_row_cancels_the_leased_rows_behind_it():
    a = send(max_attempts=1)
    b = send(topic="chain.b", after=[a])
    c = send(topic="chain.c", after=[b])
    tokens = {r["work_id"]: r["lease_token"] for r in claim_runs(run_max=3)}
    assert set(tokens) == {a, b, c}
    assert fail(tokens, a) == "dead"
    assert row(b)["end_state"] == "cancelled"
    assert row(c)["last_error"] == f"dependency {b} ended cancelled"
    # their attempts were cancelled under the claimer: its later writes are fenced out
    assert fail(tokens, b) == "lost"


def test_a_dependent_waits_for_every_dependency():
    a, b = send(), send()
    joined = send(topic="join", after=[a, b])
    held = claim()
    complete(held, [a])
    assert row(joined)["scheduled_for"] == "infinity"
    complete(held, [b])
    assert set(claim()) == {joined}


def test_a_dependency_done_at_send_time_is_satisfied():
    a = send()
    complete(claim(), [a])
    later = send(topic="later", after=[a])
    assert row(later)["scheduled_for"] is None
    assert run_sql("SELECT * FROM workpump_dependency") == []


def test_policy_cancel_cancels_the_dependent_and_its_own_dependents():
    a = send(max_attempts=1)
    b = send(topic="chain.b", after=[a])
    c = send(topic="chain.c", after=[b])
    held = claim()
    assert fail(held, a) == "dead"
    assert row(b)["end_state"] == "cancelled"
    assert row(b)["failure_reason"] == "dependency_failed"
    assert row(b)["last_error"] == f"dependency {a} ended dead"
    assert row(c)["end_state"] == "cancelled"
    assert row(c)["last_error"] == f"dependency {b} ended cancelled"
    assert run_sql("SELECT * FROM workpump_dependency") == []


def test_policy_run_runs_the_dependent_anyway():
    a = send()
    b = send(topic="anyway", after=[a], policy="run")
    held = claim()
    assert discard(held, a) == "discarded"
    assert row(b)["scheduled_for"] is None
    assert set(claim()) == {b}


def test_a_dependency_failed_at_send_time_cancels_under_policy_cancel():
    a = send()
    cancel(a)
    b = send(topic="late", after=[a])
    assert row(b)["end_state"] == "cancelled"
    c = send(topic="late", after=[a], policy="run")
    assert row(c)["scheduled_for"] is None


def test_dependencies_must_exist_and_the_policy_be_known():
    with pytest.raises(DataError, match="no outbox row has that id"), transaction.atomic():
        send(after=[uuid.uuid4()])
    a = send()
    with pytest.raises(DataError, match="after_policy"), transaction.atomic():
        send(after=[a], policy="maybe")
    with pytest.raises(DataError, match="cannot combine after"), transaction.atomic():
        scalar(
            "SELECT workpump.send('x', '{}', p_scheduled_for => %s, p_after => %s::uuid[])",
            [at(60), [a]],
        )


def test_a_member_that_waits_is_counted_when_it_is_cancelled_by_its_dependency():
    batch = open_batch()
    a = send(batch, max_attempts=1)
    b = send(batch, after=[a])
    seal(batch)
    dead_letter(a)
    assert row(b)["end_state"] == "cancelled"
    [callback] = callbacks()
    assert callback["payload"]["batch"] | {"id": None} == {
        "id": None,
        "total": 2,
        "done": 0,
        "dead": 1,
        "discarded": 0,
        "cancelled": 1,
        "succeeded": False,
    }


@pytest.mark.django_db(transaction=True)
def test_dependencies_ending_on_separate_connections_release_the_dependent(raw_connect):
    setup = raw_connect()
    racers = 4
    conns, instances = enrolled(raw_connect, racers)
    for _ in range(10):
        deps = [
            setup.execute("SELECT workpump.send('dep', '{}') AS id").fetchone()["id"]
            for _ in range(racers)
        ]
        joined = setup.execute(
            "SELECT workpump.send('joined', '{}', p_after => %s::uuid[]) AS id", (deps,)
        ).fetchone()["id"]
        held = [
            conn.execute(
                "SELECT work_id, lease_token FROM workpump.claim_work(p_instance_id => %s,"
                " p_max_rows => 1, p_categories => ARRAY['outbox'], p_now => %s)",
                (instance, T0),
            ).fetchone()
            for conn, instance in zip(conns, instances, strict=True)
        ]
        barrier = threading.Barrier(racers, timeout=30)

        def finish(
            conn: Any, instance: uuid.UUID, r: dict[str, Any], barrier: Any = barrier
        ) -> None:
            barrier.wait()
            conn.execute(
                "SELECT * FROM workpump.complete_work(%s, 'outbox', ARRAY[%s]::uuid[],"
                " ARRAY[%s]::uuid[])",
                (instance, r["work_id"], r["lease_token"]),
            )

        run_together(finish, zip(conns, instances, held, strict=True))
        assert (
            setup.execute(
                "SELECT scheduled_for FROM workpump_outbox WHERE work_id = %s", (joined,)
            ).fetchone()["scheduled_for"]
            is None
        )
        setup.execute("DELETE FROM workpump_outbox WHERE topic = 'joined'")


@pytest.mark.django_db(transaction=True)
def test_endings_of_members_of_the_same_batches_in_opposite_orders_do_not_deadlock(raw_connect):
    setup = raw_connect()
    conns, instances = enrolled(raw_connect, 2)
    for _ in range(10):
        batches = [
            setup.execute("SELECT workpump.open_batch(%s::jsonb) AS id", (CALLBACK,)).fetchone()[
                "id"
            ]
            for _ in range(2)
        ]
        members = {
            b: setup.execute(
                "SELECT workpump.send_many('jobs.step', array_fill('{}'::jsonb, ARRAY[2]),"
                " p_batch_id => %s) AS ids",
                (b,),
            ).fetchone()["ids"]
            for b in batches
        }
        for b in batches:
            setup.execute("SELECT workpump.seal_batch(%s)", (b,))
        a, b = batches
        # each connection ends one member of each batch, in opposite batch orders
        orders = [[members[a][0], members[b][0]], [members[b][1], members[a][1]]]
        tokens = []
        for instance, ids in zip(instances, orders, strict=True):
            setup.execute(
                "UPDATE workpump_outbox SET instance_id = %s, lease_token = gen_random_uuid(),"
                " lease_expiry = now() + interval '1 hour', attempts = 1"
                " WHERE work_id = ANY (%s)",
                (instance, ids),
            )
            rows = setup.execute(
                "SELECT work_id, lease_token FROM workpump_outbox WHERE work_id = ANY (%s)", (ids,)
            ).fetchall()
            held = {r["work_id"]: r["lease_token"] for r in rows}
            tokens.append([held[i] for i in ids])
        barrier = threading.Barrier(2, timeout=30)
        errors: list[BaseException] = []

        def finish(
            conn: Any,
            instance: uuid.UUID,
            ids: list[uuid.UUID],
            held: list[uuid.UUID],
            barrier: threading.Barrier = barrier,
            errors: list[BaseException] = errors,
        ) -> None:
            try:
                barrier.wait()
                conn.execute(
                    "SELECT * FROM workpump.complete_work(%s, 'outbox', %s::uuid[], %s::uuid[])",
                    (instance, ids, held),
                )
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)

        run_together(finish, zip(conns, instances, orders, tokens, strict=True))
        assert not errors, errors
        made = setup.execute(
            "SELECT count(*) AS n FROM workpump_outbox WHERE topic = 'reports.ready'"
        ).fetchone()["n"]
        assert made == 2
        setup.execute("DELETE FROM workpump_outbox WHERE topic = 'reports.ready'")
