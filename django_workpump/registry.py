"""Handlers of the four categories, registered by decorators in ``<app>/workpump.py``."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from django.core.exceptions import ImproperlyConfigured

CATEGORIES = ("outbox", "inbox", "perspective_event", "receptor")
TOPIC_NOUNS = {
    "outbox": "outbox destination",
    "inbox": "inbox handler",
    "perspective_event": "perspective",
    "receptor": "receptor",
}

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Handler:
    """A registered handler and how its work is produced and run."""

    category: str
    topic: str
    func: Callable[..., Any]
    max_attempts: int | None = None  # None: WORKPUMP["MAX_ATTEMPTS"]
    atomic: bool = False  # run in one transaction with its own fenced completion
    events: tuple[str, ...] = ()  # perspective/receptor subscriptions

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.func)

    @property
    def name(self) -> str:
        return f"{self.func.__module__}.{self.func.__qualname__}"


class Registry:
    """Handlers by (category, topic), and subscribers by event type."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handlers: dict[tuple[str, str], Handler] = {}

    def register(self, handler: Handler) -> None:
        if handler.category not in CATEGORIES:
            raise ImproperlyConfigured(
                f"Unknown workpump category {handler.category!r}; "
                f"valid categories are {', '.join(CATEGORIES)}."
            )
        _check_name(f"{TOPIC_NOUNS[handler.category]} name", handler.topic)
        if handler.max_attempts is not None and (
            not isinstance(handler.max_attempts, int) or handler.max_attempts < 1
        ):
            raise ImproperlyConfigured(
                f"max_attempts of {TOPIC_NOUNS[handler.category]} {handler.topic!r} must be "
                f"a whole number >= 1, not {handler.max_attempts!r}."
            )
        if handler.category in ("perspective_event", "receptor"):
            if not handler.events:
                raise ImproperlyConfigured(
                    f"{TOPIC_NOUNS[handler.category].capitalize()} {handler.topic!r} subscribes "
                    "to no events: pass events=['some.event', ...]."
                )
            for event_type in handler.events:
                _check_name("event type", event_type)
        key = (handler.category, handler.topic)
        with self._lock:
            existing = self._handlers.get(key)
            if existing is not None and existing.name != handler.name:
                raise ImproperlyConfigured(
                    f"{TOPIC_NOUNS[handler.category].capitalize()} {handler.topic!r} is "
                    f"registered twice: by {existing.name} and by {handler.name}. "
                    "Give one of them another name."
                )
            self._handlers[key] = handler

    def unregister(self, category: str, topic: str) -> None:
        with self._lock:
            self._handlers.pop((category, topic), None)

    def get(self, category: str, topic: str) -> Handler | None:
        return self._handlers.get((category, topic))

    def handlers(self, category: str | None = None) -> list[Handler]:
        return [h for h in self._handlers.values() if category in (None, h.category)]

    def subscribers(self, event_type: str) -> list[Handler]:
        """Perspectives and receptors subscribed to ``event_type``, in a stable order."""
        found = [h for h in self._handlers.values() if event_type in h.events]
        return sorted(found, key=lambda h: (h.category, h.topic))


def _check_name(what: str, value: object) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ImproperlyConfigured(f"A workpump {what} must be a non-empty string, not {value!r}.")


registry = Registry()


def _decorator(
    category: str,
    topic: str,
    *,
    max_attempts: int | None,
    atomic: bool,
    events: Iterable[str] = (),
) -> Callable[[F], F]:
    if isinstance(events, str):
        raise ImproperlyConfigured(
            f"events of {TOPIC_NOUNS[category]} {topic!r} must be a list of event types, "
            f"not the string {events!r}."
        )

    def decorate(func: F) -> F:
        if not callable(func):
            raise ImproperlyConfigured(f"{func!r} is not callable and cannot handle work.")
        registry.register(Handler(category, topic, func, max_attempts, atomic, tuple(events)))
        return func

    return decorate


def outbox_handler(
    destination: str, *, max_attempts: int | None = None, atomic: bool = False
) -> Callable[[F], F]:
    """Register the handler of outbox messages sent to ``destination``."""
    return _decorator("outbox", destination, max_attempts=max_attempts, atomic=atomic)


def inbox_handler(
    name: str, *, max_attempts: int | None = None, atomic: bool = False
) -> Callable[[F], F]:
    """Register the handler of inbox messages received for ``name``."""
    return _decorator("inbox", name, max_attempts=max_attempts, atomic=atomic)


def perspective(
    name: str, *, events: Iterable[str], max_attempts: int | None = None, atomic: bool = False
) -> Callable[[F], F]:
    """Register a perspective: it sees ``events`` of each stream in strict order."""
    return _decorator(
        "perspective_event", name, max_attempts=max_attempts, atomic=atomic, events=events
    )


def receptor(
    name: str, *, events: Iterable[str], max_attempts: int | None = None, atomic: bool = False
) -> Callable[[F], F]:
    """Register a receptor: it reacts once to each of ``events``."""
    return _decorator("receptor", name, max_attempts=max_attempts, atomic=atomic, events=events)
