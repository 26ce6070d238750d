"""One shape for every pump service: ``start``, ``stop``, ``join``.

The supervisor starts and stops each service through this interface only. A service
owns its threads: ``start()`` starts them (a second call does nothing), ``stop()`` asks
them to end (harmless before ``start()`` and when repeated; a ``start()`` after it does
nothing), and ``join()`` waits for them. Most services are a ``LoopService``: one
thread, named ``workpump-<name>``, running ``run()`` until stopped; ``run_once()`` does
one pass, for tests and for the loop.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol, runtime_checkable


@runtime_checkable
class Service(Protocol):
    """What the supervisor needs of a pump service."""

    name: str

    def start(self) -> None:
        """Start the service's threads; a second call does nothing."""

    def stop(self, timeout: float | None = None) -> None:
        """Ask the service to stop; with ``timeout``, wait up to that long for its threads.

        Idempotent, and harmless before ``start()``. A service that flushes buffered
        writes on stop waits for that final flush whatever ``timeout`` says (up to
        ``timeout``, or its own bound when None).
        """

    def join(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` (None: without bound) for the service's threads to end.

        Return True when none is running (also when it never started).
        """


class LoopService:
    """A service that runs ``run()`` on one daemon thread of its own until stopped.

    Subclasses set ``name``, implement ``run()`` (looping until ``self._stop`` is set)
    and override ``_interrupt()`` when ``run()`` waits on an event of its own.
    """

    name = "service"

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._on_thread_start: Callable[[], object] | None = None
        self._on_thread_exit: Callable[[], object] | None = None
        self._on_died: Callable[[LoopService, BaseException], object] | None = None

    def supervise(
        self,
        *,
        on_thread_start: Callable[[], object] | None = None,
        on_thread_exit: Callable[[], object] | None = None,
        on_died: Callable[[LoopService, BaseException], object] | None = None,
    ) -> None:
        """Set what the service thread does first and last, and who hears if it dies.

        ``on_died`` is called (in the dying thread, inside the ``except``) with the
        service and the exception ``run()`` (or ``on_thread_start``) raised; without
        it, the exception ends the thread as usual.
        """
        self._on_thread_start = on_thread_start
        self._on_thread_exit = on_thread_exit
        self._on_died = on_died

    @property
    def thread_name(self) -> str:
        return f"workpump-{self.name}"

    def run(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        """Start the service thread (once; not after ``stop()``)."""
        with self._start_lock:
            if self._thread is not None or self._stop.is_set():
                return
            self._thread = threading.Thread(target=self._main, name=self.thread_name, daemon=True)
            self._thread.start()

    def _main(self) -> None:
        try:
            if self._on_thread_start is not None:
                self._on_thread_start()
            self.run()
        except BaseException as exc:
            if self._on_died is None:
                raise
            self._on_died(self, exc)
        finally:
            if self._on_thread_exit is not None:
                self._on_thread_exit()

    def stop(self, timeout: float | None = None) -> None:
        """Ask the loop to end (idempotent, safe before start); wait up to ``timeout``."""
        self._stop.set()
        self._interrupt()
        if timeout is not None:
            self.join(timeout)

    def _interrupt(self) -> None:
        """Wake ``run()`` if it waits on something other than ``self._stop``."""

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the service thread; True when it is not running."""
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return thread is None
        thread.join(timeout)
        return not thread.is_alive()

    @property
    def stopping(self) -> bool:
        """Whether ``stop()`` was called."""
        return self._stop.is_set()
