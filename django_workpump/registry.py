"""Handlers of the four categories, registered by decorators in ``<app>/workpump.py``."""

from __future__ import annotations

import inspect
import threading
import unicodedata
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from django.core.exceptions import ImproperlyConfigured

from django_workpump import categories
from django_workpump.control import Retry, check_timeout
from django_workpump.flow_limits import FlowLimits, flow_limits

# Callables naming what a row runs when its topic is shared (the tasks backend's queue
# topic runs every task): ``name(row)`` returns e.g. "task 'myapp.tasks.send'" or None.
# Here, beside the handlers, so the code that owns such topics fills it without
# reaching into the engine that reads it (failure log lines).
FAILURE_SUBJECTS: list[Callable[[Any], str | None]] = []

# Derived from django_workpump.categories, where the facts of each category live.
CATEGORIES = categories.NAMES
TOPIC_NOUNS = {category.name: category.topic_noun for category in categories.CATEGORIES}

# Inbox handler names of django.tasks queues: "django.tasks:<backend alias>:<queue>".
TASK_TOPIC_PREFIX = "django.tasks"

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
    # True: the handler of every topic that starts with ``topic`` and has no handler of
    # its own (a django.tasks backend with empty QUEUES runs every queue of its alias)
    prefix: bool = False
    retry: Retry | None = None  # which exceptions retry, and after how long
    timeout: float | None = None  # seconds one attempt may run; None: the lease settings
    # Perspectives and receptors: called once per stream run with list[Work] in order.
    batch: bool = False
    # The topic's declared flow limits (docs/flow-control.md), or None.
    flow: FlowLimits | None = None

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
        self._prefixes: dict[tuple[str, str], Handler] = {}  # prefix handlers, by prefix

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
        where = f"{TOPIC_NOUNS[handler.category]} {handler.topic!r}"
        if handler.retry is not None and not isinstance(handler.retry, Retry):
            raise ImproperlyConfigured(
                f"retry of {where} must be a workpump.Retry(max_attempts=..., backoff=..., "
                f"on=(...)), not {handler.retry!r}."
            )
        check_timeout(handler.timeout, where)
        if handler.category in ("perspective_event", "receptor"):
            if not handler.events:
                raise ImproperlyConfigured(
                    f"{TOPIC_NOUNS[handler.category].capitalize()} {handler.topic!r} subscribes "
                    "to no events: pass events=['some.event', ...]."
                )
            for event_type in handler.events:
                _check_name("event type", event_type)
        key = (handler.category, handler.topic)
        table = self._prefixes if handler.prefix else self._handlers
        with self._lock:
            existing = table.get(key)
            if existing is not None and existing.name != handler.name:
                what = "Prefix" if handler.prefix else TOPIC_NOUNS[handler.category].capitalize()
                raise ImproperlyConfigured(
                    f"{what} {handler.topic!r} is registered twice: by {existing.name} and "
                    f"by {handler.name}. Give one of them another name."
                )
            table[key] = handler

    def unregister(self, category: str, topic: str, *, prefix: bool = False) -> None:
        with self._lock:
            (self._prefixes if prefix else self._handlers).pop((category, topic), None)

    def get(self, category: str, topic: str) -> Handler | None:
        """The handler of ``topic``: its own, else the prefix handler of the longest
        registered prefix ``topic`` starts with."""
        found = self._handlers.get((category, topic))
        if found is not None or not self._prefixes:
            return found
        matching = [
            h for (c, p), h in list(self._prefixes.items()) if c == category and topic.startswith(p)
        ]
        return max(matching, key=lambda h: len(h.topic), default=None)

    def handlers(self, category: str | None = None) -> list[Handler]:
        """The handlers of named topics (prefix handlers: ``prefix_handlers``)."""
        return [h for h in self._handlers.values() if category in (None, h.category)]

    def prefix_handlers(self, category: str | None = None) -> list[Handler]:
        """The handlers of every topic starting with their ``topic``."""
        return [h for h in self._prefixes.values() if category in (None, h.category)]

    def subscribers(self, event_type: str) -> list[Handler]:
        """Perspectives and receptors subscribed to ``event_type``, in a stable order."""
        found = [h for h in self._handlers.values() if event_type in h.events]
        return sorted(found, key=lambda h: (h.category, h.topic))


class TopicSelectionError(ValueError):
    """A topic or queue named to ``runworkpump`` has no handler in this process."""


def task_queue_of(topic: str) -> str | None:
    """The django.tasks queue an inbox handler name stands for, or None for other topics."""
    prefix, _, rest = topic.partition(":")
    if prefix != TASK_TOPIC_PREFIX or ":" not in rest:
        return None
    return rest.partition(":")[2]


def is_task_prefix(prefix: str) -> bool:
    """Whether a prefix handler's prefix stands for every queue of one task backend."""
    return task_queue_of(prefix + "queue") == "queue"


def claim_topics(
    handlers: Registry,
    categories: Iterable[str],
    *,
    topics: Iterable[str] | None = None,
    queues: Iterable[str] | None = None,
) -> dict[str, list[str]]:
    """The topics this process claims, per category: those it has a handler for.

    ``topics`` (handler topics, any category) and ``queues`` (django.tasks queue names)
    narrow the choice: with either given, only what they name is claimed, also a topic
    a prefix handler serves (a queue of a task backend with empty QUEUES). A name with
    no handler raises TopicSelectionError. Without them, the prefix handlers' topics are
    claimed by prefix (``claim_prefixes``).
    """
    categories = list(categories)
    available = {c: sorted(h.topic for h in handlers.handlers(c)) for c in categories}
    if topics is None and queues is None:
        return available
    prefixes = {c: sorted(h.topic for h in handlers.prefix_handlers(c)) for c in categories}
    wanted_topics = set(topics or ())
    wanted_queues = set(queues or ())
    chosen = {
        category: sorted(
            {t for t in names if t in wanted_topics or task_queue_of(t) in wanted_queues}
            | {t for t in wanted_topics if any(t.startswith(p) for p in prefixes[category])}
            | {p + q for p in prefixes[category] if is_task_prefix(p) for q in wanted_queues}
        )
        for category, names in available.items()
    }
    all_prefixes = [p for ps in prefixes.values() for p in ps]
    known_topics = {t for names in available.values() for t in names}
    known_queues = {q for t in known_topics if (q := task_queue_of(t)) is not None}
    where = ", ".join(available)
    missing_topics = sorted(
        t for t in wanted_topics - known_topics if not any(t.startswith(p) for p in all_prefixes)
    )
    if missing_topics:
        plain = sorted(t for t in known_topics if task_queue_of(t) is None)
        raise TopicSelectionError(
            f"No handler for topic {', '.join(map(repr, missing_topics))} in categories "
            f"{where}: this process has handlers for {', '.join(plain) or 'no topic'}. "
            "Check the name, or register its handler in <app>/workpump.py."
        )
    any_queue = any(is_task_prefix(p) for p in all_prefixes)  # empty QUEUES: every name
    missing_queues = [] if any_queue else sorted(wanted_queues - known_queues)
    if missing_queues:
        raise TopicSelectionError(
            f"No task backend runs queue {', '.join(map(repr, missing_queues))}: this "
            f"process has queues {', '.join(sorted(known_queues)) or 'none'}. Check the "
            "name, or add it to the QUEUES of a WorkPumpBackend in TASKS."
        )
    return chosen


def claim_prefixes(
    handlers: Registry,
    categories: Iterable[str],
    *,
    topics: Iterable[str] | None = None,
    queues: Iterable[str] | None = None,
) -> dict[str, list[str]]:
    """The topic prefixes this process claims, per category: those of its prefix handlers
    (e.g. ``django.tasks:<alias>:`` of a task backend with empty QUEUES); none when
    ``topics`` or ``queues`` narrow the claim: ``claim_topics`` then names the topics."""
    if topics is not None or queues is not None:
        return {c: [] for c in categories}
    return {c: sorted(h.topic for h in handlers.prefix_handlers(c)) for c in categories}


def control_character(text: str) -> str | None:
    """Describe the first control or format character of ``text`` (a newline, an ESC
    that starts a terminal escape sequence, a bidirectional override), if any: names
    holding one print as something else in a terminal or a log."""
    for position, char in enumerate(text):
        if unicodedata.category(char) in CONTROL_CATEGORIES:
            return f"a control character (U+{ord(char):04X}) at position {position}"
    return None


# Unicode categories of control (Cc), format (Cf) and line/paragraph separator characters.
CONTROL_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp"})


def _check_name(what: str, value: object) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ImproperlyConfigured(f"A workpump {what} must be a non-empty string, not {value!r}.")
    if problem := control_character(value):
        raise ImproperlyConfigured(
            f"The workpump {what} {value!r} has {problem}; topic names must be printable "
            "text. Remove it from the name."
        )


registry = Registry()


def _decorator(
    category: str,
    topic: str,
    *,
    max_attempts: int | None,
    atomic: bool,
    events: Iterable[str] = (),
    retry: Retry | None = None,
    timeout: float | None = None,
    batch: bool = False,
    concurrency: int | None = None,
    rate: str | float | None = None,
    burst: int | None = None,
    key_concurrency: int | None = None,
) -> Callable[[F], F]:
    where = f"{TOPIC_NOUNS[category]} {topic!r}"
    limits = flow_limits(
        where, concurrency=concurrency, rate=rate, burst=burst, key_concurrency=key_concurrency
    )
    if retry is not None and not isinstance(retry, Retry):
        raise ImproperlyConfigured(
            f"retry of {where} must be a workpump.Retry(max_attempts=..., backoff=..., "
            f"on=(...)), not {retry!r}."
        )
    if retry is not None and retry.max_attempts is not None:
        if max_attempts is not None and max_attempts != retry.max_attempts:
            raise ImproperlyConfigured(
                f"{where} is given max_attempts={max_attempts!r} and "
                f"retry=Retry(max_attempts={retry.max_attempts!r}); give one of them."
            )
        max_attempts = retry.max_attempts
    timeout = check_timeout(timeout, where)
    if isinstance(events, str):
        raise ImproperlyConfigured(
            f"events of {TOPIC_NOUNS[category]} {topic!r} must be a list of event types, "
            f"not the string {events!r}."
        )

    def decorate(func: F) -> F:
        if not callable(func):
            raise ImproperlyConfigured(f"{func!r} is not callable and cannot handle work.")
        registry.register(
            Handler(
                category,
                topic,
                func,
                max_attempts,
                atomic,
                tuple(events),
                retry=retry,
                timeout=timeout,
                batch=bool(batch),
                flow=limits,
            )
        )
        return func

    return decorate


def _options(arguments: dict[str, Any]) -> dict[str, Any]:
    """A public decorator's keyword arguments (its ``locals()`` on entry), for
    ``_decorator``: each decorator spells its options out for its readers, and passes
    them on without naming each one again."""
    return {name: value for name, value in arguments.items() if name not in ("name", "destination")}


def outbox_handler(
    destination: str,
    *,
    max_attempts: int | None = None,
    atomic: bool = False,
    retry: Retry | None = None,
    timeout: float | None = None,
    concurrency: int | None = None,
    rate: str | float | None = None,
    burst: int | None = None,
    key_concurrency: int | None = None,
) -> Callable[[F], F]:
    """Register the handler of outbox messages sent to ``destination``.

    ``retry``: a ``workpump.Retry`` policy; ``timeout``: seconds one attempt may run
    (drives its lease, renewals and cap instead of the LEASE settings). Flow limits
    (docs/flow-control.md), enforced on every instance: ``concurrency`` rows at once,
    ``rate`` (``"100/s"``, ``"6000/m"``) with a ``burst``, ``key_concurrency`` rows at
    once per concurrency key.
    """
    return _decorator("outbox", destination, **_options(locals()))


def inbox_handler(
    name: str,
    *,
    max_attempts: int | None = None,
    atomic: bool = False,
    retry: Retry | None = None,
    timeout: float | None = None,
    concurrency: int | None = None,
    rate: str | float | None = None,
    burst: int | None = None,
    key_concurrency: int | None = None,
) -> Callable[[F], F]:
    """Register the handler of inbox messages received for ``name`` (``retry``,
    ``timeout`` and the flow limits as for ``outbox_handler``)."""
    return _decorator("inbox", name, **_options(locals()))


def perspective(
    name: str,
    *,
    events: Iterable[str],
    max_attempts: int | None = None,
    atomic: bool = False,
    retry: Retry | None = None,
    timeout: float | None = None,
    batch: bool = False,
    concurrency: int | None = None,
    rate: str | float | None = None,
    burst: int | None = None,
    key_concurrency: int | None = None,
) -> Callable[[F], F]:
    """Register a perspective: it sees ``events`` of each stream in strict order
    (``retry`` and ``timeout`` as for ``outbox_handler``).

    With ``batch=True`` it is called once per stream run with the run's ``list[Work]``
    in stream order (with ``atomic=True`` the run's effects and completions commit in one
    transaction); a failure fails the first row and hands the others back unstarted.
    """
    return _decorator("perspective_event", name, **_options(locals()))


def receptor(
    name: str,
    *,
    events: Iterable[str],
    max_attempts: int | None = None,
    atomic: bool = False,
    retry: Retry | None = None,
    timeout: float | None = None,
    batch: bool = False,
    concurrency: int | None = None,
    rate: str | float | None = None,
    burst: int | None = None,
    key_concurrency: int | None = None,
) -> Callable[[F], F]:
    """Register a receptor: it reacts once to each of ``events`` (``retry`` and
    ``timeout`` as for ``outbox_handler``; ``batch``: as ``perspective``)."""
    return _decorator("receptor", name, **_options(locals()))
