"""Flow control through the pump and the Python API (docs/flow-control.md).

Covers: a handler's declared ``concurrency`` held by the running pump (never more rows
running at once) and written to the database at start; a pause persisted across a
restart (a drained pump runs nothing of a paused topic, the next one after ``resume``
runs it all, with no attempt spent in between); ``workpump_action pause/resume``; the
Python API's checks; producers' keys reaching the row.
"""

from __future__ import annotations

import io
import threading
import uuid
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import CommandError, call_command
from django.test import override_settings

import django_workpump as workpump
from django_workpump import flow, models
from django_workpump.producer_validation import InvalidWork
from django_workpump.pump.supervisor import EXIT_OK
from tests.helpers import FAST_PUMP, drain, run_sql

pytestmark = pytest.mark.django_db(transaction=True)

FAST = {**FAST_PUMP, "CONCURRENCY": 8}


@override_settings(WORKPUMP=FAST)
def test_a_declared_concurrency_holds_in_the_running_pump(outbox_handler, pump):
    running = {"now": 0, "most": 0}
    lock = threading.Lock()
    released = threading.Event()

    def handle(work: Any) -> None:
        with lock:
            running["now"] += 1
            running["most"] = max(running["most"], running["now"])
            if running["now"] == 2:
                released.set()
        released.wait(5)  # the first two overlap: the cap is reached, not just obeyed
        with lock:
            running["now"] -= 1

    outbox_handler("flow.partner", handle, concurrency=2, rate="1000/s")
    for n in range(12):
        workpump.send("flow.partner", {"n": n})
    assert drain(pump(drain=True)) == EXIT_OK
    assert running["most"] == 2
    assert models.Outbox.objects.filter(done_at__isnull=False).count() == 12
    rule = models.FlowRule.objects.get(kind="topic", name="flow.partner")
    assert (rule.declared_concurrency, rule.declared_rate) == (2, 1000.0)


@override_settings(WORKPUMP=FAST)
def test_a_pause_survives_a_restart_and_resume_runs_the_rows(outbox_handler, pump):
    seen: list[int] = []
    outbox_handler("flow.paused", lambda work: seen.append(work.payload["n"]))
    for n in range(3):  # one stream: the order they run in is the order they keep
        workpump.send("flow.paused", {"n": n}, stream="paused-stream")
    workpump.pause(topic="flow.paused")
    assert drain(pump(drain=True)) == EXIT_OK  # a pump that starts: nothing to run
    assert seen == []
    assert list(models.Outbox.objects.values_list("attempts", flat=True)) == [0, 0, 0]
    statuses = {r.subject: r for r in flow.rules()}
    assert statuses["outbox flow.paused"].paused
    assert statuses["outbox flow.paused"].waiting == 1  # the head: the others queue behind it

    workpump.resume(topic="flow.paused")
    assert drain(pump(drain=True)) == EXIT_OK  # the next start runs them, in order
    assert seen == [0, 1, 2]


def test_workpump_action_pauses_and_resumes(outbox_handler):
    outbox_handler("flow.cmd", lambda work: None)
    out = io.StringIO()
    call_command("workpump_action", "pause", "--topic", "flow.cmd", stdout=out)
    assert out.getvalue().strip() == "Paused topic 'flow.cmd'."
    assert models.FlowRule.objects.get(name="flow.cmd").paused
    call_command("workpump_action", "pause", "--key", "partner:acme", stdout=out)
    assert models.FlowRule.objects.get(kind="key", name="partner:acme").paused
    call_command("workpump_action", "resume", "--topic", "flow.cmd", stdout=out)
    assert not models.FlowRule.objects.get(name="flow.cmd").paused
    with pytest.raises(CommandError, match="pause takes --topic, --key or --category"):
        call_command("workpump_action", "pause", "--topic", "flow.cmd", "--state", "pending")
    with pytest.raises(CommandError, match=r"pass category=\.\.\. too"):
        call_command("workpump_action", "pause", "--topic", "flow.unknown")
    with pytest.raises(CommandError, match="--key is for pause and resume"):
        call_command("workpump_action", "retry", "--key", "k")


def test_set_limit_and_its_checks():
    workpump.set_limit(topic="flow.api", category="outbox", concurrency=5, rate="50/s")
    workpump.set_limit(key="tenant:big", weight=3)
    rules = {r.subject: r for r in flow.rules()}
    assert (rules["outbox flow.api"].concurrency, rules["outbox flow.api"].rate) == (5, 50.0)
    assert rules["key tenant:big"].weight == 3
    with pytest.raises(ValueError, match=r"rate of topic 'flow\.api' must be like '100/s'"):
        workpump.set_limit(topic="flow.api", category="outbox", rate="fast")
    with pytest.raises(ValueError, match="weight of key 'tenant:big' must be 1 to 1000"):
        workpump.set_limit(key="tenant:big", weight=5000)
    with pytest.raises(ValueError, match="Name a key alone"):
        workpump.pause(key="k", topic="t")
    with pytest.raises(ValueError, match="Pass a limit to set"):
        workpump.set_limit(key="k")


def test_handler_declarations_are_checked():
    with pytest.raises(ImproperlyConfigured, match="rate of outbox destination 'x' must be"):
        workpump.outbox_handler("x", rate="100 per second")
    with pytest.raises(ImproperlyConfigured, match="concurrency of inbox handler 'y'"):
        workpump.inbox_handler("y", concurrency=-1)
    with pytest.raises(ImproperlyConfigured, match="burst of outbox destination 'z' needs"):
        workpump.outbox_handler("z", burst=10)
    assert flow.parse_rate("6000/m", "t") == 100.0


def test_producers_store_the_keys_and_refuse_bad_ones():
    message_id = workpump.send("flow.keys", {}, concurrency_key="partner:acme", fairness_key="t1")
    received = uuid.uuid4()
    workpump.receive(received, "flow.keys", {}, fairness_key="t2")
    ids = workpump.send_many("flow.keys", [{}, {}], concurrency_key="partner:b")
    rows = run_sql(
        "SELECT concurrency_key, fairness_key, flow_controlled FROM workpump_outbox"
        " WHERE work_id = ANY (%s) ORDER BY seq",
        [[message_id, *ids]],
    )
    assert rows == [
        {"concurrency_key": "partner:acme", "fairness_key": "t1", "flow_controlled": True},
        {"concurrency_key": "partner:b", "fairness_key": "", "flow_controlled": True},
        {"concurrency_key": "partner:b", "fairness_key": "", "flow_controlled": True},
    ]
    assert models.Inbox.objects.get(work_id=received).fairness_key == "t2"
    with pytest.raises(InvalidWork, match="The concurrency_key of outbox message to 'x' has"):
        workpump.send("x", {}, concurrency_key="a" * 201)
    with pytest.raises(InvalidWork, match="The fairness_key of outbox message to 'x' must be"):
        workpump.send("x", {}, fairness_key=42)  # type: ignore[arg-type]


def test_rows_of_flow_control_ending_wake_the_claim_as_room_not_as_new_work():
    # with every slot busy, new work makes a fair pump claim the underserved groups' rows;
    # a NOTIFY that flow-controlled rows ended must not: it would find nothing, each time
    from django_workpump.pump.supervisor import PumpOptions, Supervisor

    supervisor = Supervisor(PumpOptions(listen=False))  # not started: its wiring only
    claim = supervisor.claim
    supervisor._signal("outbox:ended")
    assert claim.wake_requests == 1 and not claim._new_work
    supervisor._signal("outbox")
    assert claim.wake_requests == 2 and claim._new_work


def test_workpump_status_and_the_metrics_show_each_rule_as_it_stands():
    # in flight of the cap, tokens left of the rate, heads waiting, and a paused key
    from django_workpump import metrics
    from tests.helpers import enroll

    holder = uuid.uuid4()
    enroll(holder)
    # a token a minute: none comes back while the test runs
    workpump.set_limit(topic="flow.shown", category="outbox", concurrency=2, rate="1/m", burst=5)
    workpump.pause(key="tenant:held")
    for _ in range(5):
        workpump.send("flow.shown", {})
    claimed = run_sql(
        "SELECT work_id FROM workpump.claim_work(%s, 10, p_categories => '{outbox}')", [holder]
    )
    assert len(claimed) == 2  # the cap

    out = io.StringIO()
    call_command("workpump_status", stdout=out)
    text = out.getvalue()
    assert "flow rules: 2" in text
    topic_line = next(line for line in text.splitlines() if "outbox flow.shown" in line)
    # rule, paused, in flight, concurrency, rate, tokens, waiting
    assert topic_line.split() == [
        *["outbox", "flow.shown", "no", "2", "2", "0.0166667/s", "(burst", "5)"],
        *["3", "3"],  # tokens left, heads waiting
    ]
    key_line = next(line for line in text.splitlines() if "key tenant:held" in line)
    assert key_line.split()[2] == "yes"

    families = {f.name: f for f in metrics.DatabaseCollector(cache_seconds=0).collect()}
    values = {
        (s.labels["kind"], s.labels["name"], s.labels["value"]): s.value
        for s in families["workpump_flow"].samples
    }
    assert values[("topic", "flow.shown", "in_flight")] == 2
    assert values[("topic", "flow.shown", "tokens")] == 3
    assert values[("topic", "flow.shown", "waiting")] == 3
    assert values[("topic", "flow.shown", "paused")] == 0
    assert values[("key", "tenant:held", "paused")] == 1
