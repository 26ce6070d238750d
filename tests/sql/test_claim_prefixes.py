"""claim_work also claims every topic that starts with a given prefix.

A django.tasks backend with empty QUEUES accepts any queue name, so its rows' topics
(``django.tasks:<alias>:<queue>``) cannot be listed in advance: the claimer passes the
prefix ``django.tasks:<alias>:`` in ``p_topic_prefixes``. Here: the SQL (each category,
ready rows and due timers, no LIKE wildcards, bad input), the registry's prefix
handlers and the topic selection of ``runworkpump --topics/--queues``, and the "no live
handler" report. Time comes from p_now; each database test runs in a rolled-back
transaction.
"""

from __future__ import annotations

import json
import uuid
from datetime import datetime
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import DataError, transaction

from django_workpump import status
from django_workpump.registry import (
    Handler,
    Registry,
    TopicSelectionError,
    claim_prefixes,
    claim_topics,
)
from tests.helpers import T0, WORK_TABLES, A, at, enroll, explaining_connection, run_sql, scalar

CATEGORIES = sorted(WORK_TABLES)
db = pytest.mark.django_db


def produce(category: str, topic: str) -> uuid.UUID:
    """One row of ``category`` whose topic is ``topic``."""
    if category == "outbox":
        return scalar("SELECT workpump.send(%s, '{}'::jsonb)", [topic])
    if category == "inbox":
        message_id = uuid.uuid4()
        run_sql("SELECT workpump.receive(%s, %s, '{}'::jsonb)", [message_id, topic])
        return message_id
    event_id = scalar(
        "SELECT workpump.emit('order.placed', '{}'::jsonb, p_subscribers => %s::jsonb)",
        [json.dumps([{"category": category, "name": topic}])],
    )
    table, key = WORK_TABLES[category]
    return scalar(f"SELECT {key} FROM {table} WHERE event_id = %s", [event_id])


def claim(*, topics: Any = None, prefixes: Any = None, now: datetime = T0) -> list[dict[str, Any]]:
    return run_sql(
        "SELECT * FROM workpump.claim_work(p_instance_id => %s, p_now => %s,"
        " p_topics => %s::jsonb, p_topic_prefixes => %s::jsonb)",
        [
            A,
            now,
            None if topics is None else json.dumps(topics),
            None if prefixes is None else json.dumps(prefixes),
        ],
    )


# --- the SQL --------------------------------------------------------------------------------


@db
@pytest.mark.parametrize("category", CATEGORIES)
def test_a_prefix_claims_every_topic_it_starts_and_no_other(category):
    enroll(A)
    served = [
        produce(category, "django.tasks:open:reports"),
        produce(category, "django.tasks:open:x"),
    ]
    produce(category, "django.tasks:openx:reports")  # another alias that merely starts alike
    produce(category, "django.tasks:other:reports")
    produce(category, "emails.welcome")

    rows = claim(topics={category: []}, prefixes={category: ["django.tasks:open:"]})

    assert sorted(r["work_id"] for r in rows) == sorted(served)
    assert {r["category"] for r in rows} == {category}


@db
def test_topics_and_prefixes_add_up_and_a_category_left_out_claims_nothing():
    enroll(A)
    by_prefix = produce("inbox", "django.tasks:open:a")
    by_name = produce("inbox", "stripe.webhook")
    produce("inbox", "other.handler")
    produce("outbox", "django.tasks:open:a")  # the prefix is the inbox's only

    rows = claim(
        topics={"inbox": ["stripe.webhook"], "outbox": []},
        prefixes={"inbox": ["django.tasks:open:"]},
    )

    assert {(r["category"], r["work_id"]) for r in rows} == {
        ("inbox", by_prefix),
        ("inbox", by_name),
    }


@db
def test_a_prefix_is_matched_literally_never_as_a_like_pattern():
    enroll(A)
    literal = produce("inbox", "django.tasks:my_alias%:q")
    produce("inbox", "django.tasks:myXaliasYYY:q")  # what '_' and '%' would match in LIKE

    rows = claim(topics={"inbox": []}, prefixes={"inbox": ["django.tasks:my_alias%:"]})

    assert [r["work_id"] for r in rows] == [literal]


@db
def test_a_prefix_claims_due_timers_too():
    enroll(A)
    work_id = produce("inbox", "django.tasks:open:slow")
    [first] = claim(topics={"inbox": []}, prefixes={"inbox": ["django.tasks:open:"]})
    assert first["work_id"] == work_id and first["attempts"] == 1

    # The lease expires: the row is a due timer, found through the prefix again.
    [again] = claim(topics={"inbox": []}, prefixes={"inbox": ["django.tasks:open:"]}, now=at(301))
    assert (again["work_id"], again["attempts"]) == (work_id, 2)


@db
def test_without_topics_a_prefix_changes_nothing_and_empty_choices_claim_nothing():
    enroll(A)
    produce("inbox", "django.tasks:open:a")
    produce("outbox", "emails.welcome")

    assert claim(topics={"inbox": [], "outbox": []}, prefixes={"inbox": []}) == []
    assert claim(topics={"inbox": [], "outbox": []}, prefixes={}) == []
    # p_topics NULL is every topic already
    assert len(claim(prefixes={"inbox": ["nothing.matches:"]})) == 2


@db
@pytest.mark.parametrize(
    "prefixes",
    [
        '["django.tasks:open:"]',
        '{"inbx": ["a:"]}',
        '{"inbox": "a:"}',
        '{"inbox": [1]}',
        '{"inbox": [""]}',
    ],
)
def test_malformed_prefixes_are_refused_with_the_expected_shape(prefixes):
    enroll(A)
    expected = r"p_topic_prefixes as an object of category: \[non-empty prefix, ...\]"
    with pytest.raises(DataError, match=expected), transaction.atomic():
        run_sql(
            "SELECT * FROM workpump.claim_work(%s, p_topics => '{}',"
            " p_topic_prefixes => %s::jsonb)",
            [A, prefixes],
        )


@pytest.mark.django_db(transaction=True)
def test_the_claim_by_prefix_scans_the_partial_indexes(raw_connect):
    conn, plans = explaining_connection(raw_connect)
    conn.execute("SELECT workpump.record_heartbeat(%s, 'tests', 'localhost', 1)", [A])
    message_id = uuid.uuid4()
    conn.execute("SELECT workpump.receive(%s, 'django.tasks:open:q', '{}'::jsonb)", [message_id])
    try:
        plans.clear()
        rows = conn.execute(
            "SELECT work_id FROM workpump.claim_work(%s, p_topics => '{\"inbox\": []}',"
            ' p_topic_prefixes => \'{"inbox": ["django.tasks:open:"]}\')',
            [A],
        ).fetchall()
        assert [r["work_id"] for r in rows] == [message_id]
        text = "\n".join(plans)
        assert "using wp_inbox_ready on" in text
        assert "using wp_inbox_timer on" in text
        assert "Seq Scan on workpump_inbox" not in text
    finally:
        conn.execute("DELETE FROM workpump_inbox WHERE work_id = %s", [message_id])
        conn.execute("DELETE FROM workpump_service_instance WHERE instance_id = %s", [A])


# --- the registry and the topic selection ----------------------------------------------------


def run(work: Any) -> None:
    return None


def run_other(work: Any) -> None:
    return None


def registry_with_prefix() -> Registry:
    handlers = Registry()
    handlers.register(Handler("inbox", "django.tasks:listed:default", run))
    handlers.register(Handler("inbox", "django.tasks:open:", run_other, prefix=True))
    handlers.register(Handler("outbox", "emails.welcome", run))
    return handlers


def test_a_topic_without_its_own_handler_falls_back_to_the_longest_prefix():
    handlers = registry_with_prefix()
    handlers.register(Handler("inbox", "django.tasks:", run, prefix=True))

    assert handlers.get("inbox", "django.tasks:open:anything").func is run_other
    assert handlers.get("inbox", "django.tasks:other:q").func is run
    assert handlers.get("inbox", "django.tasks:listed:default").func is run  # its own
    assert handlers.get("outbox", "django.tasks:open:anything") is None  # per category
    assert handlers.get("inbox", "stripe.webhook") is None
    # prefix handlers are not topics
    assert [h.topic for h in handlers.handlers("inbox")] == ["django.tasks:listed:default"]
    handlers.unregister("inbox", "django.tasks:open:", prefix=True)
    assert handlers.get("inbox", "django.tasks:open:anything").func is run


def test_two_functions_for_one_prefix_are_refused():
    handlers = registry_with_prefix()
    with pytest.raises(
        ImproperlyConfigured, match=r"Prefix 'django\.tasks:open:' is registered twice"
    ):
        handlers.register(Handler("inbox", "django.tasks:open:", run, prefix=True))


def test_a_pump_claims_the_prefixes_unless_topics_or_queues_narrow_it():
    handlers = registry_with_prefix()
    categories = ["outbox", "inbox"]

    assert claim_topics(handlers, categories) == {
        "outbox": ["emails.welcome"],
        "inbox": ["django.tasks:listed:default"],
    }
    assert claim_prefixes(handlers, categories) == {"outbox": [], "inbox": ["django.tasks:open:"]}

    # --queues: a queue of the open backend is a named topic, not a prefix
    assert claim_topics(handlers, categories, queues=["reports"]) == {
        "outbox": [],
        "inbox": ["django.tasks:open:reports"],
    }
    assert claim_topics(handlers, categories, queues=["default"]) == {
        "outbox": [],
        "inbox": ["django.tasks:listed:default", "django.tasks:open:default"],
    }
    assert claim_prefixes(handlers, categories, queues=["reports"]) == {"outbox": [], "inbox": []}
    # --topics: a topic a prefix handler serves is known
    assert claim_topics(handlers, categories, topics=["django.tasks:open:x"]) == {
        "outbox": [],
        "inbox": ["django.tasks:open:x"],
    }
    with pytest.raises(TopicSelectionError, match=r"No handler for topic 'django\.tasks:gone:x'"):
        claim_topics(handlers, categories, topics=["django.tasks:gone:x"])


def test_without_a_prefix_an_unknown_queue_is_still_an_error():
    handlers = Registry()
    handlers.register(Handler("inbox", "django.tasks:listed:default", run))
    with pytest.raises(TopicSelectionError, match="No task backend runs queue 'reports'"):
        claim_topics(handlers, ["inbox"], queues=["reports"])


# --- "no live handler" --------------------------------------------------------------------


@db
def test_a_topic_a_live_instance_claims_by_prefix_is_handled():
    run_sql(
        "SELECT workpump.record_heartbeat(%s, 'tests', 'localhost', 1, p_metadata => %s::jsonb)",
        [
            A,
            json.dumps(
                {
                    "categories": ["inbox"],
                    "topics": {"inbox": ["stripe.webhook"]},
                    "topic_prefixes": {"inbox": ["django.tasks:open:"]},
                }
            ),
        ],
    )
    produce("inbox", "django.tasks:open:reports")
    produce("inbox", "stripe.webhook")
    produce("inbox", "django.tasks:closed:reports")

    unhandled = status.unhandled_topics()

    assert [(u.category, u.topic, u.rows) for u in unhandled] == [
        ("inbox", "django.tasks:closed:reports", 1)
    ]
