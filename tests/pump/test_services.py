"""Every pump service has one shape: start(), stop(timeout), join(timeout)."""

from __future__ import annotations

import threading
import uuid

import pytest

from django_workpump.clock import FrozenClock
from django_workpump.pump.claim import ClaimPolicy, ClaimWorker
from django_workpump.pump.dispatch import Dispatcher
from django_workpump.pump.heartbeat import HeartbeatPolicy, HeartbeatWorker
from django_workpump.pump.lease import LeaseRegistry
from django_workpump.pump.maintenance import MaintenanceWorker
from django_workpump.pump.notify import NotifyGate
from django_workpump.pump.periodic import PeriodicWorker
from django_workpump.pump.renewal import LeaseRenewalWorker
from django_workpump.pump.service import LoopService, Service
from django_workpump.pump.supervisor import DrainWatcher
from django_workpump.registry import Registry
from tests.fakes import FakeCoordinator, FakeSink


def build(kind: str) -> Service:
    coordinator = FakeCoordinator()
    clock = FrozenClock()
    if kind == "claim":
        return ClaimWorker(coordinator, FakeSink(), ClaimPolicy(), clock=clock)
    if kind == "heartbeat":
        return HeartbeatWorker(coordinator, HeartbeatPolicy(), clock=clock)
    if kind == "renewal":
        return LeaseRenewalWorker(coordinator, LeaseRegistry(), clock=clock)
    if kind == "maintenance":
        return MaintenanceWorker(
            alias="default",
            interval_seconds=60,
            retention_seconds=60,
            stale_after_seconds=20,
            definitively_dead_after_seconds=60,
        )
    if kind == "periodic":
        return PeriodicWorker(
            alias="default", partition_count=16, max_payload_bytes=1024, default_max_attempts=3
        )
    if kind == "notify":
        return NotifyGate("dbname=unused", uuid.uuid4(), on_signal=lambda _: None, clock=clock)
    if kind == "dispatch":
        return Dispatcher(coordinator, Registry(), LeaseRegistry(), concurrency=1, clock=clock)
    if kind == "drain":
        dispatcher = Dispatcher(coordinator, Registry(), LeaseRegistry(), clock=clock)
        claim = ClaimWorker(coordinator, FakeSink(), ClaimPolicy(), clock=clock)
        return DrainWatcher(
            dispatcher, claim, pump_stopping=threading.Event(), on_drained=lambda: None
        )
    raise AssertionError(kind)


KINDS = ["claim", "heartbeat", "renewal", "maintenance", "periodic", "notify", "dispatch", "drain"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_pump_service_has_the_service_shape(kind):
    service = build(kind)

    assert isinstance(service, Service)
    assert service.name == kind


@pytest.mark.parametrize("kind", KINDS)
def test_stop_before_start_and_twice_is_harmless_and_start_after_it_does_nothing(kind):
    service = build(kind)

    service.stop()
    service.stop(timeout=1)
    service.start()

    assert service.join(0)
    assert not [t for t in threading.enumerate() if t.name == f"workpump-{kind}"]


def test_a_loop_service_runs_on_its_own_named_thread_started_once():
    ran = threading.Event()
    release = threading.Event()
    threads: list[str] = []

    class Loop(LoopService):
        name = "example"

        def run(self) -> None:
            threads.append(threading.current_thread().name)
            ran.set()
            self._stop.wait()
            release.set()

    service = Loop()
    service.start()
    service.start()
    assert ran.wait(5)

    service.stop(timeout=5)

    assert release.is_set()
    assert service.join(0)
    assert threads == ["workpump-example"]


def test_a_dying_loop_service_reports_to_on_died_and_runs_its_exit_hook():
    died: list[tuple[str, str]] = []
    exited = threading.Event()

    class Broken(LoopService):
        name = "broken"

        def run(self) -> None:
            raise RuntimeError("boom")

    service = Broken()
    service.supervise(
        on_thread_exit=exited.set, on_died=lambda s, exc: died.append((s.name, str(exc)))
    )
    service.start()

    assert service.join(5)
    assert exited.is_set()
    assert died == [("broken", "boom")]
