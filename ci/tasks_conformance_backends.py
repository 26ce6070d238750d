"""The backends Django's own ``tests/tasks`` run against, in ``ci/tasks_conformance.py``.

Django's suite tests its two in-process backends: ``DummyBackend`` stores a task and
never runs it, ``ImmediateBackend`` runs it inside ``enqueue``. The work pump stores a
task as a row that a separate ``runworkpump`` process runs, so each stands in for one:

- ``DrainingWorkPumpBackend`` is ``WorkPumpBackend`` that, right after ``enqueue``,
  runs the pending rows of the task's queue in the caller's thread
  (``django_workpump.testing.run_pending``, the pump's own claim and completion SQL,
  without a savepoint so that a failed attempt's records stay, as under
  ``runworkpump``) and returns the result as then stored: the immediate backend's
  contract;
- ``StoredWorkPumpBackend`` is ``WorkPumpBackend`` as it is (stored, not run until a
  worker claims it), with the two test helpers of Django's dummy backend, ``results``
  and ``clear()``, read from and applied to this alias's rows.

Nothing else is changed: validation, storage, results and signals are the backend's.
"""

from __future__ import annotations

from typing import Any

from django_workpump.conf import setting
from django_workpump.tasks import WorkPumpBackend, topic_of
from django_workpump.testing import run_pending


class DrainingWorkPumpBackend(WorkPumpBackend):
    """``WorkPumpBackend`` that runs what it enqueued before ``enqueue`` returns."""

    def enqueue(self, task: Any, args: Any, kwargs: Any) -> Any:
        result = super().enqueue(task, args, kwargs)
        run_pending(
            categories=["inbox"],
            topics=[topic_of(self.alias, task.queue_name)],
            raise_errors=False,
            savepoint=False,  # a failed attempt's records stay, as under runworkpump
        )
        return self.get_result(result.id)


class StoredWorkPumpBackend(WorkPumpBackend):
    """``WorkPumpBackend`` plus the dummy backend's ``results`` and ``clear()``."""

    @property
    def results(self) -> list[Any]:
        """The results of this alias's task rows, oldest first."""
        ids = self._rows().order_by("seq").values_list("work_id", flat=True)
        return [self.get_result(str(work_id)) for work_id in ids]

    def clear(self) -> None:
        """Delete this alias's task rows."""
        self._rows().delete()

    def _rows(self) -> Any:
        from django_workpump.models import Inbox

        return Inbox.objects.using(setting("DATABASE_ALIAS")).filter(
            topic__startswith=topic_of(self.alias, "")
        )
