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
from tests.helpers import T0

pytestmark = pytest.mark.django_db

HOUR = timedelta(hours=1)


def state_of(row: Any) -> str:
    """The row's state now, by workpump.state_of (as the admin and status show it)."""
    from django_workpump.admin.expressions import WorkSpec, state_of as state_expr  # noqa: I001

    specs = {
        models.Outbox: WorkSpec("outbox", False),
        models.Inbox: WorkSpec("inbox", False),
        models.ReceptorProcessing: WorkSpec("receptor", True),
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
        "done": factories.OutboxFactory(done_at=T0),
        "new": factories.OutboxFactory(created_at=now, topic="emails.fresh"),
        "live": live,
    }


def key(row: Any) -> uuid.UUID:
    return row.work_id


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


def test_evict_of_an_id_nothing_names_raises_and_writes_no_tombstone():
    from django_workpump.actions import UnknownInstance

    unknown = uuid.uuid4()
    with pytest.raises(UnknownInstance, match=f"under the id {unknown}; nothing was evicted"):
        workpump.evict(unknown)
    assert not models.Eviction.objects.exists()


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
    assert err.strip() == f"{missing}: no work row has this id; skipped."


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
    out, _ = run("evict", str(rows["live"].instance_id), "--dry-run", "--force")
    assert out.splitlines() == [
        f"would evict {rows['live'].instance_id}: 1 row released.",
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
        CONFIRM_OVER + 1, topic="bulk", scheduled_for=timezone.now() + HOUR
    )


def test_a_large_selection_without_a_terminal_is_refused(many):
    with pytest.raises(CommandError) as raised:
        run("retry", "--topic", "bulk")
    assert str(raised.value) == (
        f"This would retry {CONFIRM_OVER + 1} rows, more than {CONFIRM_OVER}, and there is no "
        "terminal to ask for confirmation. Check the selection with --dry-run, then pass --yes."
    )
    assert models.Outbox.objects.filter(topic="bulk", scheduled_for__isnull=True).count() == 0


def test_a_large_selection_is_confirmed_at_the_prompt(many):
    with pytest.raises(CommandError, match=r"Cancelled: nothing was changed\."):
        run("retry", "--topic", "bulk", stdin=Terminal("n\n"))
    out, _ = run("retry", "--topic", "bulk", stdin=Terminal("y\n"))
    assert out.startswith(f"retry {CONFIRM_OVER + 1} rows? [y/N] ")
    assert f"retry: {CONFIRM_OVER + 1} of {CONFIRM_OVER + 1} selected rows retried." in out
    # --yes and --dry-run never ask
    factories.OutboxFactory.create_batch(
        CONFIRM_OVER + 1, topic="bulk", scheduled_for=timezone.now() + HOUR
    )
    assert "would be retried" in run("retry", "--topic", "bulk", "--dry-run")[0]
    out, _ = run("retry", "--topic", "bulk", "--yes")
    assert f"retry: {CONFIRM_OVER + 1} of {2 * CONFIRM_OVER + 2} selected rows retried" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["retry"], "Name the rows to retry: give their ids, or select them with --category"),
        (["retry", "--force", "--state", "dead"], "--force applies to release, dead-letter"),
        (["retry", "--reason", "x", "--state", "dead"], "--reason applies to dead-letter"),
        (["evict", "--state", "dead"], "evict takes instance ids only"),
        (["evict"], "evict needs one or more instance ids"),
        (["requeue", "not-a-uuid"], "'not-a-uuid' is not a valid work id"),
        (["release", "--older-than", "-1"], "--older-than must be a number of seconds from 0"),
    ],
)
def test_bad_arguments_name_the_fix(args, message):
    with pytest.raises(CommandError, match=message):
        run(*args)


def test_nothing_selected_changes_nothing():
    out, _ = run("requeue", "--state", "dead")
    assert out.strip() == "Nothing to requeue: no row matches."


# --- flags anywhere, --database, hints that work ------------------------------------------


def test_flags_may_come_before_between_and_after_the_ids(rows):
    scheduled, dead = str(key(rows["scheduled"])), str(key(rows["dead"]))
    out, _ = run("retry", "--dry-run", scheduled, "--category", "outbox", dead, "--yes")
    assert out.splitlines()[-1].startswith("retry: 1 of 2 selected rows would be retried")
    out, _ = run("--category", "outbox", "retry", scheduled)
    assert out.splitlines()[-1] == "retry: 1 of 1 selected row retried."
    assert state_of(rows["scheduled"]) == "pending"


@pytest.mark.django_db(transaction=True, databases=["default", "second"])
def test_database_acts_on_another_database_alias():
    there = models.Outbox.objects.using("second").create(
        work_id=uuid.uuid4(),
        topic="shard.only",
        payload={},
        created_at=T0,
        scheduled_for=timezone.now() + HOUR,
    )
    here = factories.OutboxFactory(scheduled_for=timezone.now() + HOUR)

    out, _ = run("retry", "--state", "scheduled", "--database", "second")

    assert out.splitlines() == [
        f"retried: outbox {there.work_id} shard.only (was scheduled)",
        "retry: 1 of 1 selected row retried.",
    ]
    assert models.Outbox.objects.using("second").get(pk=there.pk).scheduled_for is None
    assert models.Outbox.objects.get(pk=here.pk).scheduled_for is not None  # default: untouched


@pytest.mark.parametrize("action", ["retry", "requeue", "dead-letter", "release", "cancel"])
def test_the_hint_for_naming_no_rows_selects_rows_the_action_changes(action):
    from django_workpump.management.commands.workpump_action import EXAMPLE_STATE

    now = timezone.now()
    gone = uuid.uuid4()
    factories.OutboxFactory(scheduled_for=now + HOUR)  # scheduled
    factories.OutboxFactory(dead_lettered_at=T0, failure_reason="max_attempts")  # dead
    factories.OutboxFactory()  # pending
    factories.OutboxFactory(instance_id=gone, lease_expiry=now - HOUR, claimed_at=T0)  # orphaned
    with pytest.raises(CommandError) as raised:
        run(action)
    hint = f"--state {EXAMPLE_STATE[action]} --category outbox"
    assert f"(e.g. {hint})." in str(raised.value)

    out, _ = run(action, *hint.split(), "--dry-run")

    assert f"{action}: 1 of 1 selected row would be " in out


# --- validation: one line each -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["release", "--older-than", "nan"], "--older-than must be a number of seconds from 0 to "),
        (["release", "--older-than", "inf"], r"3153600000 \(100 years\), not 'inf'\.$"),
        (["release", "--older-than", "1e308"], r"not '1e308'\.$"),
        (["release", "--older-than", "soon"], r"not 'soon'\.$"),
        (["dead-letter", "--state", "pending", "--reason", "caf\udce9"], "is not UTF-8 text"),
        (["dead-letter", "--state", "pending", "--reason", "a\x00b"], "holds a control character"),
        (["dead-letter", "--state", "pending", "--reason", "  "], "--reason is empty"),
        (["dead-letter", "--state", "pending", "--reason", "x" * 41], "41 characters long, over"),
        (["evict", str(uuid.UUID(int=1)), "--reason", "x" * 201], "over the 200 evict stores"),
        (["cancel", "--topic", "bad\udcfftopic"], r"--topic 'bad\\udcfftopic' is not UTF-8"),
        (["cancel", "--topic", "a\nb"], "--topic 'a\\\\nb' holds a control character"),
        (["cancel", "--state", "pending", "--limit", "0"], "--limit must be a whole number"),
        (["cancel", "--state", "pending", "--limit", "many"], r"at least 1, not 'many'"),
        (["cancel", "--state", "pending", "--limit", "5", "--all"], "contradict each other"),
        (["evict", str(uuid.UUID(int=1)), "--all"], "--limit and --all cap a selection"),
        (["cancel", "--state", "pending", "--database", "shard9"], "--database 'shard9' is not"),
        (["evict", "nope"], "'nope' is not a valid instance id"),
    ],
)
def test_bad_input_is_refused_in_one_line(args, message):
    with pytest.raises(CommandError) as raised:
        run(*args)
    text = str(raised.value)
    assert "\n" not in text
    assert text.endswith(".")
    assert __import__("re").search(message, text), text


# --- the force rule ----------------------------------------------------------------------------


@pytest.fixture
def busy() -> dict[str, Any]:
    """A live instance running one row (its lease not expired)."""
    now = timezone.now()
    holder = factories.ServiceInstanceFactory(last_heartbeat_at=now)
    row = factories.OutboxFactory(
        instance_id=holder.instance_id, lease_expiry=now + HOUR, claimed_at=now
    )
    return {"holder": holder, "row": row}


def test_evict_of_a_busy_holder_without_force_changes_nothing(busy):
    holder = busy["holder"].instance_id
    with pytest.raises(CommandError) as raised:
        run("evict", str(holder), "--yes")
    assert str(raised.value).startswith(
        f"Nothing was evicted: {holder} is live and runs 1 row (outbox "
        f"{key(busy['row'])} emails.welcome). Evicted, its rows would run again on a peer"
    )
    assert "pass --force to evict it anyway" in str(raised.value)
    assert models.ServiceInstance.objects.filter(instance_id=holder).exists()
    assert not models.Eviction.objects.exists()
    assert models.Outbox.objects.get(pk=busy["row"].pk).instance_id == holder
    assert state_of(busy["row"]) == "leased"


def test_evict_of_a_stale_holder_still_running_rows_needs_force_too(busy):
    models.ServiceInstance.objects.filter(pk=busy["holder"].pk).update(last_heartbeat_at=T0)
    with pytest.raises(CommandError, match=r"is not live and runs 1 row"):
        run("evict", str(busy["holder"].instance_id))
    assert not models.Eviction.objects.exists()


def test_evict_with_force_asks_first_naming_what_runs(busy):
    holder = busy["holder"].instance_id
    with pytest.raises(CommandError, match="there is no terminal to ask for confirmation"):
        run("evict", str(holder), "--force")  # even one instance is confirmed
    with pytest.raises(CommandError, match=r"Cancelled: nothing was changed\."):
        run("evict", str(holder), "--force", stdin=Terminal("n\n"))
    assert not models.Eviction.objects.exists()

    out, _ = run("evict", str(holder), "--force", stdin=Terminal("y\n"))

    assert out.startswith(
        f"evict 1 instance; {holder} is live and runs 1 row (outbox {key(busy['row'])} "
        "emails.welcome); --force evicts it anyway"
    )
    assert out.splitlines()[-1].endswith(f"evicted {holder}: 1 row released.")
    assert models.Eviction.objects.filter(instance_id=holder).exists()
    assert state_of(busy["row"]) == "orphaned"


def test_evict_of_an_idle_stale_instance_needs_no_force():
    idle = factories.ServiceInstanceFactory(last_heartbeat_at=T0)
    out, _ = run("evict", str(idle.instance_id))
    assert out.strip() == f"evicted {idle.instance_id}: 0 rows released."
    assert models.Eviction.objects.filter(instance_id=idle.instance_id).exists()


def test_evict_reports_unknown_and_already_evicted_instances_and_tombstones_neither():
    unknown = uuid.uuid4()
    with pytest.raises(CommandError) as raised:
        _run_capturing_err("evict", str(unknown))
    assert str(raised.value) == "Nothing was evicted: 1 instance id unknown (see above)."
    assert not models.Eviction.objects.exists()  # no tombstone for an id nothing has

    gone = factories.ServiceInstanceFactory(last_heartbeat_at=T0)
    run("evict", str(gone.instance_id))
    out, err = io.StringIO(), io.StringIO()
    with pytest.raises(CommandError, match="Nothing was evicted: 1 instance id unknown"):
        call_command("workpump_action", "evict", str(gone.instance_id), str(unknown), "--reason",
                     "again", stdout=out, stderr=err)  # fmt: skip
    out, err = out.getvalue(), err.getvalue()
    assert out.strip().startswith(f"{gone.instance_id}: already evicted at ")
    assert out.strip().endswith("(evicted with manage.py workpump_action); nothing to do.")
    assert err.strip() == (
        f"{unknown}: no instance is registered, tombstoned or holds a lease under this id; "
        "nothing done. Check the id with manage.py workpump_status."
    )
    assert models.Eviction.objects.count() == 1


def _run_capturing_err(*args: str) -> None:
    call_command("workpump_action", *args, stdout=io.StringIO(), stderr=io.StringIO())


def test_evict_of_an_unregistered_id_holding_a_lease_releases_it():
    # No registration row, but a lease names it: known by its lease, and evicted.
    ghost = uuid.uuid4()
    row = factories.OutboxFactory(instance_id=ghost, lease_expiry=timezone.now() - HOUR)
    out, _ = run("evict", str(ghost))
    assert out.strip() == f"evicted {ghost}: 1 row released."
    assert models.Outbox.objects.get(pk=row.pk).instance_id is None


def test_dead_letter_leaves_leased_rows_alone_without_force(busy, rows):
    held, pending = str(key(busy["row"])), str(key(rows["pending"]))

    out, _ = run("dead-letter", held, pending)

    assert out.splitlines() == [
        f"dead-lettered: outbox {pending} emails.welcome (was pending)",
        "dead-letter: 1 of 2 selected rows dead-lettered; 1 leased by a running instance left "
        "as they were (--force dead-letters them too).",
    ]
    assert state_of(busy["row"]) == "leased"
    with pytest.raises(CommandError, match="1 row of them leased, which a live instance may"):
        run("dead-letter", held, "--force")  # asked first, and no terminal to ask
    out, _ = run("dead-letter", held, "--force", "--yes")
    assert out.splitlines()[-1] == "dead-letter: 1 of 1 selected row dead-lettered."
    assert state_of(busy["row"]) == "dead"


# --- the selection is checked again where it is acted on ----------------------------------------


class LeasingTerminal(Terminal):
    """A terminal whose operator answers yes, while a pump leases the rows meanwhile."""

    def __init__(self, rows: list[models.Outbox], holder: models.ServiceInstance) -> None:
        super().__init__("y\n")
        self.rows, self.holder = rows, holder

    def readline(self, *args: Any) -> str:
        now = timezone.now()
        models.Outbox.objects.filter(pk__in=[r.pk for r in self.rows]).update(
            instance_id=self.holder.instance_id, lease_expiry=now + HOUR, claimed_at=now
        )
        return super().readline(*args)


def test_rows_leased_while_the_prompt_waits_are_not_dead_lettered():
    pending = factories.OutboxFactory.create_batch(CONFIRM_OVER + 1, topic="bulk")
    holder = factories.ServiceInstanceFactory(last_heartbeat_at=timezone.now())

    out, _ = run(
        "dead-letter",
        "--topic",
        "bulk",
        "--state",
        "pending",
        stdin=LeasingTerminal(pending, holder),
    )

    assert out.splitlines()[-1] == (
        f"dead-letter {CONFIRM_OVER + 1} rows? [y/N] "
        f"dead-letter: 0 of {CONFIRM_OVER + 1} selected rows dead-lettered; "
        f"{CONFIRM_OVER + 1} no longer matched the selection when it was acted on (changed "
        "since it was listed) and were left as they were."
    )
    assert {state_of(row) for row in pending} == {"leased"}


def test_rows_leased_while_the_prompt_waits_count_as_held_when_chosen_by_id():
    pending = factories.OutboxFactory.create_batch(CONFIRM_OVER + 1, topic="bulk")
    holder = factories.ServiceInstanceFactory(last_heartbeat_at=timezone.now())

    out, _ = run(
        "dead-letter", *[str(key(r)) for r in pending], stdin=LeasingTerminal(pending, holder)
    )

    assert out.splitlines()[-1].endswith(
        f"dead-letter: 0 of {CONFIRM_OVER + 1} selected rows dead-lettered; "
        f"{CONFIRM_OVER + 1} leased by a running instance left as they were (--force "
        "dead-letters them too)."
    )
    assert {state_of(row) for row in pending} == {"leased"}


# --- the cap on a selection ----------------------------------------------------------------


def test_a_selection_is_capped_unless_limit_or_all_says_otherwise(monkeypatch):
    from django_workpump.management.commands import workpump_action

    assert workpump_action.SELECTION_CAP == 1_000
    monkeypatch.setattr(workpump_action, "SELECTION_CAP", 3)
    factories.OutboxFactory.create_batch(5, topic="bulk", scheduled_for=timezone.now() + HOUR)

    out, _ = run("retry", "--topic", "bulk")

    assert out.splitlines()[0] == (
        "More than 3 rows match: this acts on the oldest 3 only. Pass --limit N to act on up "
        "to N rows, or --all for every matching row."
    )
    assert out.splitlines()[-1] == "retry: 3 of 3 selected rows retried."
    out, _ = run("retry", "--topic", "bulk", "--state", "scheduled", "--limit", "1", "--dry-run")
    assert out.splitlines()[-1].startswith("retry: 1 of 1 selected row would be retried")
    out, _ = run("retry", "--topic", "bulk", "--all")
    assert "More than" not in out
    assert (
        out.splitlines()[-1] == "retry: 2 of 5 selected rows retried; 3 left as they were "
        "(only scheduled rows (waiting for a retry or a deferral) can be retried now)."
    )
