"""django_workpump.testing: run_pending inside TestCase, captured(), the pytest fixture."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator

import pytest
from django.test import TestCase

import django_workpump as workpump
from django_workpump import models
from django_workpump.registry import registry
from django_workpump.testing import RunReport, captured, run_pending

CALLS: list[tuple[str, object]] = []


@pytest.fixture(autouse=True)
def handlers() -> Iterator[None]:
    """Handlers of this module's topics, registered for each test and removed after."""
    CALLS.clear()

    @workpump.outbox_handler("tt.record")
    def record(work):
        CALLS.append(("record", work.payload["n"]))
        if work.payload.get("then_send"):
            workpump.send("tt.record", {"n": work.payload["then_send"]})
        return {"seen": work.payload["n"]}

    @workpump.outbox_handler("tt.fail")
    def fail(work):
        models.Outbox.objects.filter(topic="tt.record").delete()  # rolled back
        raise ValueError(f"cannot handle {work.payload['n']}")

    @workpump.outbox_handler("tt.exit")
    def exit_(work):
        CALLS.append(("exit", work.payload["n"]))
        raise SystemExit(f"exit {work.payload['n']}")

    @workpump.outbox_handler("tt.later")
    def later(work):
        raise workpump.Snooze(3600)

    @workpump.outbox_handler("tt.skip")
    def skip(work):
        raise workpump.Discard("not for tests")

    @workpump.outbox_handler("tt.async")
    async def in_a_loop(work):
        CALLS.append(("async", work.payload["n"]))

    @workpump.perspective("tt.totals", events=["tt.placed"])
    def totals(work):
        CALLS.append(("perspective", work.payload["order"]))

    @workpump.receptor("tt.warehouse", events=["tt.placed"])
    def warehouse(work):
        CALLS.append(("receptor", work.payload["order"]))

    yield
    for category, topic in [
        ("outbox", "tt.record"),
        ("outbox", "tt.fail"),
        ("outbox", "tt.exit"),
        ("outbox", "tt.async"),
        ("outbox", "tt.later"),
        ("outbox", "tt.skip"),
        ("perspective_event", "tt.totals"),
        ("receptor", "tt.warehouse"),
    ]:
        registry.unregister(category, topic)


class RunPendingInATestCase(TestCase):
    """The test's transaction never commits: runworkpump could not see these rows."""

    def test_it_runs_sent_work_in_stream_order_and_follows_events(self):
        for n in range(5):
            workpump.send("tt.record", {"n": n}, stream="s-1")
        workpump.send("tt.async", {"n": 9})
        workpump.emit("tt.placed", {"order": 42}, stream="order-42")

        ran = run_pending()

        assert ran == 8
        assert [value for kind, value in CALLS if kind == "record"] == [0, 1, 2, 3, 4]
        assert ("async", 9) in CALLS
        assert ("perspective", 42) in CALLS and ("receptor", 42) in CALLS
        assert not models.Outbox.objects.filter(done_at__isnull=True).exists()
        assert models.Outbox.objects.get(payload__n=3).result == {"seen": 3}

    def test_it_runs_nothing_twice_and_follows_work_the_handlers_produce(self):
        workpump.send("tt.record", {"n": 1, "then_send": 2})
        assert run_pending() == 2  # the second row was sent by the first handler
        assert run_pending() == 0
        assert CALLS == [("record", 1), ("record", 2)]

    def test_a_handlers_exception_is_raised_after_its_attempt_is_failed(self):
        workpump.send("tt.record", {"n": 1})
        workpump.send("tt.fail", {"n": 7})

        with pytest.raises(ValueError, match="cannot handle 7"):
            run_pending()

        failed = models.Outbox.objects.get(topic="tt.fail")
        assert failed.attempts == 1 and failed.instance_id is None
        assert failed.last_error.startswith("ValueError: cannot handle 7")
        # the failing handler's own writes were rolled back; the test's transaction lives
        assert models.Outbox.objects.filter(topic="tt.record").exists()

    def test_failures_can_be_recorded_instead_as_production_would(self):
        workpump.send("tt.fail", {"n": 7})
        workpump.send("tt.record", {"n": 1})
        report = RunReport()

        ran = run_pending(raise_errors=False, report=report)

        assert ran == 1
        [failure] = report.failures
        assert (failure.topic, str(failure.error)) == ("tt.fail", "cannot handle 7")

    def test_without_a_savepoint_a_failing_handlers_writes_stay_as_under_the_pump(self):
        workpump.send("tt.record", {"n": 1})  # the failing handler deletes it
        workpump.send("tt.fail", {"n": 7})
        report = RunReport()

        ran = run_pending(topics=["tt.fail"], raise_errors=False, report=report, savepoint=False)

        assert ran == 0 and len(report.failures) == 1
        assert not models.Outbox.objects.filter(topic="tt.record").exists()
        assert models.Outbox.objects.get(topic="tt.fail").attempts == 1

    def test_a_base_exception_fails_its_attempt_like_any_other(self):
        workpump.send("tt.exit", {"n": 3}, max_attempts=1)
        report = RunReport()

        assert run_pending(raise_errors=False, report=report) == 0

        [failure] = report.failures
        assert isinstance(failure.error, SystemExit)
        dead = models.Outbox.objects.get(topic="tt.exit")
        assert dead.dead_lettered_at is not None
        assert dead.last_error.startswith("SystemExit: exit 3")
        with pytest.raises(SystemExit):  # raised, as any error, with raise_errors
            workpump.send("tt.exit", {"n": 4})
            run_pending()

    def test_snooze_and_discard_end_as_the_pump_ends_them(self):
        later = workpump.send("tt.later", {})
        skipped = workpump.send("tt.skip", {})
        report = RunReport()

        assert run_pending(report=report) == 0

        assert (report.snoozed, report.discarded, report.failures) == ([later], [skipped], [])
        snoozed = models.Outbox.objects.get(work_id=later)
        assert (snoozed.attempts, snoozed.snoozes, snoozed.done_at) == (0, 1, None)
        assert models.Outbox.objects.get(work_id=skipped).end_state == "discarded"

    def test_topics_narrow_what_runs(self):
        workpump.send("tt.record", {"n": 1})
        workpump.send("tt.async", {"n": 2})
        assert run_pending(topics=["tt.async"]) == 1
        assert CALLS == [("async", 2)]


@pytest.mark.django_db
def test_captured_records_what_was_produced_and_asserts_on_it():
    message_id = uuid.uuid4()
    with captured() as produced:
        workpump.send("tt.record", {"n": 1, "user": 7}, stream=7)
        workpump.receive(message_id, "tt.inbox", {"body": "x"})
        workpump.emit("tt.placed", {"order": 42})

    sent = produced.assert_sent("tt.record", user=7)
    assert (sent.stream, sent.payload["n"]) == ("7", 1)
    assert produced.assert_received("tt.inbox").id == message_id
    assert produced.assert_emitted("tt.placed", order=42).kind == "emit"
    with pytest.raises(AssertionError, match=r"Nothing was sent to 'tt.record' with payload"):
        produced.assert_sent("tt.record", user=8)
    with pytest.raises(AssertionError, match="Expected nothing sent"):
        produced.assert_nothing_sent()
    workpump.send("tt.record", {"n": 2})  # after the block: not captured
    assert len(produced.sent) == 1


@pytest.mark.django_db
def test_the_pytest_plugins_fixture_runs_and_captures(request):
    fixture = request.getfixturevalue("workpump")  # the plugin's, through its entry point
    workpump.send("tt.record", {"n": 3})
    fixture.assert_sent("tt.record", n=3)
    assert fixture.run_pending() == 1
    assert CALLS == [("record", 3)]


BATCH_CALLS: list[list[int]] = []


@pytest.fixture
def batch_receptor() -> Iterator[None]:
    """A batch receptor that acts on row 2 of its first call as ``ACTION`` says."""
    BATCH_CALLS.clear()

    @workpump.receptor("tt.batch", events=["tt.batched"], batch=True)
    def batch(works):
        BATCH_CALLS.append([work.payload["n"] for work in works])
        if len(BATCH_CALLS) == 1 and ACTION:
            kind, at = ACTION[0], works[2]
            if kind == "snooze":
                raise workpump.Snooze(0, work=at)
            if kind == "discard":
                raise workpump.Discard("row 2 is poison", work=at)
            raise workpump.Snooze(0, work=dataclasses.replace(at, id=uuid.uuid4()))

    yield
    registry.unregister("receptor", "tt.batch")


ACTION: list[str] = []


def _receptor_rows() -> dict[int, models.ReceptorProcessing]:
    return {
        row.event.payload["n"]: row
        for row in models.ReceptorProcessing.objects.select_related("event").filter(
            topic="tt.batch"
        )
    }


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("action", "savepoint", "calls"),
    [
        # in the savepoint row 0-1's writes rolled back: they run again with row 2
        ("snooze", True, [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4]]),
        ("discard", True, [[0, 1, 2, 3, 4], [0, 1, 3, 4]]),
        # without it they keep their writes and complete, as under the pump
        ("snooze", False, [[0, 1, 2, 3, 4], [2, 3, 4]]),
        ("discard", False, [[0, 1, 2, 3, 4], [3, 4]]),
    ],
)
def test_run_pending_gives_a_batch_handlers_outcomes_the_pumps_meaning(
    batch_receptor, action, savepoint, calls
):
    ACTION[:] = [action]
    for n in range(5):
        workpump.emit("tt.batched", {"n": n}, stream="s")
    report = RunReport()

    run_pending(report=report, savepoint=savepoint)

    assert calls == BATCH_CALLS
    rows = _receptor_rows()
    if action == "snooze":
        assert report.snoozed == [rows[2].work_id]
        assert rows[2].snoozes == 1
        assert report.ran == 5
    else:
        assert report.discarded == [rows[2].work_id]
        assert rows[2].end_state == "discarded"
        assert report.ran == 4
    assert {n: row.attempts for n, row in rows.items()} == {n: 1 for n in range(5)} | (
        {} if action == "snooze" else {2: 1}
    )


@pytest.mark.django_db
def test_run_pending_fails_a_batch_whose_snooze_names_a_row_not_in_it(batch_receptor):
    ACTION[:] = ["stranger"]
    for n in range(3):
        workpump.emit("tt.batched", {"n": n}, stream="s")
    report = RunReport()

    run_pending(report=report, raise_errors=False)

    [failure] = report.failures
    rows = _receptor_rows()
    assert failure.work_id == rows[0].work_id
    assert "which is not one of the 3 rows of this batch" in str(failure.error)
    assert BATCH_CALLS == [[0, 1, 2]]  # the retry waits for its backoff
    # the first row's attempt is spent, the others were given back
    assert [rows[n].attempts for n in range(3)] == [1, 0, 0]
    assert rows[0].last_error.startswith("ValueError: workpump.Snooze(work=...) named")
