"""The four work categories and the facts that tell them apart, defined once.

``registry`` (names, topic nouns), the admin (``WorkSpec``) and the status report read
them from here; SQL keeps the same facts in ``workpump.work_table`` and
tests/sql/test_categories.py checks that both say the same.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Category:
    """One kind of work row: its table, model and what really differs between them.

    Every work table names its columns alike: ``work_id``, ``topic`` (what a handler is
    registered under), ``done_at`` (set when the work is done).
    """

    name: str  # as SQL and the API spell it: claim_work's category column, p_categories
    table: str
    model: str  # model class name in the workpump app
    topic_scopes_streams: bool  # True: (topic, stream) orders rows; False: the stream alone
    topic_noun: str  # how messages name a topic of this category
    payload_on_row: bool  # False: the payload lives in the workpump_event row


CATEGORIES = (
    Category(
        name="outbox",
        table="workpump_outbox",
        model="Outbox",
        topic_scopes_streams=False,
        topic_noun="outbox destination",
        payload_on_row=True,
    ),
    Category(
        name="inbox",
        table="workpump_inbox",
        model="Inbox",
        topic_scopes_streams=False,
        topic_noun="inbox handler",
        payload_on_row=True,
    ),
    Category(
        name="perspective_event",
        table="workpump_perspective_event",
        model="PerspectiveEvent",
        topic_scopes_streams=True,
        topic_noun="perspective",
        payload_on_row=False,
    ),
    Category(
        name="receptor",
        table="workpump_receptor_processing",
        model="ReceptorProcessing",
        topic_scopes_streams=True,
        topic_noun="receptor",
        payload_on_row=False,
    ),
)

NAMES = tuple(category.name for category in CATEGORIES)
BY_NAME = {category.name: category for category in CATEGORIES}


def category(name: str) -> Category:
    """Return the category called ``name``; raise ValueError for an unknown name."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise ValueError(
            f"Unknown workpump category {name!r}; valid categories are {', '.join(NAMES)}."
        ) from None
