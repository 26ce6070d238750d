"""Batches and dependencies through the Python API, run by the pump in one process."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from django.db import DataError, transaction
from django.test import override_settings

import django_workpump as workpump
from django_workpump.pump.supervisor import EXIT_OK
from tests.helpers import FAST_PUMP, drain, run_sql

pytestmark = pytest.mark.django_db(transaction=True)

FAST = {**FAST_PUMP, "CONCURRENCY": 4}


class Log:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entries: list[tuple[str, Any]] = []

    def handler(self, label: str, result: Any = None) -> Callable[[Any], Any]:
        def handle(work: Any) -> Any:
            with self.lock:
                self.entries.append((label, work.payload))
            if isinstance(result, Exception):
                raise result
            return result

        return handle

    def labels(self) -> list[str]:
        return [label for label, _ in self.entries]


@override_settings(WORKPUMP=FAST)
def test_a_batch_sent_in_a_block_calls_back_once_with_its_counts(outbox_handler, pump):
    log = Log()
    outbox_handler("wf.member", log.handler("member"))
    outbox_handler("wf.done", log.handler("done"))
    with workpump.batch(on_complete=("wf.done", {"report": 1})) as group:
        for n in range(3):
            workpump.send("wf.member", {"n": n})
        workpump.send_many("wf.member", [{"n": n} for n in range(3, 10)])
    workpump.send("wf.member", {"n": "outside"})  # after the block: no member

    assert drain(pump(drain=True)) == EXIT_OK

    callbacks = [payload for label, payload in log.entries if label == "done"]
    assert callbacks == [
        {
            "report": 1,
            "batch": {
                "id": str(group.id),
                "total": 10,
                "done": 10,
                "dead": 0,
                "discarded": 0,
                "cancelled": 0,
                "succeeded": True,
            },
        }
    ]
    progress = workpump.batch_status(group.id)
    assert progress is not None
    assert (progress.total, progress.done, progress.pending, progress.failed) == (10, 10, 0, 0)
    assert progress.finished and progress.callback_id is not None


@override_settings(WORKPUMP=FAST)
def test_on_failure_runs_when_a_member_is_discarded(outbox_handler, pump):
    log = Log()
    outbox_handler("wf.ok", log.handler("ok"))
    outbox_handler("wf.bad", log.handler("bad", workpump.Discard("no")))
    outbox_handler("wf.complete", log.handler("complete"))
    outbox_handler("wf.failure", log.handler("failure"))
    with workpump.batch(on_complete=("wf.complete", {}), on_failure=("wf.failure", {})) as group:
        workpump.send("wf.ok", {})
        workpump.send("wf.bad", {})

    assert drain(pump(drain=True)) == EXIT_OK

    assert "complete" not in log.labels()
    [(_, payload)] = [e for e in log.entries if e[0] == "failure"]
    assert payload["batch"]["discarded"] == 1 and payload["batch"]["done"] == 1
    assert workpump.batch_status(group.id).discarded == 1


@override_settings(WORKPUMP=FAST)
def test_a_member_opens_a_nested_batch_and_the_parent_waits_for_it(outbox_handler, pump):
    log = Log()

    def fan_out(work: Any) -> None:
        with workpump.batch(on_complete=("wf.child_done", {}), parent=work):
            for n in range(3):
                workpump.send("wf.leaf", {"n": n})

    outbox_handler("wf.fan_out", fan_out, atomic=True)
    outbox_handler("wf.leaf", log.handler("leaf"))
    outbox_handler("wf.child_done", log.handler("child_done"))
    outbox_handler("wf.parent_done", log.handler("parent_done"))
    with workpump.batch(on_complete=("wf.parent_done", {})) as parent:
        workpump.send("wf.fan_out", {})

    assert drain(pump(drain=True)) == EXIT_OK

    labels = log.labels()
    assert labels.count("leaf") == 3
    assert labels.index("child_done") < labels.index("parent_done")
    assert labels.count("parent_done") == 1
    assert workpump.batch_status(parent.id).total == 2  # fan_out and the child batch


@override_settings(WORKPUMP=FAST)
def test_a_chain_runs_in_order_and_a_failed_link_cancels_the_rest(outbox_handler, pump):
    log = Log()
    outbox_handler("wf.step", log.handler("step"))
    outbox_handler("wf.fail", log.handler("fail", workpump.Discard("no")))
    previous = workpump.send("wf.step", {"n": 0})
    for n in range(1, 5):
        previous = workpump.send("wf.step", {"n": n}, after=[previous])
    broken = workpump.send("wf.fail", {}, after=[previous])
    skipped = workpump.send("wf.step", {"n": "never"}, after=[broken])
    anyway = workpump.send("wf.step", {"n": "anyway"}, after=[broken], after_policy="run")

    assert drain(pump(drain=True)) == EXIT_OK

    steps = [payload["n"] for label, payload in log.entries if label == "step"]
    assert steps == [0, 1, 2, 3, 4, "anyway"]
    [row] = run_sql(
        "SELECT end_state, last_error FROM workpump_outbox WHERE work_id = %s", [skipped]
    )
    assert row == {"end_state": "cancelled", "last_error": f"dependency {broken} ended discarded"}
    assert anyway is not None


def test_the_api_refuses_bad_input_clearly():
    with pytest.raises(TypeError, match="list of ids"):
        workpump.send("wf.x", {}, after=uuid.uuid4())
    with pytest.raises(TypeError, match="on_complete must be"), workpump.batch("wf.done"):
        pass
    bad_options = ("wf.done", {}, {"queue": "x"})
    with pytest.raises(TypeError, match="options may be"), workpump.batch(bad_options):
        pass
    with pytest.raises(DataError, match="no outbox row"), transaction.atomic():
        workpump.send("wf.x", {}, after=[uuid.uuid4()])
    assert workpump.batch_status(uuid.uuid4()) is None


def test_an_inner_block_is_a_member_of_the_outer_one():
    with workpump.batch() as outer:
        workpump.send("wf.x", {})
        with workpump.batch(on_complete=("wf.inner", {})) as inner:
            workpump.send("wf.x", {})
            workpump.send("wf.x", {}, batch=outer)  # an explicit batch wins
    assert workpump.batch_status(inner.id).parent_id == outer.id
    assert workpump.batch_status(inner.id).total == 1
    assert workpump.batch_status(outer.id).total == 3
