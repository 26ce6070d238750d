"""The admin at many rows: each filter selects the same rows as ``workpump.state_of``
and the stuck rule, through a partial index (EXPLAIN shows no sequential scan of the
work table), and a changelist past ``EXACT_COUNT_LIMIT`` rows says "about N".
"""

from __future__ import annotations

import json
import re
import uuid
from datetime import datetime
from typing import Any

import pytest
from django.contrib import admin
from django.contrib.auth.models import User
from django.db import connection
from django.db.models import Q
from django.test import Client, RequestFactory
from django.test.utils import CaptureQueriesContext

from django_workpump import models, status
from django_workpump.admin import pagination
from django_workpump.admin.expressions import (
    CLAIM_ORDER,
    NOT_LIVE_HOLDERS,
    FragmentOrder,
    WorkSpec,
    annotate_work,
    fetch_bound,
    held_seqs,
    not_live_seqs,
    pending_seqs,
    state_condition,
    stuck_seqs,
)
from django_workpump.admin.work_filters import STUCK as STUCK_FILTER
from django_workpump.admin.work_filters import topic_choices
from django_workpump.registry import Handler, Registry
from django_workpump.sql import named_queries
from django_workpump.states import WorkState
from tests import factories
from tests.admin.test_admin import (
    OUTBOX_CHANGELIST_QUERIES,
    OUTBOX_URL,
    STUCK,
    WORK_MODELS,
    World,
    secs,
)
from tests.helpers import run_sql

pytestmark = [pytest.mark.django_db, pytest.mark.slow]

SPEC = WorkSpec.of("outbox")
BULK_DONE_ROWS = 20_000  # enough that the planner prefers an index to a scan


@pytest.fixture
def world(now: datetime) -> World:
    world = World(now)
    # Cases the admin's fixture lacks: a retry that fell due (pending), a deferred row
    # behind a head (scheduled, not a head), a due row behind a head (pending).
    world.add("due_retry", attempts=2, scheduled_for=now - secs(5))
    world.add("deferred_behind", stream="s-ok", scheduled_for=now + secs(90))
    world.add("due_behind", stream="s-ok", scheduled_for=now - secs(90))
    world.add("attempts_high_pending", attempts=6)
    # Rows that ended other than by completing.
    for end_state in ("cancelled", "discarded"):
        world.add(end_state, attempts=1, done_at=now - secs(5), end_state=end_state)
    return world


@pytest.fixture
def now() -> datetime:
    return run_sql("SELECT now() AS now")[0]["now"]  # type: ignore[no-any-return]


def rows_where(**kwargs: Any) -> set[int]:
    queryset = annotate_work(models.Outbox.objects.all(), SPEC)
    return set(queryset.filter(**kwargs).values_list("seq", flat=True))


def rows_matching(condition: Any, **kwargs: Any) -> set[int]:
    queryset = annotate_work(models.Outbox.objects.all(), SPEC)
    return set(queryset.filter(condition, **kwargs).values_list("seq", flat=True))


@pytest.mark.parametrize("state", list(WorkState))
def test_each_state_condition_selects_the_rows_of_state_of(world: World, state: str) -> None:
    expected = rows_where(wp_state=state)
    assert expected, f"the fixture has no {state} row"
    assert rows_matching(state_condition(SPEC, state)) == expected


@pytest.fixture
def overlapping(world: World, now: datetime) -> World:
    """Rows that more than one arm of the stuck filter could select, and held rows of a
    live instance that are not stuck, on top of the admin's fixture."""
    held = {"claimed_at": now - secs(60)}
    live = world.live.instance_id
    world.add("retried_gone", attempts=6, instance_id=world.gone_id,
              lease_expiry=now + secs(100), **held)  # fmt: skip
    world.add("retried_expired", attempts=6, instance_id=live, lease_expiry=now - secs(9), **held)
    world.add("retried_leased_live", attempts=6, instance_id=live,
              lease_expiry=now + secs(100), **held)  # fmt: skip
    world.add("retried_evicted", attempts=6, failure_reason="instance_evicted", **held)
    world.add("retried_behind_dead", stream="s-dead", attempts=6)
    world.add("expired_behind_dead", stream="s-dead", instance_id=live,
              lease_expiry=now - secs(5), **held)  # fmt: skip
    world.add("leased_behind_dead", stream="s-dead", instance_id=live,
              lease_expiry=now + secs(100), **held)  # fmt: skip
    world.add("leased_live_2", instance_id=live, lease_expiry=now + secs(90), **held)
    return world


# Each kind of stuck row, and rows that are not stuck, by the fixtures' names.
STUCK_KINDS = [
    *sorted(STUCK),
    "attempts_high_pending",
    "retried_gone",
    "retried_expired",
    "retried_leased_live",
    "retried_evicted",
    "retried_behind_dead",
    "expired_behind_dead",
    "leased_behind_dead",
]
NOT_STUCK = [
    *("pending", "leased_live", "leased_live_2", "ok_head", "behind_ok", "done", "dead"),
    *("dead_head", "attempts_below_half", "first_of_two", "deferred_head", "behind_deferred"),
    *("retry_head", "due_retry", "deferred_behind", "due_behind"),
]


def outbox_seqs(*names: str, world: World) -> set[int]:
    return {world.rows[name].seq for name in names}


def test_the_stuck_filter_selects_every_stuck_row_and_no_other(overlapping: World) -> None:
    world = overlapping
    stuck = rows_where(wp_stuck=True)
    assert stuck == outbox_seqs(*STUCK_KINDS, world=world)
    assert not stuck & outbox_seqs(*NOT_STUCK, world=world)
    assert rows_matching(Q(seq__in=stuck_seqs(SPEC))) == stuck


def test_the_not_live_filter_selects_the_rows_of_holders_that_are_not_live(
    overlapping: World,
) -> None:
    expected = rows_where(instance_id__isnull=False, wp_holder__in=NOT_LIVE_HOLDERS)
    assert expected == outbox_seqs(
        "leased_stale", "leased_evicted", "leased_gone", "retried_gone", world=overlapping
    )
    assert rows_matching(Q(seq__in=not_live_seqs(SPEC))) == expected


# Each bounded filter and the order its fragment reads in.
BOUNDED = {
    "stuck": (stuck_seqs, ("-seq",)),
    "not-live": (not_live_seqs, ("-seq",)),
    "leased": (lambda spec, topic=None: held_seqs(spec, WorkState.LEASED, topic), ("-seq",)),
    "orphaned": (lambda spec, topic=None: held_seqs(spec, WorkState.ORPHANED, topic), ("-seq",)),
    "pending": (pending_seqs, ("-priority", "seq")),
}


@pytest.mark.parametrize("state", [WorkState.LEASED, WorkState.ORPHANED])
def test_the_held_states_select_the_rows_of_state_of(overlapping: World, state: str) -> None:
    expected = rows_where(wp_state=state)
    assert len(expected) >= 3
    assert rows_matching(Q(seq__in=held_seqs(SPEC, state))) == expected


@pytest.fixture
def prioritised(overlapping: World, now: datetime) -> World:
    """Pending rows of other priorities, and of each arm of the pending filter."""
    world = overlapping
    world.add("urgent", priority=5)
    world.add("urgent_due_retry", priority=5, attempts=1, scheduled_for=now - secs(1))
    world.add("lowly", priority=-5)
    world.add("lowly_behind", stream="s-ok", priority=-5)
    return world


@pytest.mark.parametrize(("seqs", "order"), list(BOUNDED.values()), ids=list(BOUNDED))
def test_a_bounded_filter_pages_and_counts_as_the_whole_set(
    prioritised: World, seqs: Any, order: tuple[str, ...]
) -> None:
    """A page in the fragment's order reads as many rows as it shows, a count as many as
    its limit: each gives what it would over the whole set, at every size and offset."""
    queryset = models.Outbox.objects.filter(seq__in=seqs(SPEC))
    every = list(queryset.order_by(*order).values_list("seq", flat=True))  # no limit: all
    assert every == sorted_by(queryset, order)
    assert len(every) == len(set(every)) >= 4
    for size in range(1, len(every) + 2):
        assert queryset.order_by().values("pk")[:size].count() == min(size, len(every))
        # the paginator counts the fragment's rows as it reads them
        assert pagination.filtered_seqs_count(queryset, size) == min(size, len(every))
        for offset in range(len(every) + 1):
            page = queryset.order_by(*order).values_list("seq", flat=True)[offset : offset + size]
            assert list(page) == every[offset : offset + size], (offset, size)
    # With another condition beside it, the fragment yields every row: a bound would
    # leave out rows of that condition that come after the bound.
    last = models.Outbox.objects.get(seq=every[-1])
    narrowed = queryset.filter(attempts=last.attempts, topic=last.topic)
    assert list(narrowed.order_by(*order).values_list("seq", flat=True)[:1]) == [last.seq]
    # Given the topic filter's topic, it reads that topic's rows only, still bounded.
    of_topic = models.Outbox.objects.filter(seq__in=seqs(SPEC, topic=last.topic))
    page = of_topic.filter(topic=last.topic).order_by(*order)[:1]
    assert fetch_bound(page.query, FragmentOrder(order, "", "")) == (1, True)
    assert list(page.values_list("seq", flat=True)) == [last.seq]


@pytest.mark.parametrize(
    ("params", "bounded", "narrowed"),
    [
        # applied by each arm as it reads
        ({"topic": "topic.lowly"}, True, {"topic": "topic.lowly"}),
        ({"owner": "none"}, True, {}),  # every pending row is unheld
        # a search may drop rows after a bound: all are read
        ({"q": "lowly"}, False, {"topic__contains": "lowly"}),
    ],
    ids=["topic", "owner=none", "search"],
)
def test_the_pending_page_with_another_filter_lists_every_row_of_both(
    prioritised: World, params: dict[str, str], bounded: bool, narrowed: dict[str, str]
) -> None:
    page = changelist_queryset({"state": WorkState.PENDING, **params})[:50]
    assert fetch_bound(page.query, CLAIM_ORDER) == ((50, True) if bounded else (None, True))
    pending = models.Outbox.objects.filter(seq__in=rows_where(wp_state=WorkState.PENDING))
    expected = sorted_by(pending.filter(**narrowed), CLAIM_ORDER.fields)
    assert [row.seq for row in page] == expected
    assert len(expected) >= (1 if narrowed else 5)


@pytest.mark.parametrize(
    "params",
    [{"state": STUCK_FILTER}, {"state": WorkState.LEASED}, {"owner": "not-live"}],
    ids=lambda p: "=".join(*p.items()),
)
def test_a_bounded_page_with_a_topic_reads_that_topics_rows(
    overlapping: World, params: dict[str, str]
) -> None:
    """The oldest row of each bounded page, found through the topic filter at once."""
    every = changelist_queryset(params)
    oldest = every.order_by("seq")[0]
    page = changelist_queryset({**params, "topic": oldest.topic})[:50]
    assert fetch_bound(page.query) == (50, True)
    assert [row.seq for row in page] == [oldest.seq]
    assert every.count() >= 3


def sorted_by(queryset: Any, order: tuple[str, ...]) -> list[int]:
    """The seqs of ``queryset`` sorted in Python by ``order`` (``-seq`` or claim order)."""
    rows = list(queryset.order_by().values_list("priority", "seq"))
    if order == ("-seq",):
        return sorted((seq for _, seq in rows), reverse=True)
    return [seq for _, seq in sorted(rows, key=lambda row: (-row[0], row[1]))]
    # With another condition the paginator counts the rows of the table.
    assert pagination.filtered_seqs_count(queryset.filter(attempts__gte=0), 5) is None
    # Any other order reads every row, then sorts.
    by_created = queryset.order_by("created_at", "seq").values_list("seq", flat=True)[:2]
    first = sorted(queryset.values_list("created_at", "seq"))[:2]
    assert list(by_created) == [seq for _, seq in first]


def test_topic_choices_are_registered_topics_and_those_of_rows_needing_attention(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    handlers = Registry()
    handlers.register(Handler("outbox", "registered.only", func=lambda message: None))
    monkeypatch.setattr("django_workpump.admin.work_filters.registry", handlers)
    topics = set(topic_choices(models.Outbox, SPEC))
    assert "registered.only" in topics
    # pending, waiting for a time, leased and dead rows are listed; done rows are not
    assert {"topic.pending", "topic.retry_head", "topic.leased_live", "topic.dead"} <= topics
    assert "topic.done" not in topics


# Rows completed together share a time, 100 at a time (a batch of outcomes written by one
# statement), each batch 10 ms before the next: ``n`` is the row's number.
DONE_BATCH_SQL = "({n} / 100) * interval '10 milliseconds'"


def bulk_done(count: int) -> None:
    """``count`` processed outbox rows, inserted by one statement, then ANALYZE."""
    run_sql(
        "INSERT INTO workpump_outbox (work_id, topic, payload, attempts, done_at)"
        " SELECT gen_random_uuid(), 'bulk.done', '{}'::jsonb, 1, now() - interval '1 hour'"
        f" - {DONE_BATCH_SQL.format(n='g')} FROM generate_series(1, %s) g",
        (count,),
    )
    run_sql("ANALYZE workpump_outbox")


def count_plan(queryset: Any) -> str:
    """The plan of the paginator's capped count (the estimate past it is EXPLAINed, not
    run): a count of a filter's seqs as they are read, or of the filtered table."""
    limit = pagination.EXACT_COUNT_LIMIT + 1
    direct = pagination.filtered_seqs_count_sql(queryset, limit)
    if direct is None:
        return str(queryset.order_by().values("pk")[:limit].explain())
    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN {direct[0]}", direct[1])
        return "\n".join(row[0] for row in cursor.fetchall())


def changelist_queryset(params: dict[str, str]) -> Any:
    request = RequestFactory().get(OUTBOX_URL, params)
    request.user = User.objects.create_superuser(f"su{len(params)}{sorted(params)}", password="x")
    model_admin = admin.site._registry[models.Outbox]
    return model_admin.get_changelist_instance(request).queryset


FILTERS = [
    *({"state": state} for state in WorkState),
    {"state": STUCK_FILTER},
    {"owner": "not-live"},
]


def filter_plans(queryset: Any, params: dict[str, str]) -> list[str]:
    """The plans of a filtered changelist's page and, but for the done state, its capped
    count: most of a table is done, so a count of done rows may read the table from its
    start, stopping at the limit."""
    page = queryset[:51].explain()
    return [page] if params == {"state": WorkState.DONE} else [page, count_plan(queryset)]


@pytest.mark.parametrize("params", FILTERS, ids=lambda p: "=".join(*p.items()))
def test_each_filter_reads_its_rows_through_an_index(world: World, params: dict[str, str]) -> None:
    bulk_done(BULK_DONE_ROWS)
    queryset = changelist_queryset(params)
    for plan in filter_plans(queryset, params):
        assert "Seq Scan on workpump_outbox" not in plan, plan
        assert re.search(r"Index (Only )?Scan|Bitmap Index Scan", plan), plan
    if params == {"state": WorkState.PENDING}:
        # The count's arms read in the claim's order too: a LIMIT without it lets the
        # planner read the table from its start, past every older done row.
        count_sql = pagination.filtered_seqs_count_sql(queryset, 10)
        assert count_sql is not None
        # four arms: ready heads, flow-controlled heads, due retries, rows behind a head
        assert count_sql[0].count("ORDER BY t.priority DESC, t.seq") == 4


# The index each ordered state's page reads in its order (page_order), and how: a page
# of done rows sorts only the rows that share a time with its last (an incremental sort
# over the index's order); dead and scheduled pages read their index in the page's order.
ORDERED_PAGE_PLANS = {
    WorkState.DONE: r"Index Scan Backward using wp_{prefix}_done",
    WorkState.DEAD: r"Index Scan Backward using wp_{prefix}_dead",
    WorkState.SCHEDULED: r"Index Scan using wp_{prefix}_waiting",
    WorkState.PENDING: r"Index Scan using wp_{prefix}_ready",
}
FULL_SORT = re.compile(r"(^|->)\s*Sort\s+\(", re.M)  # not an Incremental Sort


@pytest.mark.parametrize("state", list(ORDERED_PAGE_PLANS))
def test_each_ordered_state_page_reads_its_index_in_the_page_order(
    world: World, state: str
) -> None:
    bulk_done(BULK_DONE_ROWS)
    plan = changelist_queryset({"state": state})[:51].explain()
    assert re.search(ORDERED_PAGE_PLANS[state].format(prefix="outbox"), plan), plan
    if state in (WorkState.DEAD, WorkState.SCHEDULED):
        assert not FULL_SORT.search(plan), plan
    if state == WorkState.DONE:
        assert "Incremental Sort" in plan and not FULL_SORT.search(plan), plan
    if state == WorkState.PENDING:
        # the arms merged in the claim's order, the claimable ones read in it
        assert "Merge Append" in plan, plan


def test_a_large_changelist_says_about_n_and_counts_no_further(
    admin_client: Client, world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    with CaptureQueriesContext(connection) as queries:
        html = admin_client.get(OUTBOX_URL).content.decode()
    assert "about" not in html
    exact_queries = len(queries)
    assert exact_queries == OUTBOX_CHANGELIST_QUERIES

    monkeypatch.setattr(pagination, "EXACT_COUNT_LIMIT", 5)
    with CaptureQueriesContext(connection) as queries:
        html = admin_client.get(OUTBOX_URL).content.decode()
    assert re.search(r'class="wp-estimated"[^>]*>about \d+</span> outbox messages', html), html
    # The capped count, then the planner's estimate (EXPLAIN) instead of a full count.
    assert len(queries) == exact_queries + 1
    assert any(q["sql"].startswith("EXPLAIN") for q in queries.captured_queries)

    # A filter with fewer rows than the limit is counted exactly.
    html = admin_client.get(OUTBOX_URL, {"state": "dead"}).content.decode()
    assert "wp-estimated" not in html
    assert "2 outbox messages" in html


def test_the_estimate_is_never_below_the_rows_counted(world: World) -> None:
    queryset = models.Outbox.objects.order_by("seq")
    paginator = pagination.EstimatingPaginator(queryset, 50)
    assert paginator.count == queryset.count()
    assert not paginator.estimated
    assert json.loads(queryset.explain(format="json"))[0]["Plan"]["Plan Rows"] >= 1


# -- workpump_status at many rows ----------------------------------------------------------


def status_plan(name: str, params: dict[str, Any]) -> str:
    sql = named_queries(status.QUERIES)[name]
    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN {sql}", params)
        return "\n".join(row[0] for row in cursor.fetchall())


STATUS_PARAMS = {
    "now": None,
    "categories": ["outbox", "inbox", "perspective_event", "receptor"],
    "states": list(WorkState),
    "exact_limit": status.EXACT_COUNT_LIMIT,
    "limit": 50,
    "stale_after_seconds": 20,
    "definitively_dead_after_seconds": 120,
}


@pytest.mark.parametrize("name", ["state_counts", "blocked_streams", "unhandled_topics"])
def test_status_queries_read_the_outbox_through_its_indexes(world: World, name: str) -> None:
    bulk_done(BULK_DONE_ROWS)
    plan = status_plan(name, STATUS_PARAMS)
    assert "Seq Scan on workpump_outbox" not in plan, plan


def test_done_rows_past_the_limit_are_estimated_and_labelled(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    exact = status.state_counts().by_category()["outbox"]
    assert exact.estimated == ()
    assert exact.counts[WorkState.DONE] == 1

    bulk_done(BULK_DONE_ROWS)
    monkeypatch.setattr(status, "EXACT_COUNT_LIMIT", 100)
    counted = status.state_counts().by_category()["outbox"]
    assert counted.estimated == (WorkState.DONE,)
    # reltuples after ANALYZE less the undone rows: close to the real count
    assert abs(counted.counts[WorkState.DONE] - (BULK_DONE_ROWS + 1)) <= BULK_DONE_ROWS // 20
    # every other state stays exact
    assert {s: n for s, n in counted.counts.items() if s != WorkState.DONE} == {
        s: n for s, n in exact.counts.items() if s != WorkState.DONE
    }
    data = status.as_json(status.collect())
    assert data["categories"]["outbox"]["estimated"] == ["done"]


# -- JIT -------------------------------------------------------------------------------------


def jit_setting() -> str:
    return str(run_sql("SELECT current_setting('jit') AS jit")[0]["jit"])


@pytest.mark.django_db(transaction=True)
def test_without_jit_turns_jit_off_for_its_transaction_only() -> None:
    from django_workpump import db

    assert connection.in_atomic_block is False
    before = jit_setting()
    with db.without_jit():
        assert connection.in_atomic_block
        assert jit_setting() == "off"
    assert jit_setting() == before


def test_a_page_turns_jit_off_before_its_queries_and_renders_inside(
    admin_client: Client, world: World
) -> None:
    run_sql("SET LOCAL jit = on")
    with CaptureQueriesContext(connection) as queries:
        response = admin_client.get(OUTBOX_URL, {"state": STUCK_FILTER})
    assert response.status_code == 200
    sql = [q["sql"] for q in queries.captured_queries]
    jit_off = sql.index("SET LOCAL jit = off")
    # Everything about the rows comes after it: the count, the page (fetched while the
    # template renders) and the filters' choices.
    rows = [i for i, q in enumerate(sql) if "workpump_outbox" in q]
    assert rows and min(rows) > jit_off
    # The stuck filter's rows are counted as its arms read them (filtered_seqs_count).
    assert any("SELECT count(*) FROM (" in q and "holders" in q for q in sql)
    assert jit_setting() == "off"


def test_the_status_report_runs_without_jit(world: World) -> None:
    run_sql("SET LOCAL jit = on")
    with CaptureQueriesContext(connection) as queries:
        status.collect()
    assert queries.captured_queries[0]["sql"] == "SET LOCAL jit = off"
    assert jit_setting() == "off"


def outbox_truth() -> dict[str, int]:
    """Rows per state by workpump.state_of, counted row by row."""
    states = annotate_work(models.Outbox.objects.all(), SPEC).values_list("wp_state", flat=True)
    return {state: sum(1 for s in states if s == state) for state in WorkState}


def test_undone_states_are_exact_within_the_limit_and_estimated_past_it(
    overlapping: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    truth = outbox_truth()
    exact = status.state_counts().by_category()["outbox"]
    assert exact.counts == truth
    assert exact.estimated == ()

    monkeypatch.setattr(status, "EXACT_COUNT_LIMIT", 3)
    capped = status.state_counts().by_category()["outbox"]
    assert set(capped.estimated) >= {s for s, n in truth.items() if n > 3 * 3}
    for state, count in capped.counts.items():
        if state in capped.estimated:
            assert count >= 4  # at least the rows counted: one past the limit
        else:
            assert count == truth[state], state
    assert WorkState.DEAD not in capped.estimated  # two dead rows


def test_unhandled_topics_past_the_limit_are_estimated(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    models.ServiceInstance.objects.filter(pk=world.live.pk).update(
        metadata={"categories": ["outbox"], "topics": {"outbox": ["topic.pending"]}}
    )
    exact = {u.topic: u for u in status.unhandled_topics() if u.category == "outbox"}
    assert "topic.pending" not in exact
    assert exact["topic.due_retry"].rows == 1 and not exact["topic.due_retry"].estimated
    # Every category but the outbox is run whole by the live instance: none is read.
    monkeypatch.setattr(status, "EXACT_COUNT_LIMIT", 1)
    capped = status.unhandled_topics()
    assert capped and all(u.estimated for u in capped)
    assert {u.topic for u in capped} <= set(exact)


# -- every category --------------------------------------------------------------------------

BULK_SQL = {
    models.Inbox: (
        "INSERT INTO workpump_inbox (work_id, topic, payload, attempts, done_at)"
        " SELECT gen_random_uuid(), 'bulk.done', '{}'::jsonb, 1, now() - interval '1 hour'"
        f" - {DONE_BATCH_SQL.format(n='g')} FROM generate_series(1, %(n)s) g"
    ),
    models.PerspectiveEvent: (
        "INSERT INTO workpump_perspective_event (work_id, topic, event_id,"
        " attempts, done_at)"
        " SELECT gen_random_uuid(), 'bulk.done', e.event_id, 1, now() - interval '1 hour'"
        f" - {DONE_BATCH_SQL.format(n='e.seq')} FROM workpump_event e WHERE e.event_type = 'bulk'"
    ),
    models.ReceptorProcessing: (
        "INSERT INTO workpump_receptor_processing (work_id, topic, event_id, attempts,"
        " done_at)"
        " SELECT gen_random_uuid(), 'bulk.done', e.event_id, 1, now() - interval '1 hour'"
        f" - {DONE_BATCH_SQL.format(n='e.seq')} FROM workpump_event e WHERE e.event_type = 'bulk'"
    ),
}
OTHER_CATEGORIES = [models.Inbox, models.PerspectiveEvent, models.ReceptorProcessing]


@pytest.mark.parametrize("model", OTHER_CATEGORIES, ids=lambda m: m._meta.model_name)
def test_each_filter_of_every_category_reads_its_rows_through_an_index(
    world: World, model: Any
) -> None:
    """The outbox's test above, for the inbox, perspective and receptor tables: a few
    rows of each kind (the admin's fixtures) among many done ones."""
    live, now = world.live.instance_id, world.now
    factory = FACTORIES[model]
    factory(instance_id=live, lease_expiry=now + secs(60), claimed_at=now, attempts=1)
    factory(instance_id=world.gone_id, lease_expiry=now - secs(60), claimed_at=now, attempts=1)
    factory(attempts=6, scheduled_for=now + secs(60))
    factory(attempts=10, dead_lettered_at=now)
    run_sql(
        "INSERT INTO workpump_event (event_id, event_type, payload)"
        " SELECT gen_random_uuid(), 'bulk', '{}'::jsonb FROM generate_series(1, %(n)s)",
        {"n": BULK_DONE_ROWS},
    )
    run_sql(BULK_SQL[model], {"n": BULK_DONE_ROWS})
    run_sql(f"ANALYZE {model._meta.db_table}")
    table = model._meta.db_table
    url = f"/admin/workpump/{model._meta.model_name}/"
    model_admin = admin.site._registry[model]
    user = User.objects.create_superuser(f"su-{table}", password="x")
    prefix = {"workpump_perspective_event": "persp"}.get(table, table.split("_")[1])
    for params in FILTERS:
        request = RequestFactory().get(url, params)
        request.user = user
        queryset = model_admin.get_changelist_instance(request).queryset
        for plan in filter_plans(queryset, params):
            assert f"Seq Scan on {table}" not in plan, (params, plan)
            assert re.search(r"Index (Only )?Scan|Bitmap Index Scan", plan), (params, plan)
        ordered = ORDERED_PAGE_PLANS.get(params.get("state", ""))
        if ordered:
            plan = queryset[:51].explain()
            assert re.search(ordered.format(prefix=prefix), plan), (params, plan)


def test_rows_held_per_instance_are_counted_up_to_the_limit(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    live = str(world.live.instance_id)
    exact = {str(i.instance_id): i for i in status.instances()}[live]
    assert exact.rows_held["outbox"] == 3  # leased_live, lease_expired, ok_head
    assert exact.rows_held_estimated == ()
    monkeypatch.setattr(status, "EXACT_COUNT_LIMIT", 1)
    capped = {str(i.instance_id): i for i in status.instances()}[live]
    assert capped.rows_held["outbox"] == 2  # one past the limit: "at least"
    assert capped.rows_held_estimated == ("outbox",)
    listed = {i["instance_id"]: i for i in status.as_json(status.collect())["instances"]}
    assert listed[live]["rows_held_estimated"] == ["outbox"]


# -- each state's page, in every category: its rows and its default order --------------------

FACTORIES = {
    models.Outbox: factories.OutboxFactory,
    models.Inbox: factories.InboxFactory,
    models.PerspectiveEvent: factories.PerspectiveEventFactory,
    models.ReceptorProcessing: factories.ReceptorProcessingFactory,
}
DONE = "done"  # a case's done time, set on the category's done column

# name, columns (times in seconds from now; DONE is the done column), its state.
STATE_CASES: list[tuple[str, dict[str, Any], str]] = [
    ("pending", {}, WorkState.PENDING),
    ("pending_urgent", {"priority": 5}, WorkState.PENDING),
    ("pending_lowly", {"priority": -5}, WorkState.PENDING),
    ("due_retry", {"attempts": 2, "scheduled_for": -5}, WorkState.PENDING),
    ("head", {"stream": "s1", "attempts": 1, "held": 100}, WorkState.LEASED),
    ("behind_head", {"stream": "s1", "priority": 5}, WorkState.PENDING),
    ("due_behind", {"stream": "s1", "scheduled_for": -90}, WorkState.PENDING),
    ("deferred_behind", {"stream": "s1", "scheduled_for": 90}, WorkState.SCHEDULED),
    ("retry_later", {"attempts": 2, "scheduled_for": 60}, WorkState.SCHEDULED),
    ("retry_soon", {"attempts": 1, "scheduled_for": 30}, WorkState.SCHEDULED),
    ("retry_soon_too", {"attempts": 1, "scheduled_for": 30}, WorkState.SCHEDULED),
    ("leased", {"attempts": 1, "held": 100}, WorkState.LEASED),
    ("expired", {"attempts": 1, "held": -5}, WorkState.ORPHANED),
    ("evicted", {"attempts": 1, "claimed_at": -60}, WorkState.ORPHANED),
    ("done_old", {DONE: -60, "attempts": 1}, WorkState.DONE),
    ("done_new", {DONE: -5, "attempts": 1}, WorkState.DONE),
    ("done_together", {DONE: -30, "attempts": 1}, WorkState.DONE),
    ("done_together_too", {DONE: -30, "attempts": 1}, WorkState.DONE),
    ("dead_old", {"attempts": 10, "dead_lettered_at": -60}, WorkState.DEAD),
    ("dead_new", {"attempts": 10, "dead_lettered_at": -5}, WorkState.DEAD),
    ("dead_together", {"attempts": 10, "dead_lettered_at": -30}, WorkState.DEAD),
    ("dead_together_too", {"attempts": 10, "dead_lettered_at": -30}, WorkState.DEAD),
    ("cancelled", {DONE: -5, "end_state": "cancelled"}, WorkState.CANCELLED),
    ("cancelled_old", {DONE: -50, "end_state": "cancelled"}, WorkState.CANCELLED),
    ("discarded", {DONE: -5, "end_state": "discarded", "attempts": 1}, WorkState.DISCARDED),
]


@pytest.fixture
def live_holder(now: datetime) -> Any:
    """A live instance (fresh heartbeat), and no rows yet."""
    return factories.ServiceInstanceFactory(
        started_at=now - secs(60), last_heartbeat_at=now - secs(1)
    ).instance_id


GONE_HOLDER = uuid.UUID("00000000-0000-0000-0000-00000000a0e1")  # neither live nor known


def make_cases(model: Any, now: datetime, holder: Any) -> dict[str, Any]:
    """One row per case of STATE_CASES in ``model``'s table, in that order: name -> row."""
    rows = {}
    for name, case, _ in STATE_CASES:
        fields: dict[str, Any] = {"stream": None, "created_at": now - secs(300)}
        for key, value in case.items():
            if key == DONE:
                fields["done_at"] = now + secs(value)
            elif key == "held":
                fields.update(instance_id=holder, lease_expiry=now + secs(value))
                fields["claimed_at"] = now - secs(60)
            elif key in ("scheduled_for", "dead_lettered_at", "claimed_at"):
                fields[key] = now + secs(value)
            else:
                fields[key] = value
        rows[name] = FACTORIES[model](**fields)
    return rows


def default_order(state: str, done: str) -> Any:
    """The sort key of the rows of ``state``'s page, as docs/admin.md describes it."""
    if state in (WorkState.DONE, WorkState.CANCELLED, WorkState.DISCARDED):
        return lambda row: (-getattr(row, done).timestamp(), -row.seq)
    if state == WorkState.DEAD:
        return lambda row: (-row.dead_lettered_at.timestamp(), -row.seq)
    if state == WorkState.SCHEDULED:
        return lambda row: (row.scheduled_for, row.seq)
    if state == WorkState.PENDING:
        return lambda row: (-row.priority, row.seq)
    return lambda row: -row.seq  # newest first


@pytest.mark.parametrize("state", list(WorkState))
@pytest.mark.parametrize("model", WORK_MODELS, ids=lambda m: m._meta.model_name)
def test_each_state_page_lists_the_rows_of_its_state_in_its_default_order(
    now: datetime, live_holder: Any, model: Any, state: str
) -> None:
    """STATE_CASES in each category: a state's page holds the rows ``workpump.state_of``
    puts in that state, and only those (as it did when every page was newest first), in
    the order of the partial index that holds them."""
    spec = admin.site._registry[model].spec
    cases = make_cases(model, now, live_holder)
    expected_names = {name for name, _, case_state in STATE_CASES if case_state == state}
    truth = annotate_work(model._default_manager.all(), spec).filter(wp_state=state)
    assert {row.pk for row in truth} == {cases[name].pk for name in expected_names}

    request = RequestFactory().get(f"/admin/workpump/{model._meta.model_name}/", {"state": state})
    request.user = User.objects.create_superuser(f"su-{model._meta.model_name}", password="x")
    shown = list(admin.site._registry[model].get_changelist_instance(request).queryset)
    assert [row.pk for row in shown] == [
        row.pk for row in sorted(truth, key=default_order(state, "done_at"))
    ]


def test_the_stuck_page_of_every_category_is_newest_first(now: datetime) -> None:
    for model in WORK_MODELS:
        spec = admin.site._registry[model].spec
        make_cases(model, now, GONE_HOLDER)  # every held row is stuck
        truth = annotate_work(model._default_manager.all(), spec).filter(wp_stuck=True)
        params = {"state": STUCK_FILTER}
        request = RequestFactory().get(f"/admin/workpump/{model._meta.model_name}/", params)
        request.user = User.objects.create_superuser(f"st-{model._meta.model_name}", password="x")
        shown = admin.site._registry[model].get_changelist_instance(request).queryset
        assert [row.pk for row in shown] == sorted((row.pk for row in truth), reverse=True)
        assert len(truth) >= 3, model


ORDER_NOTES = {
    WorkState.DONE: ("most recently done first", "done", "descending"),
    WorkState.DEAD: ("most recently dead-lettered first", None, None),
    WorkState.SCHEDULED: ("soonest due first", "scheduled", "ascending"),
    WorkState.PENDING: ("in claim order: highest priority first, then oldest first", None, None),
    WorkState.LEASED: ("newest first", "work_id_cell", "descending"),
    None: ("newest first", "work_id_cell", "descending"),
}


@pytest.mark.parametrize("state", list(ORDER_NOTES), ids=str)
def test_a_state_page_says_its_order_and_runs_the_pinned_queries(
    admin_client: Client, world: World, state: str | None
) -> None:
    params = {"state": state} if state else {}
    with CaptureQueriesContext(connection) as queries:
        html = admin_client.get(OUTBOX_URL, params).content.decode()
    assert len(queries) == OUTBOX_CHANGELIST_QUERIES
    note, column, direction = ORDER_NOTES[state]
    assert f'<span class="wp-order">{note}</span>' in html
    sorted_columns = re.findall(r'<th scope="col" class="[^"]*column-(\w+) sorted (\w+)"', html)
    assert sorted_columns[:1] == ([(column, direction)] if column else []), sorted_columns
    # Sorted by a column, the page says no default order.
    html = admin_client.get(OUTBOX_URL, {**params, "o": "-11"}).content.decode()
    assert "wp-order" not in html
