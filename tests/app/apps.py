import os
import sys
from typing import Any

from django.apps import AppConfig


class TestAppConfig(AppConfig):
    name = "tests.app"
    label = "testapp"

    def ready(self) -> None:
        if os.environ.get("WORKPUMP_TEST_PAUSE_AFTER_REGISTERING"):
            _pause_after_registering()


def _pause_after_registering() -> None:
    """Make runworkpump stop after its first heartbeat until a line arrives on stdin.

    Tests of signals during startup send their signal then, and write the line after.
    """
    from django_workpump.pump.heartbeat import HeartbeatWorker

    beat = HeartbeatWorker.beat
    paused: list[bool] = []

    def beat_then_pause(self: HeartbeatWorker, *args: Any, **kwargs: Any) -> Any:
        result = beat(self, *args, **kwargs)
        if not paused:
            paused.append(True)
            print("paused after registering", flush=True)
            sys.stdin.readline()
        return result

    HeartbeatWorker.beat = beat_then_pause  # type: ignore[method-assign]
