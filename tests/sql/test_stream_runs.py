"""Stream runs in SQL: claim_work's p_stream_run_max.

A claim that takes an ordered stream's head can lease the consecutive rows after it too,
to the same owner, each with its own token; the head hands over to them on completion
without another claim, and what a run leaves unrun is claimed again, in order. The
stream keeps its owner while the run goes on.
"""

from __future__ import annotations

import re
import threading
import uuid
from typing import Any

import pytest
from django.db import DatabaseError

from tests.helpers import (
    T0,
    at,
    explaining_connection,
    give_the_planner_statistics,
    run_sql,
    scalar,
    wait_until,
)
from tests.sql.test_claim import (
    CATEGORIES,
    TABLES,
    A,
    B,
    claim,
    complete,
    fail,
    ids,
    make,
    register_on,
    row,
)

pytestmark = pytest.mark.django_db


def stream_of(category: str, count: int, stream: str = "s-1") -> list[uuid.UUID]:
    return [make(category, stream, {"n": n}) for n in range(count)]


def heads(category: str, work_ids: list[uuid.UUID]) -> list[bool]:
    return [row(category, work_id)["stream_head"] for work_id in work_ids]


def owner(category: str, stream: str = "s-1") -> tuple[uuid.UUID | None, Any]:
    """The stream's owner and stream lease, from workpump_active_stream."""
    [found] = run_sql(
        "SELECT owner_instance_id, lease_expiry FROM workpump_active_stream"
        " WHERE category = %s AND stream = %s",
        [category, stream],
    )
    return found["owner_instance_id"], found["lease_expiry"]


def discard(instance: uuid.UUID, category: str, work_ids: list[uuid.UUID]) -> list[str]:
    rows = run_sql(
        "SELECT * FROM workpump.discard_work(%s, %s, %s::uuid[], %s::uuid[], %s::text[])",
        [instance, category, work_ids, tokens_of(category, work_ids), ["no"] * len(work_ids)],
    )
    return [r["status"] for r in rows]


def tokens_of(category: str, work_ids: list[uuid.UUID]) -> list[uuid.UUID]:
    return [row(category, work_id)["lease_token"] for work_id in work_ids]


def release(instance: uuid.UUID, category: str, work_ids: list[uuid.UUID], tokens: Any) -> Any:
    return run_sql(
        "SELECT * FROM workpump.release_work(%s, %s, %s::uuid[], %s::uuid[])",
        [instance, category, work_ids, tokens],
    )


@pytest.mark.parametrize("category", CATEGORIES)
def test_a_claim_leases_the_head_with_a_run_of_the_rows_after_it(category):
    made = stream_of(category, 7)
    rows = claim(A, p_stream_run_max=5)
    assert ids(rows) == made[:5]
    assert [r["payload"]["n"] for r in rows] == [0, 1, 2, 3, 4]
    stored = [row(category, work_id) for work_id in made]
    assert [s["instance_id"] for s in stored] == [A] * 5 + [None] * 2
    assert len({s["lease_token"] for s in stored[:5]}) == 5
    assert [r["lease_token"] for r in rows] == [s["lease_token"] for s in stored[:5]]
    assert len({s["lease_expiry"] for s in stored[:5]}) == 1
    assert [s["attempts"] for s in stored] == [1] * 5 + [0] * 2
    # Only the head is a stream head: nobody else can claim the rest of the stream.
    assert heads(category, made) == [True] + [False] * 6
    assert claim(B, p_stream_run_max=5) == []


def test_without_p_stream_run_max_a_claim_takes_heads_only():
    made = stream_of("outbox", 3)
    assert ids(claim(A)) == made[:1]


def test_a_run_is_bounded_by_the_claim_budget_and_each_run_gets_its_next_row_first():
    first = stream_of("outbox", 5, "s-1")
    second = stream_of("outbox", 5, "s-2")
    lone = make("outbox")
    rows = claim(A, p_max_rows=6, p_stream_run_max=10)
    # three heads, then one more row of each run before any run gets two
    assert sorted(ids(rows)) == sorted([*first[:3], *second[:2], lone])
    # each run comes back together, in stream order, right after its head
    order = ids(rows)
    for stream in (first, second):
        taken = [work_id for work_id in order if work_id in stream]
        assert taken == stream[: len(taken)]
        start = order.index(stream[0])
        assert order[start : start + len(taken)] == taken


def test_a_run_ends_at_the_first_row_that_cannot_be_leased_now():
    made = [
        make("outbox", "s-1", {"n": 0}),
        make("outbox", "s-1", {"n": 1}),
        make("outbox", "s-1", {"n": 2}, scheduled_for=at(60)),  # deferred past now
        make("outbox", "s-1", {"n": 3}),
    ]
    assert ids(claim(A, p_stream_run_max=10)) == made[:2]
    assert row("outbox", made[3])["instance_id"] is None


def test_a_dead_row_ends_a_run():
    made = stream_of("outbox", 4)
    run_sql("UPDATE workpump_outbox SET dead_lettered_at = %s WHERE work_id = %s", [T0, made[2]])
    assert ids(claim(A, p_stream_run_max=10)) == made[:2]


def test_the_head_hands_over_to_the_next_row_of_its_run_which_stays_with_its_owner():
    made = stream_of("outbox", 5)
    assert ids(claim(A, p_stream_run_max=3)) == made[:3]
    assert complete(A, "outbox", made[:1], at(1)) == ["done"]
    assert heads("outbox", made[1:]) == [True, False, False, False]
    assert row("outbox", made[1])["instance_id"] == A
    assert claim(B, now=at(1), p_stream_run_max=3) == []  # still A's
    # The whole run completed in one call: the next unleased row becomes the head.
    assert complete(A, "outbox", made[1:3], at(2)) == ["done", "done"]
    assert heads("outbox", made)[3] is True
    assert ids(claim(B, now=at(2), p_stream_run_max=3)) == made[3:]


@pytest.mark.parametrize("category", CATEGORIES)
def test_a_stream_keeps_its_owner_while_its_run_goes_on(category):
    made = stream_of(category, 4)
    assert ids(claim(A, p_stream_run_max=3)) == made[:3]
    assert owner(category) == (A, row(category, made[0])["lease_expiry"])
    # the stream lease follows the run's rows, as renew_leases moves it
    run_sql(
        f"UPDATE {TABLES[category][0]} SET lease_expiry = %s WHERE {TABLES[category][1]} = %s",
        [at(600), made[1]],
    )

    assert complete(A, category, made[:1], at(1)) == ["done"]
    assert owner(category) == (A, at(600))  # A holds the new head, the run's next row
    assert discard(A, category, made[1:2]) == ["discarded"]
    assert owner(category) == (A, row(category, made[2])["lease_expiry"])
    # The run's last row ends: the next head is nobody's, so the stream is nobody's.
    assert complete(A, category, made[2:3], at(3)) == ["done"]
    assert owner(category) == (None, None)
    assert ids(claim(B, now=at(3))) == made[3:]
    assert owner(category)[0] == B


def test_a_stream_whose_next_head_is_not_leased_by_its_owner_loses_the_owner():
    made = stream_of("outbox", 2)
    assert ids(claim(A)) == made[:1]  # heads only: no run
    assert complete(A, "outbox", made[:1], at(1)) == ["done"]
    assert owner("outbox") == (None, None)
    assert ids(claim(B, now=at(1))) == made[1:]
    assert owner("outbox")[0] == B


def test_releasing_the_rest_of_a_run_mid_run_clears_the_owner():
    made = stream_of("outbox", 3)
    assert ids(claim(A, p_stream_run_max=3)) == made
    assert complete(A, "outbox", made[:1], at(1)) == ["done"]
    assert owner("outbox")[0] == A
    statuses = release(A, "outbox", made[1:], tokens_of("outbox", made[1:]))
    assert [r["status"] for r in statuses] == ["released", "released"]
    assert owner("outbox") == (None, None)


def test_evicting_the_owner_mid_run_clears_the_owner():
    made = stream_of("outbox", 3)
    assert ids(claim(A, p_stream_run_max=3)) == made
    assert complete(A, "outbox", made[:1], at(1)) == ["done"]
    assert owner("outbox")[0] == A
    assert scalar("SELECT workpump.evict_instance(%s, 'gone', %s)", [A, at(2)]) == 2
    assert owner("outbox") == (None, None)


def test_the_admin_streams_page_shows_the_owner_of_a_stream_mid_run(admin_client):
    made = stream_of("outbox", 3)
    assert ids(claim(A, p_stream_run_max=3)) == made
    assert complete(A, "outbox", made[:1], at(1)) == ["done"]

    html = admin_client.get("/admin/workpump/activestream/").content.decode()

    [stream_row] = [r for r in re.findall(r"<tr>.*?</tr>", html, re.S) if "field-stream" in r]
    text = " ".join(re.sub(r"<[^>]+>", " ", stream_row).split())
    assert text.startswith("s-1 outbox")
    assert f'title="{A}"' in stream_row  # the owner column names A
    assert "tests@localhost:1" in text
    assert re.search(r" 2 ", text)  # the run's two rows still to run


@pytest.mark.django_db(transaction=True)
def test_a_promotion_to_a_row_still_leased_wakes_no_claimer(raw_connect):
    conn = raw_connect()
    listener = raw_connect()
    made = [
        conn.execute("SELECT workpump.send('x', '{}', 'wake') AS id").fetchone()["id"]
        for _ in range(3)
    ]
    # a run of two held by A: the first two rows leased
    conn.execute(
        "UPDATE workpump_outbox SET instance_id = %s, lease_expiry = now() + interval '1 h',"
        " lease_token = gen_random_uuid() WHERE work_id = ANY (%s)",
        [A, made[:2]],
    )
    listener.execute("LISTEN workpump_outbox")

    def finish(work_id: uuid.UUID) -> int:
        with conn.transaction():
            conn.execute("UPDATE workpump_outbox SET done_at = now() WHERE work_id = %s", [work_id])
            promoted = conn.execute(
                "SELECT workpump.promote_stream_heads('outbox', '{\"\"}', '{wake}') AS n"
            ).fetchone()["n"]
        listener.execute("SELECT 1")
        return promoted

    assert finish(made[0]) == 1  # the next row of the run: still leased
    assert list(listener.notifies(timeout=0.2, stop_after=1)) == []
    assert finish(made[1]) == 1  # an unleased row: claimable now
    assert [n.payload for n in listener.notifies(timeout=2, stop_after=1)] == ["outbox"]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("ending", ["discard", "cancel"])
def test_a_discard_or_cancel_takes_its_streams_lock_before_it_locks_a_row(raw_connect, ending):
    # A completion of the rows before a run's row updates them, then takes the stream's
    # lock and promotes that row. A discard (or an operator's cancel) of that row that
    # locked the row first and the stream second deadlocked with it.
    made = stream_of("outbox", 3)
    assert ids(claim(A, p_stream_run_max=3)) == made
    token = tokens_of("outbox", made[1:2])
    completion = raw_connect()
    completion.execute("BEGIN")
    completion.execute("SELECT workpump.lock_stream('outbox', '', 's-1')")
    ender, probe = raw_connect(), raw_connect()
    statuses: list[str] = []

    def end() -> None:
        if ending == "discard":
            found = ender.execute(
                "SELECT status FROM workpump.discard_work(%s, 'outbox', %s::uuid[],"
                " %s::uuid[], '{no}')",
                [A, made[1:2], token],
            ).fetchall()
            statuses.extend(r["status"] for r in found)
        else:
            found = ender.execute(
                "SELECT work_id FROM workpump.cancel_work('outbox', %s::uuid[])", [made[1:2]]
            ).fetchall()
            statuses.extend("cancelled" for r in found if r["work_id"] == made[1])

    thread = threading.Thread(target=end)
    thread.start()
    try:
        assert wait_until(
            lambda: (
                probe.execute(
                    "SELECT wait_event_type, wait_event FROM pg_stat_activity WHERE pid = %s",
                    [ender.info.backend_pid],
                ).fetchone()
                == {"wait_event_type": "Lock", "wait_event": "advisory"}
            ),
            timeout=10,
        )
        # the row is not locked while the stream's lock is awaited: the completion can
        # promote it
        probe.execute(
            "SELECT 1 FROM workpump_outbox WHERE work_id = %s FOR UPDATE NOWAIT", [made[1]]
        )
    finally:
        completion.execute("ROLLBACK")
        thread.join(10)
    assert statuses == ["discarded" if ending == "discard" else "cancelled"]
    assert row("outbox", made[1])["end_state"] == statuses[0]


def test_releasing_the_rest_of_a_run_gives_back_their_attempts_and_keeps_the_order():
    made = stream_of("outbox", 4)
    assert ids(claim(A, p_stream_run_max=4)) == made
    tokens = [row("outbox", work_id)["lease_token"] for work_id in made]
    assert fail(A, "outbox", made[1:2], at(1), retry_base=0) == ["retry"]
    statuses = release(A, "outbox", made[2:], tokens[2:])
    assert [s["status"] for s in statuses] == ["released", "released"]
    assert [row("outbox", w)["attempts"] for w in made[2:]] == [0, 0]
    # the failed row waits behind the head; when the head completes it comes first
    assert claim(B, now=at(1), p_stream_run_max=4) == []
    assert complete(A, "outbox", made[:1], at(2)) == ["done"]
    rows = claim(B, now=at(2), p_stream_run_max=4)
    assert ids(rows) == made[1:]
    assert [r["attempts"] for r in rows] == [2, 1, 1]


def test_a_run_whose_owner_died_is_claimed_again_from_its_first_unfinished_row():
    made = stream_of("outbox", 6)
    assert ids(claim(A, p_stream_run_max=4)) == made[:4]
    assert complete(A, "outbox", made[:2], at(1)) == ["done", "done"]
    lease_end = row("outbox", made[2])["lease_expiry"]
    assert claim(B, now=at(10), p_stream_run_max=10) == []  # A's leases still run
    later = lease_end + (at(1) - T0)
    rows = claim(B, now=later, p_stream_run_max=10)
    # the expired rows of A's run, then the rows after it, in order, nothing skipped
    assert ids(rows) == made[2:]
    assert [r["attempts"] for r in rows] == [2, 2, 1, 1]
    assert row("outbox", made[3])["failure_reason"] == "lease_expired"


def test_an_evicted_owners_run_is_claimed_again_in_order():
    made = stream_of("outbox", 4)
    assert ids(claim(A, p_stream_run_max=4)) == made
    table, key, _ = TABLES["outbox"]
    run_sql(
        f"UPDATE {table} SET instance_id = NULL, lease_expiry = NULL WHERE {key} = ANY (%s)", [made]
    )
    assert ids(claim(B, now=at(1), p_stream_run_max=4)) == made


def test_claim_work_refuses_a_run_length_below_one():
    with pytest.raises(DatabaseError) as caught:
        claim(A, p_stream_run_max=0)
    assert "p_stream_run_max >= 1" in str(caught.value)


def test_a_run_is_found_and_leased_by_index_and_tid_lookups_never_a_scan(raw_connect):
    conn, plans = explaining_connection(raw_connect)
    with conn.transaction(force_rollback=True):
        give_the_planner_statistics(conn)
        for n in range(5):
            conn.execute("SELECT workpump.send('emails.welcome', %s, 's-1')", [f'{{"n": {n}}}'])
            conn.execute("SELECT workpump.send('emails.welcome', '{}', %s)", [f"other-{n}"])
        register_on(conn, A)
        plans.clear()
        rows = conn.execute(
            "SELECT * FROM workpump.claim_work(%s, p_categories => '{outbox}', p_now => %s,"
            " p_stream_run_max => 10)",
            [A, T0],
        ).fetchall()
    assert len(rows) == 10
    text = "\n".join(p for p in plans if "claimed_runs" in p)
    assert "CTE locked" in text
    assert "Seq Scan on workpump_outbox" not in text
