"""Run a handler's coroutine from its synchronous thread, Django's thread-sensitive code on it.

Django's async ORM (``acreate``, ``aget``, ...) and ``sync_to_async`` (thread-sensitive
by default) run their synchronous part on the thread that called ``async_to_sync`` when
there is one; otherwise on one process-wide thread, on that thread's own connection.
An ``atomic=True`` handler's transaction, and a test's, are on the handler thread's
connection: so a coroutine runs through ``async_to_sync`` called from the handler
thread, which serves those calls while it waits, and they land in that transaction.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import threading
from collections.abc import Callable
from typing import Any

from asgiref.sync import SyncToAsync, async_to_sync

# Told the loop and the task a coroutine runs as, once it exists (so it can be cancelled).
OnTask = Callable[[asyncio.AbstractEventLoop, "asyncio.Task[Any]"], Any]


def run(awaitable: Any, on_task: OnTask | None = None) -> Any:
    """Run ``awaitable`` to its end from this synchronous thread and return its result.

    asgiref's own way: the event loop runs in a new thread; thread-sensitive
    ``sync_to_async`` calls come back to this one.
    """
    return async_to_sync(_in_task)(awaitable, on_task)


class HandlerLoop:
    """One handler thread's event loop, kept across calls on a daemon thread of its own.

    Each call goes through ``async_to_sync`` from the handler thread (pointed at this
    loop), so thread-sensitive code comes back to the handler thread and its connection.
    Kept rather than made per call (asgiref's default makes a loop and a thread each
    time), and a daemon thread: a coroutine that never ends cannot hold up the exit.
    """

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        running = threading.Event()
        self.loop.call_soon(running.set)
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()
        # Older asgiref uses a loop named by the thread-local only once it is running.
        running.wait()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self.loop.is_closed()

    def run(self, awaitable: Any, on_task: OnTask | None = None) -> Any:
        """Run ``awaitable`` on this loop from the calling (handler) thread; its result."""
        local = SyncToAsync.threadlocal
        # asgiref's async_to_sync runs on the loop this thread-local names (the loop of a
        # sync_to_async call it is inside of) instead of a new one.
        saved = (
            getattr(local, "main_event_loop", None),
            getattr(local, "main_event_loop_pid", None),
        )
        local.main_event_loop, local.main_event_loop_pid = self.loop, os.getpid()
        try:
            return async_to_sync(_in_task)(awaitable, on_task)
        finally:
            local.main_event_loop, local.main_event_loop_pid = saved

    def close(self) -> None:
        """Stop the loop; its thread cancels what is left on it and ends."""
        with contextlib.suppress(RuntimeError):  # closed already
            self.loop.call_soon_threadsafe(self.loop.stop)

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
            left = asyncio.all_tasks(self.loop)
            for task in left:
                task.cancel()
            if left:
                self.loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.run_until_complete(self.loop.shutdown_default_executor())
        finally:
            self.loop.close()


async def _in_task(awaitable: Any, on_task: OnTask | None) -> Any:
    # A task of its own, in a copy of the context: what the coroutine sets in its context
    # stays there (async_to_sync brings this coroutine's changes back to the caller).
    task = asyncio.ensure_future(_boxed(awaitable))
    if on_task is not None:
        on_task(asyncio.get_running_loop(), task)
    try:
        ok, value = await task  # the task cancelled: CancelledError, for the caller
    finally:
        if inspect.iscoroutine(awaitable) and (
            inspect.getcoroutinestate(awaitable) == inspect.CORO_CREATED
        ):
            awaitable.close()  # cancelled before it started: not "never awaited"
    if not ok:
        raise value
    return value


async def _boxed(awaitable: Any) -> tuple[bool, Any]:
    """``(True, result)`` or ``(False, exception)``: a SystemExit or KeyboardInterrupt
    escaping a task would stop the loop itself, not fail the call."""
    try:
        return True, await awaitable
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # noqa: BLE001 (raised again in the caller's thread)
        return False, exc
