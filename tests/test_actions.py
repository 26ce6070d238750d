"""The operator API (django_workpump.actions, exported by the package) and
``manage.py workpump_action``: ids of any category, filters, --dry-run and the prompt.
"""

from __future__ import annotations

import io
import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.utils import timezone

import django_workpump as workpump
from django_workpump import models
from django_workpump.management.commands.workpump_action import CONFIRM_OVER
from tests import factories
from tests.conftest import T0

pytestmark = pytest.mark.django_db

HOUR = timedelta(hours=1)


def state_of(row: Any) -> str:
    """The row's state now, by workpump.state_of (as the admin and status show it)."""
    from django_workpump.admin.expressions import WorkSpec, state_of as state_expr  # noqa: I001

    specs = {
        models.Outbox: WorkSpec("outbox", "message_id", "destination", "processed_at", None),
        models.Inbox: WorkSpec("inbox", "message_id", "handler_name", "processed_at", None),
        models.ReceptorProcessing: WorkSpec(
            "receptor", "work_id", "receptor_name", "completed_at", "receptor_name"
        ),
    }
    model = type(row)
    return model.objects.annotate(s=state_expr(specs[model])).get(pk=row.pk).s


@pytest.fixture
def rows() -> dict[str, Any]:
    now = timezone.now()
    live = factories.ServiceInstanceFactory(last_heartbeat_at=now)
    gone = uuid.uuid4()  # an instance with no row: not live
    return {
        "scheduled": factories.OutboxFactory(scheduled_for=now + HOUR),
        "scheduled_inbox": factories.InboxFactory(scheduled_for=now + HOUR),
        "pending": factories.OutboxFactory(),
        "dead": factories.OutboxFactory(dead_lettered_at=T0, failure_reason="max_attempts"),
        "dead_receptor": factories.ReceptorProcessingFactory(
            dead_lettered_at=T0, failure_reason="max_attempts", stream=None
        ),
        "held_gone": factories.InboxFactory(instance_id=gone, lease_expiry=now + HOUR),
        "held_live": factories.OutboxFactory(
            instance_id=live.instance_id, lease_expiry=now + HOUR, claimed_at=now
        ),
        "done": factories.OutboxFactory(processed_at=T0),
        "new": factories.OutboxFactory(created_at=now, destination="emails.fresh"),
        "live": live,
    }


def key(row: Any) -> uuid.UUID:
    return row.work_id if isinstance(row, models.ReceptorProcessing) else row.message_id


# --- the Python functions -------------------------------------------------------------------


def test_retry_now_finds_each_ids_category_and_returns_what_changed(rows):
    ids = [key(rows["scheduled"]), str(key(rows["scheduled_inbox"])), key(rows["dead"])]
    changed = workpump.retry_now([*ids, uuid.uuid4()])
    assert set(changed) == {key(rows["scheduled"]), key(rows["scheduled_inbox"])}
    assert state_of(rows["scheduled"]) == state_of(rows["scheduled_inbox"]) == "pending"
    assert state_of(rows["dead"]) == "dead"


def test_requeue_dead_gives_dead_rows_of_any_category_new_attempts(rows):
    changed = workpump.requeue_dead([key(rows["dead"]), key(rows["dead_receptor"])])
    assert set(changed) == {key(rows["dead"]), key(rows["dead_receptor"])}
    assert state_of(rows["dead"]) == state_of(rows["dead_receptor"]) == "pending"
    assert workpump.requeue_dead(key(rows["pending"])) == []


def test_dead_letter_parks_undone_rows_with_the_reason(rows):
    changed = workpump.dead_letter([key(rows["pending"]), key(rows["done"])], "bad address")
    assert changed == [key(rows["pending"])]
    parked = models.Outbox.objects.get(pk=rows["pending"].pk)
    assert (state_of(parked), parked.failure_reason) == ("dead", "bad address")
    with pytest.raises(ValueError, match="dead_letter needs a reason"):
        workpump.dead_letter([key(rows["pending"])], " ")
    with pytest.raises(ValueError, match="is 41 characters long, over 40"):
        workpump.dead_letter([key(rows["pending"])], "x" * 41)


def test_release_takes_leases_from_live_instances_only_when_forced(rows):
    ids = [key(rows["held_gone"]), key(rows["held_live"])]
    assert workpump.release(ids) == [key(rows["held_gone"])]
    assert state_of(rows["held_live"]) == "leased"
    assert workpump.release(ids, force=True) == [key(rows["held_live"])]
    assert state_of(rows["held_live"]) == "orphaned"  # claimed_at stays: the attempt is open


def test_cancel_ends_undone_rows_of_any_category_and_reports_the_others(rows):
    unknown = uuid.uuid4()
    ids = [
        key(rows["pending"]),
        key(rows["scheduled_inbox"]),
        key(rows["dead_receptor"]),
        key(rows["held_live"]),
        key(rows["done"]),
        unknown,
    ]

    result = workpump.cancel(ids)

    assert set(result) == {
        key(rows["pending"]),
        key(rows["scheduled_inbox"]),
        key(rows["dead_receptor"]),
        key(rows["held_live"]),
    }
    assert result.running == [key(rows["held_live"])]
    assert result.unknown == [unknown]
    assert result.ended == [key(rows["done"])]
    for name in ("pending", "scheduled_inbox", "dead_receptor", "held_live"):
        assert state_of(rows[name]) == "cancelled", name
    assert state_of(rows["done"]) == "done"
    assert workpump.cancel([]) == []
    with pytest.raises(ValueError, match="'nope' is not a valid work id"):
        workpump.cancel(["nope"])


def test_a_given_category_skips_the_lookup(rows, django_assert_num_queries):
    with django_assert_num_queries(1):
        assert workpump.retry_now([key(rows["scheduled"])], category="outbox") == [
            key(rows["scheduled"])
        ]
    assert workpump.retry_now([key(rows["scheduled_inbox"])], category="outbox") == []


def test_evict_tombstones_the_instance_and_releases_its_rows(rows):
    instance_id = rows["live"].instance_id
    assert workpump.evict(instance_id) == 1
    assert models.Eviction.objects.filter(instance_id=instance_id).exists()
    assert not models.ServiceInstance.objects.filter(instance_id=instance_id).exists()
    assert workpump.evict(str(instance_id)) == 0


def test_bad_ids_and_categories_name_the_fix():
    with pytest.raises(ValueError, match="'nope' is not a valid work id: pass UUIDs"):
        workpump.retry_now(["nope"])
    with pytest.raises(ValueError, match="Unknown category 'outboxes'; use one of outbox"):
        workpump.retry_now([uuid.uuid4()], category="outboxes")
    with pytest.raises(ValueError, match="'x' is not a valid instance id"):
        workpump.evict("x")


# --- the command --------------------------------------------------------------------------


class Terminal(io.StringIO):
    """A stdin that is a terminal, with the operator's answer in it."""

    def isatty(self) -> bool:
        return True


def run(*args: str, stdin: Any = None) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    call_command("workpump_action", *args, stdout=out, stderr=err, stdin=stdin or io.StringIO())
    return out.getvalue(), err.getvalue()


def test_the_command_acts_on_ids_and_reports_what_changed(rows):
    missing = uuid.uuid4()
    out, err = run("retry", str(key(rows["scheduled"])), str(key(rows["dead"])), str(missing))
    assert f"retried: outbox {key(rows['scheduled'])} emails.welcome (was scheduled)" in out
    assert out.splitlines()[-1] == (
        "retry: 1 of 2 selected rows retried; 1 left as they were (only scheduled rows "
        "(waiting for a retry or a deferral) can be retried now)."
    )
    assert err.strip() == f"{missing}: no work row with this id matches; skipped."


def test_the_command_selects_by_filters(rows):
    out, _ = run("requeue", "--state", "dead", "--category", "receptor")
    assert out.splitlines() == [
        f"re-queued: receptor {key(rows['dead_receptor'])} warehouse (was dead)",
        "requeue: 1 of 1 selected row re-queued.",
    ]
    assert state_of(rows["dead"]) == "dead"  # an outbox row: not selected
    out, _ = run("dead-letter", "--topic", "emails.fresh", "--reason", "typo", "--yes")
    assert "dead-letter: 1 of 1 selected row dead-lettered." in out
    assert models.Outbox.objects.get(pk=rows["new"].pk).failure_reason == "typo"


def test_older_than_selects_by_age(rows):
    out, _ = run("dead-letter", "--category", "outbox", "--state", "pending", "--older-than", "60")
    # the pending row was created at T0, long ago; emails.fresh a moment ago
    assert f"outbox {key(rows['pending'])}" in out
    assert "emails.fresh" not in out


def test_dry_run_prints_exactly_what_would_change_and_changes_nothing(rows):
    out, _ = run("release", str(key(rows["held_gone"])), str(key(rows["held_live"])), "--dry-run")
    assert out.splitlines() == [
        f"would be released: inbox {key(rows['held_gone'])} stripe.webhook (was leased)",
        "release: 1 of 2 selected rows would be released; 1 left as they were (only leased or "
        "orphaned rows have a lease to release, and rows of a live instance need --force); "
        "dry run, nothing was changed.",
    ]
    assert models.Inbox.objects.get(pk=rows["held_gone"].pk).instance_id is not None
    out, _ = run("evict", str(rows["live"].instance_id), "--dry-run")
    assert out.splitlines() == [
        f"would evict {rows['live'].instance_id}: 1 rows released.",
        "evict: dry run, nothing was changed.",
    ]
    assert not models.Eviction.objects.exists()


def test_the_command_cancels_and_its_dry_run_changes_nothing(rows):
    pending, done = str(key(rows["pending"])), str(key(rows["done"]))

    out, _ = run("cancel", pending, done, "--dry-run")

    assert out.splitlines() == [
        f"would be cancelled: outbox {pending} emails.welcome (was pending)",
        "cancel: 1 of 2 selected rows would be cancelled; 1 left as they were (rows that "
        "already ended (done, cancelled, discarded) cannot be cancelled); dry run, nothing "
        "was changed.",
    ]
    assert state_of(rows["pending"]) == "pending"

    out, _ = run("cancel", "--state", "scheduled", "--category", "inbox")
    assert out.splitlines() == [
        f"cancelled: inbox {key(rows['scheduled_inbox'])} stripe.webhook (was scheduled)",
        "cancel: 1 of 1 selected row cancelled.",
    ]
    assert state_of(rows["scheduled_inbox"]) == "cancelled"
    out, _ = run("cancel", "--state", "cancelled")
    assert "cancel: 0 of 1 selected row cancelled" in out


@pytest.fixture
def many() -> list[models.Outbox]:
    return factories.OutboxFactory.create_batch(
        CONFIRM_OVER + 1, destination="bulk", scheduled_for=timezone.now() + HOUR
    )


def test_a_large_selection_without_a_terminal_is_refused(many):
    with pytest.raises(CommandError) as raised:
        run("retry", "--topic", "bulk")
    assert str(raised.value) == (
        f"This would retry {CONFIRM_OVER + 1} rows, more than {CONFIRM_OVER}, and there is no "
        "terminal to ask for confirmation. Check the selection with --dry-run, then pass --yes."
    )
    assert models.Outbox.objects.filter(destination="bulk", scheduled_for__isnull=True).count() == 0


def test_a_large_selection_is_confirmed_at_the_prompt(many):
    with pytest.raises(CommandError, match=r"Cancelled: nothing was changed\."):
        run("retry", "--topic", "bulk", stdin=Terminal("n\n"))
    out, _ = run("retry", "--topic", "bulk", stdin=Terminal("y\n"))
    assert out.startswith(f"retry {CONFIRM_OVER + 1} rows? [y/N] ")
    assert f"retry: {CONFIRM_OVER + 1} of {CONFIRM_OVER + 1} selected rows retried." in out
    # --yes and --dry-run never ask
    factories.OutboxFactory.create_batch(
        CONFIRM_OVER + 1, destination="bulk", scheduled_for=timezone.now() + HOUR
    )
    assert "would be retried" in run("retry", "--topic", "bulk", "--dry-run")[0]
    out, _ = run("retry", "--topic", "bulk", "--yes")
    assert f"retry: {CONFIRM_OVER + 1} of {2 * CONFIRM_OVER + 2} selected rows retried" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["retry"], "Name the rows to retry: give their ids, or select them with --category"),
        (["retry", "--force", "--state", "dead"], "--force applies to release only"),
        (["retry", "--reason", "x", "--state", "dead"], "--reason applies to dead-letter"),
        (["evict", "--state", "dead"], "evict takes instance ids only"),
        (["evict"], "evict needs one or more instance ids"),
        (["requeue", "not-a-uuid"], "'not-a-uuid' is not a valid work id"),
        (["release", "--older-than", "-1"], "--older-than must be 0 or more seconds"),
    ],
)
def test_bad_arguments_name_the_fix(args, message):
    with pytest.raises(CommandError, match=message):
        run(*args)


def test_nothing_selected_changes_nothing():
    out, _ = run("requeue", "--state", "dead")
    assert out.strip() == "Nothing to requeue: no row matches."
