"""Per-attempt logs: the log records a handler emits while one attempt runs, kept with it.

While the dispatcher runs a handler, ``capturing()`` binds an ``AttemptLog`` to the
running context (a context variable: the handler thread, and an async handler's task,
which copies the context, and the ``sync_to_async`` calls it makes back on that thread).
One ``logging`` handler on the root logger, installed once, hands each record that
reaches it to the bound ``AttemptLog``, if any, which keeps the records at
``ATTEMPT_LOG_LEVEL`` and above, cleaned as error texts are (``storable.storable_text``)
and bounded per attempt. The records go to the database with the attempt's outcome, as
one more array parameter of ``complete_work``/``fail_work``/``discard_work``: no round
trip of their own, and fenced as the outcome is.

A record must reach the root logger to be captured: one from a logger with
``propagate=False``, or below the level of the logger that emits it, is not; nor is one
emitted by a thread the handler started itself.
"""

from __future__ import annotations

import json
import logging
import threading
from contextvars import ContextVar, Token
from functools import lru_cache
from types import TracebackType

from django_workpump.conf import log_level, setting
from django_workpump.storable import storable_text

# Per attempt: at most this many records and this many bytes of message text (UTF-8);
# past either, this record and every later one are counted, not kept (the log stays the
# attempt's first records, with no hole), and a closing note says how many.
MAX_RECORDS = 50
MAX_BYTES = 16_384
# One record's message (with its traceback) is cut to this many characters.
MAX_MESSAGE_CHARS = 4_000
MAX_LOGGER_CHARS = 200
# The level of the closing note (below DEBUG: it is the pump's, not the handler's).
NOTE_LEVEL = 0
NOTE_LOGGER = "django_workpump"

_current: ContextVar[AttemptLog | None] = ContextVar("workpump_attempt_log", default=None)
_formatter = logging.Formatter()


def _text(record: logging.LogRecord) -> str:
    try:
        message = record.getMessage()
    except Exception:  # noqa: BLE001 (a bad format string still says something)
        message = str(record.msg)
    if record.exc_info and record.exc_info[0] is not None:
        message = f"{message}\n{_formatter.formatException(record.exc_info)}"
    elif record.exc_text:
        message = f"{message}\n{record.exc_text}"
    if len(message) > MAX_MESSAGE_CHARS:
        cut = len(message) - MAX_MESSAGE_CHARS
        message = f"{message[:MAX_MESSAGE_CHARS]} [workpump: {cut} more characters cut]"
    return storable_text(message)


class AttemptLog:
    """The records one attempt keeps, bounded by ``MAX_RECORDS`` and ``MAX_BYTES``."""

    def __init__(self, level: int) -> None:
        self.level = level
        self.records: list[dict[str, object]] = []
        self.size = 0
        self.dropped = 0
        self._lock = threading.Lock()  # an async handler's tasks may log from two threads

    def add(self, record: logging.LogRecord) -> None:
        if record.levelno < self.level:
            return
        if self.dropped:  # past a bound already: not kept, so not formatted either
            with self._lock:
                self.dropped += 1
            return
        message = _text(record)
        size = len(message.encode("utf-8"))
        with self._lock:
            if self.dropped or len(self.records) >= MAX_RECORDS or self.size + size > MAX_BYTES:
                self.dropped += 1
                return
            self.size += size
            self.records.append(
                {
                    "at": record.created,
                    "level": record.levelno,
                    "logger": storable_text(record.name[:MAX_LOGGER_CHARS]),
                    "message": message,
                }
            )

    def json(self) -> str | None:
        """The records as the JSON array ``p_logs`` takes, or None when none was kept."""
        if not self.records and not self.dropped:
            return None  # most attempts log nothing: no lock, no copy
        with self._lock:
            records = list(self.records)
            dropped = self.dropped
        if dropped:
            records.append(
                {
                    "at": records[-1]["at"] if records else 0,
                    "level": NOTE_LEVEL,
                    "logger": NOTE_LOGGER,
                    "message": (
                        f"{dropped} more record{'s' if dropped != 1 else ''} not kept: an "
                        f"attempt keeps at most {MAX_RECORDS} records and {MAX_BYTES} bytes "
                        "of messages"
                    ),
                }
            )
        return json.dumps(records) if records else None


class _Capture(logging.Handler):
    """Hands each record to the attempt bound to the context it was logged in."""

    def handle(self, record: logging.LogRecord) -> bool:
        log = _current.get()
        if log is not None:
            log.add(record)
        return True

    def emit(self, record: logging.LogRecord) -> None:  # pragma: no cover (handle() above)
        self.handle(record)


_handler = _Capture()
_install_lock = threading.Lock()


def install() -> None:
    """Put the capturing handler on the root logger, once (it does nothing outside an
    attempt: one context variable read per record)."""
    if _handler in logging.root.handlers:
        return
    with _install_lock:
        if _handler not in logging.root.handlers:
            logging.root.addHandler(_handler)


def configured_level() -> int | None:
    """``ATTEMPT_LOG_LEVEL`` as a number; None: attempts keep no records."""
    value = setting("ATTEMPT_LOG_LEVEL")
    try:
        return _level(value)
    except TypeError:  # unhashable: not a level, and log_level says so
        return log_level(value)


@lru_cache(maxsize=8)
def _level(value: str | int | None) -> int | None:
    return log_level(value)  # read once per value: every attempt asks


class capturing:  # a context manager: named as contextlib names its own
    """Bind a new ``AttemptLog`` to this context while the block runs (the setting's
    level unless ``level`` is given); ``as`` gives None when the setting turns capture
    off. A class, not a generator: the dispatcher enters one per attempt."""

    __slots__ = ("_token", "level")

    def __init__(self, level: int | None = None) -> None:
        self.level = level
        self._token: Token[AttemptLog | None] | None = None

    def __enter__(self) -> AttemptLog | None:
        level = configured_level() if self.level is None else self.level
        if level is None:
            return None
        install()
        log = AttemptLog(level)
        self._token = _current.set(log)
        return log

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._token is not None:
            _current.reset(self._token)
            self._token = None


def current_json() -> str | None:
    """The records of the attempt bound to this context so far (an atomic handler's
    completion, written inside the attempt, takes them)."""
    log = _current.get()
    return None if log is None else log.json()
