"""The four work categories and the facts that tell them apart, defined once.

``registry`` (names, topic nouns), the admin (``WorkSpec``) and the status report read
them from here; SQL keeps the same facts in ``workpump.work_table`` and
tests/sql/test_categories.py checks that both say the same.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Category:
    """One kind of work row: its table, model and the columns that differ between tables."""

    name: str  # as SQL and the API spell it: claim_work's category column, p_categories
    table: str
    model: str  # model class name in the workpump app
    key_field: str  # model field of the work id
    key_column: str  # its column (differs for receptor: the field "work_id" is column "id")
    topic_column: str  # what a handler is registered under
    done_column: str  # set when the work completed
    scope_column: str | None  # orders streams together with the stream; None: the stream alone
    topic_noun: str  # how messages name a topic of this category


CATEGORIES = (
    Category(
        name="outbox",
        table="workpump_outbox",
        model="Outbox",
        key_field="message_id",
        key_column="message_id",
        topic_column="destination",
        done_column="processed_at",
        scope_column=None,
        topic_noun="outbox destination",
    ),
    Category(
        name="inbox",
        table="workpump_inbox",
        model="Inbox",
        key_field="message_id",
        key_column="message_id",
        topic_column="handler_name",
        done_column="processed_at",
        scope_column=None,
        topic_noun="inbox handler",
    ),
    Category(
        name="perspective_event",
        table="workpump_perspective_event",
        model="PerspectiveEvent",
        key_field="event_work_id",
        key_column="event_work_id",
        topic_column="perspective_name",
        done_column="processed_at",
        scope_column="perspective_name",
        topic_noun="perspective",
    ),
    Category(
        name="receptor",
        table="workpump_receptor_processing",
        model="ReceptorProcessing",
        key_field="work_id",
        key_column="id",
        topic_column="receptor_name",
        done_column="completed_at",
        scope_column="receptor_name",
        topic_noun="receptor",
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
