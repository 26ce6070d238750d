"""Handler middleware: callables that wrap every handler call (``WORKPUMP["MIDDLEWARE"]``).

A middleware is ``def middleware(work, call_next)`` and returns what ``call_next(work)``
returned (or anything it likes); the first in the list is the outermost. An
``async def`` middleware awaits ``call_next(work)``, for sync and async handlers alike:
a sync handler (or plain ``def`` middleware) inside it runs through
``sync_to_async(thread_sensitive=True)``, so on the handler thread, on its connection and
in an atomic handler's transaction, where the ORM may be used. A plain ``def`` middleware
around an async handler gets the handler's coroutine from ``call_next`` and should return
it (so it cannot act after the handler: make it async for that). An exception raised by a
middleware fails the attempt like the handler's own. See docs/middleware.md.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

from asgiref.sync import iscoroutinefunction, sync_to_async
from django.utils.module_loading import import_string

Call = Callable[[Any], Any]
Middleware = Callable[[Any, Call], Any]


def load(paths: Iterable[str]) -> tuple[Middleware, ...]:
    """Import the middleware named by dotted ``paths`` (checked by workpump.E014)."""
    return tuple(import_string(path) for path in paths)


def wrap(func: Call, middleware: Iterable[Middleware]) -> Call:
    """``func`` wrapped by ``middleware``, the first outermost; ``func`` alone for none."""
    call = func
    for layer in reversed(tuple(middleware)):
        call = _link(layer, call)
    return call


def _link(layer: Middleware, inner: Call) -> Call:
    if is_async(layer):
        if is_async(inner):
            call_inner: Callable[[Any], Any] = inner
        else:
            # Inside the event loop Django refuses the ORM (SynchronousOnlyOperation):
            # the sync part runs back on the handler thread, which waits on the loop.
            call_inner = sync_to_async(inner, thread_sensitive=True)

        async def async_step(work: Any) -> Any:
            async def call_next(work: Any) -> Any:
                result = call_inner(work)
                if inspect.isawaitable(result):
                    result = await result
                # A plain def middleware hands on an async handler's coroutine.
                return await result if inspect.isawaitable(result) else result

            return await layer(work, call_next)

        return async_step

    def step(work: Any) -> Any:
        return layer(work, inner)

    return step


def is_async(func: Any) -> bool:
    """Whether calling ``func`` gives a coroutine: an ``async def`` function, or an object
    whose ``__call__`` is one."""
    return iscoroutinefunction(func) or iscoroutinefunction(type(func).__call__)
