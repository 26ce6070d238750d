"""The NOTIFY gate: one dedicated psycopg connection per instance.

It LISTENs on the work channels and on ``workpump_cancel`` (``cancel_work`` names there
the instance holding each cancelled attempt; the gate passes this instance's to
``on_cancel``), proves itself with a self-NOTIFY probe, holds the
instance's alive-lock, sends a keepalive, and on any error reports itself unavailable
and reconnects with capped exponential backoff. Availability changes are reported
exactly once per real transition.

Any role that can connect may NOTIFY these channels, so a notification is a hint: a work
channel only wakes the claim (which finds rows or not), and a cancel is passed on only
for the attempts the database shows cancelled. Nothing a notification carries can end
the listen loop: a cancel payload is size- and depth-checked before it is decoded, and
whatever handling one notification raises is counted and logged, at most once a minute
per kind.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, overload

import psycopg
from psycopg import sql

from django_workpump import db
from django_workpump.categories import NAMES as CATEGORY_NAMES
from django_workpump.clock import Clock, SystemClock
from django_workpump.metrics import NullRecorder, recorder
from django_workpump.pump.service import LoopService

logger = logging.getLogger("django_workpump.notify")

# Channel -> signal. Producers' insert triggers and complete/fail/release notify the
# category channels; evictions and deregistrations notify workpump_orphan.
CHANNELS = {
    "workpump_outbox": "outbox",
    "workpump_inbox": "inbox",
    "workpump_perspective_event": "perspective_event",
    "workpump_receptor": "receptor",
    "workpump_orphan": "orphan",
}
# cancel_work's channel: the payload names the holder, the category and the attempts.
CANCEL_CHANNEL = "workpump_cancel"
# A category channel's payload when flow-controlled rows ended (room under a cap), not
# when work was stored: the signal is then "<category>:ended".
ENDED_PAYLOAD = "ended"
# PostgreSQL refuses NOTIFY payloads of 8000 bytes or more.
MAX_PAYLOAD_CHARS = 8000
# {"instance": ..., "category": ..., "work": [[id, token], ...]}: three levels, and
# cancel_work sends at most 100 attempts per notification.
CANCEL_MAX_DEPTH = 3
CANCEL_MAX_ATTEMPTS = 100
_UUID_MAX_CHARS = 45  # the longest spelling uuid.UUID accepts: "urn:uuid:" + 36
# Cancels waiting for their confirming read: more arrived at once are dropped (the
# renewal still reports a cancelled row).
MAX_PENDING_CANCELS = 100
# One log line per kind of rejected notification per this many seconds.
REJECT_LOG_INTERVAL_SECONDS = 60.0


class MalformedNotification(ValueError):
    """A notification payload not in the shape its channel carries; ``kind`` says how."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


@dataclass(frozen=True)
class CancelHint:
    """A parsed ``workpump_cancel`` payload: to be confirmed by the database."""

    instance: uuid.UUID
    category: str
    attempts: tuple[tuple[uuid.UUID, uuid.UUID], ...]  # (work id, lease token)


_NOT_A_BRACKET = re.compile(r"[^\[\]{}]+")


def check_structure(payload: str) -> None:
    """Raise MalformedNotification unless ``payload`` could be a cancel payload's JSON.

    Runs before decoding, in a few passes at C speed: a cancel payload's strings are
    UUIDs, a category and its keys (no escapes), it opens at most one object, one list
    and ``CANCEL_MAX_ATTEMPTS`` pairs, and it nests ``CANCEL_MAX_DEPTH`` deep.
    """
    if len(payload) > MAX_PAYLOAD_CHARS:
        raise MalformedNotification("too_long", f"{len(payload)} characters")
    if "\\" in payload:
        raise MalformedNotification("wrong_shape", "an escape in a string")
    # Without escapes, every other quote closes a string: the rest is the structure.
    parts = payload.split('"')
    if len(parts) % 2 == 0:
        raise MalformedNotification("invalid_json", "an unterminated string")
    structure = "".join(parts[::2])
    opened = structure.count("[") + structure.count("{")
    if opened > 2 + CANCEL_MAX_ATTEMPTS:
        raise MalformedNotification("too_large", f"{opened} arrays and objects")
    brackets = _NOT_A_BRACKET.sub("", structure)
    depth = 0
    for char in brackets:  # at most a few hundred
        depth += 1 if char in "[{" else -1
        if depth > CANCEL_MAX_DEPTH:
            raise MalformedNotification("too_deep", f"nested deeper than {CANCEL_MAX_DEPTH}")


def _uuid(value: Any, what: str) -> uuid.UUID:
    if not isinstance(value, str) or len(value) > _UUID_MAX_CHARS:
        raise MalformedNotification("invalid_uuid", f"{what} is not a UUID string")
    try:
        return uuid.UUID(value)
    except ValueError:
        raise MalformedNotification("invalid_uuid", f"{what} is not a UUID") from None


@overload
def parse_cancel(payload: str) -> CancelHint: ...
@overload
def parse_cancel(payload: str, instance_id: uuid.UUID) -> CancelHint | None: ...
def parse_cancel(payload: str, instance_id: uuid.UUID | None = None) -> CancelHint | None:
    """Parse a ``workpump_cancel`` payload, or raise MalformedNotification.

    With ``instance_id``, a payload that names another instance returns None.

    Size, brackets and nesting are checked before decoding (``check_structure``), so
    no payload costs more than a few passes over its at most 8000 characters.
    """
    check_structure(payload)
    try:
        message = json.loads(payload)
    except (ValueError, RecursionError):
        raise MalformedNotification("invalid_json", "not JSON") from None
    if not isinstance(message, dict):
        raise MalformedNotification("wrong_shape", f"a JSON {type(message).__name__}")
    instance = _uuid(message.get("instance"), "instance")
    if instance_id is not None and instance != instance_id:
        return None  # another instance's attempts: not worth reading further
    category, work = message.get("category"), message.get("work")
    if not isinstance(category, str) or not isinstance(work, list):
        raise MalformedNotification("wrong_shape", "category or work of the wrong type")
    if category not in CATEGORY_NAMES:
        raise MalformedNotification("wrong_shape", "an unknown category")
    if len(work) > CANCEL_MAX_ATTEMPTS:
        raise MalformedNotification("too_many_attempts", f"{len(work)} attempts")
    attempts = []
    for item in work:
        if not isinstance(item, list) or len(item) != 2:
            raise MalformedNotification("wrong_shape", "an attempt that is not [id, token]")
        work_id = _uuid(item[0], "a work id")
        if item[1] is not None:  # no token: the row was not leased, nothing runs
            attempts.append((work_id, _uuid(item[1], "a lease token")))
    return CancelHint(instance, category, tuple(attempts))


def reconnect_delay(attempt: int, initial: float = 1.0, maximum: float = 30.0) -> float:
    """Seconds before reconnect attempt ``attempt`` (1-based): doubling, capped."""
    return float(min(initial * 2 ** max(attempt - 1, 0), maximum))


class _KindLog:
    """Log the first event of each kind, then at most one line per interval with a count."""

    def __init__(self, clock: Clock, interval: float) -> None:
        self.clock = clock
        self.interval = interval
        self._last: dict[str, float] = {}
        self._suppressed: Counter[str] = Counter()

    def log(self, kind: str, message: str, *args: Any, exc_info: bool = False) -> None:
        now = self.clock.monotonic()
        last = self._last.get(kind)
        if last is not None and now - last < self.interval:
            self._suppressed[kind] += 1
            return
        more = self._suppressed.pop(kind, 0)
        self._last[kind] = now
        if last is None:
            suffix = f" (more of this kind are counted, logged once every {self.interval:g} s)"
        else:
            suffix = f" ({more + 1} more of this kind since the last report)"
        logger.warning(
            message + "%s",
            *args,
            suffix,
            exc_info=exc_info and last is None,
            extra={"action": "notification_rejected", "kind": kind},
        )


class NotifyGate(LoopService):
    """LISTEN on the work channels and hold the alive-lock, reconnecting until stopped."""

    name = "notify"

    def __init__(
        self,
        conninfo: str,
        instance_id: uuid.UUID,
        *,
        on_signal: Callable[[str], Any],
        on_availability: Callable[[bool], Any] | None = None,
        on_cancel: Callable[[str, list[tuple[uuid.UUID, uuid.UUID]]], Any] | None = None,
        keepalive_seconds: float = 30.0,
        probe_timeout_seconds: float = 2.0,
        reconnect_initial_seconds: float = 1.0,
        reconnect_max_seconds: float = 30.0,
        hold_alive_lock: bool = True,
        clock: Clock | None = None,
        metrics: NullRecorder | None = None,
    ) -> None:
        super().__init__()
        self.conninfo = conninfo
        self.metrics = recorder() if metrics is None else metrics
        self.instance_id = instance_id
        self.on_signal = on_signal
        self.on_availability = on_availability
        self.on_cancel = on_cancel
        self.cancels_received = 0  # well-formed cancels naming this instance
        self.cancels_confirmed = 0  # ... whose attempts the database showed cancelled
        self.cancels_unconfirmed = 0  # ... naming attempts it did not: spoofed, or stale
        self.rejected: Counter[str] = Counter()  # notifications ignored, by kind
        self.keepalive_seconds = keepalive_seconds
        self.probe_timeout_seconds = probe_timeout_seconds
        self.reconnect_initial_seconds = reconnect_initial_seconds
        self.reconnect_max_seconds = reconnect_max_seconds
        self.hold_alive_lock = hold_alive_lock
        self.clock = clock or SystemClock()
        self.application_name = f"workpump-{instance_id}"
        self.connects = 0
        self.failures = 0
        self.signals_received = 0
        self.last_failure: str | None = None
        self.backend_pid: int | None = None
        self._available = False
        self._alive_lock_held = False
        # Set once the first connection attempt has ended, either way (the startup line
        # reports the listener's real state).
        self._settled = threading.Event()
        self._state_lock = threading.Lock()
        self._conn: psycopg.Connection[Any] | None = None
        # Cancel hints read inside conn.notifies(), which holds the connection: confirmed
        # by a query once the generator has let go of it.
        self._pending: list[CancelHint] = []
        self._kind_log = _KindLog(self.clock, REJECT_LOG_INTERVAL_SECONDS)

    # -- state ---------------------------------------------------------------------
    @property
    def available(self) -> bool:
        return self._available

    @property
    def alive_lock_held(self) -> bool:
        return self._available and self._alive_lock_held

    def wait_settled(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the first connection attempt to end; True if it did."""
        return self._settled.wait(timeout)

    @property
    def settled(self) -> bool:
        return self._settled.is_set()

    def _set_available(self, available: bool, reason: str = "", *, stopping: bool = False) -> None:
        with self._state_lock:
            if available == self._available:
                return
            self._available = available
        self.metrics.gate(available)
        # Routine, not news: a first connection that went through at once (the startup line
        # reports it) and going down on a normal stop.
        routine = stopping or (available and self.connects == 1 and self.failures == 0)
        logger.log(
            logging.DEBUG if routine else logging.INFO,
            "NOTIFY gate %s%s",
            "available" if available else "unavailable",
            f" ({reason})" if reason else "",
            extra={"action": "gate_available" if available else "gate_unavailable"},
        )
        if self.on_availability is not None:
            try:
                self.on_availability(available)
            except Exception:
                logger.exception("gate subscriber failed", extra={"action": "gate_subscriber"})

    # -- connection ----------------------------------------------------------------
    def _connect(self) -> psycopg.Connection[Any]:
        conn = psycopg.connect(
            self.conninfo,
            autocommit=True,
            application_name=self.application_name,
            connect_timeout=5,
        )
        self.connects += 1
        self.backend_pid = conn.info.backend_pid
        for channel in (*CHANNELS, CANCEL_CHANNEL):
            conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        return conn

    def _probe(self, conn: psycopg.Connection[Any]) -> None:
        """Prove that notifications reach this session: NOTIFY ourselves and wait."""
        channel = f"workpump_probe_{secrets.token_hex(6)}"
        conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        db.notify_probe(conn, channel=channel)
        seen = False
        # The socket waits in real time, whatever clock the gate was given.
        deadline = time.monotonic() + self.probe_timeout_seconds
        while not seen and (remaining := deadline - time.monotonic()) > 0:
            seen = self._receive(conn, remaining, probe=channel)
        conn.execute(sql.SQL("UNLISTEN {}").format(sql.Identifier(channel)))
        if not seen:
            raise TimeoutError(
                f"self-NOTIFY probe not delivered within {self.probe_timeout_seconds} s"
            )

    def _take_alive_lock(self, conn: psycopg.Connection[Any]) -> None:
        if not self.hold_alive_lock or self._alive_lock_held:
            return
        self._alive_lock_held = db.take_alive_lock(conn, instance_id=self.instance_id)
        if not self._alive_lock_held:
            logger.warning(
                "alive-lock of instance %s not taken (not registered yet, evicted, or no "
                "free key: other sessions hold them): heartbeats stay on the fast cadence",
                self.instance_id,
                extra={"action": "alive_lock_not_taken"},
            )

    def _reject(self, kind: str, message: str, *args: Any, exc_info: bool = False) -> None:
        self.rejected[kind] += 1
        self._kind_log.log(kind, message, *args, exc_info=exc_info)

    def _dispatch(self, channel: str, payload: str = "") -> None:
        """Handle one notification; nothing it carries may raise out of here."""
        try:
            if channel == CANCEL_CHANNEL:
                self._cancel(payload)
                return
            signal = CHANNELS.get(channel)
            if signal is None:
                return
            self.signals_received += 1
            if payload == ENDED_PAYLOAD and signal != "orphan":
                signal = f"{signal}:{ENDED_PAYLOAD}"
            self.on_signal(signal)
        except Exception as exc:  # noqa: BLE001 - one notification never ends the loop
            self._reject(
                f"{channel}:{type(exc).__name__}",
                "handling a %s notification failed (%s: %s)",
                channel,
                type(exc).__name__,
                exc,
                exc_info=True,
            )

    def _cancel(self, payload: str) -> None:
        """Queue the attempts of this instance that a cancel payload names, to be confirmed."""
        try:
            hint = parse_cancel(payload, self.instance_id)
        except MalformedNotification as exc:
            self._reject(
                exc.kind,
                "ignored a malformed %s notification (%s): %r",
                CANCEL_CHANNEL,
                exc,
                payload[:80],
            )
            return
        if hint is None:
            return  # another instance's attempts
        self.cancels_received += 1
        if self.on_cancel is None or not hint.attempts:
            return
        if len(self._pending) >= MAX_PENDING_CANCELS:  # a flood within one arrival
            self._reject(
                "cancel_backlog", "dropped a %s notification: too many pending", CANCEL_CHANNEL
            )
            return
        self._pending.append(hint)

    def _confirm_cancels(self, conn: psycopg.Connection[Any]) -> None:
        """Pass on the queued cancels' attempts that the database shows cancelled.

        Anyone may NOTIFY ``workpump_cancel``, and a reader of a work table knows every
        running attempt's token: only the row's own state makes a cancel real. One read
        per notification; a failed read leaves the attempt to the renewal, which reports
        a cancelled row too.
        """
        while self._pending:
            hint = self._pending.pop(0)
            ids = [work_id for work_id, _ in hint.attempts]
            tokens = [token for _, token in hint.attempts]
            try:
                cancelled = db.cancelled_attempts(
                    conn, category=hint.category, ids=ids, lease_tokens=tokens
                )
            except Exception as exc:  # the connection decides, below
                if conn.broken or conn.closed:
                    raise  # the session is gone: reconnect
                self._reject(
                    "confirm_failed",
                    "could not confirm a %s notification (%s: %s)",
                    CANCEL_CHANNEL,
                    type(exc).__name__,
                    exc,
                )
                continue
            confirmed = [(i, t) for i, t in hint.attempts if i in cancelled]
            if len(confirmed) < len(hint.attempts):
                self.cancels_unconfirmed += 1
                self._reject(
                    "unconfirmed_cancel",
                    "ignored a %s notification naming %d %s attempt(s) of this instance "
                    "that the database does not show cancelled",
                    CANCEL_CHANNEL,
                    len(hint.attempts) - len(confirmed),
                    hint.category,
                )
            if not confirmed or self.on_cancel is None:
                continue
            self.cancels_confirmed += 1
            try:
                self.on_cancel(hint.category, confirmed)
            except Exception:
                logger.exception("cancel subscriber failed", extra={"action": "cancel_subscriber"})

    def _receive(
        self, conn: psycopg.Connection[Any], timeout: float, probe: str | None = None
    ) -> bool:
        """Handle what arrives next (or nothing within ``timeout``), then confirm cancels.

        ``stop_after=1`` ends the wait after one arrival, however many notifications it
        brought: the confirming read needs the connection that ``notifies()`` holds, and
        breaking out of it mid-arrival would drop the rest. True if ``probe`` was among them.
        """
        seen = False
        for notify in conn.notifies(timeout=timeout, stop_after=1):
            if notify.channel == probe:
                seen = True
            else:
                self._dispatch(notify.channel, notify.payload)
        self._confirm_cancels(conn)
        return seen

    def _serve(self, conn: psycopg.Connection[Any]) -> None:
        last_keepalive = self.clock.monotonic()
        while not self._stop.is_set():
            self._receive(conn, 0.5)
            if self.clock.monotonic() - last_keepalive >= self.keepalive_seconds:
                db.keepalive(conn)
                self._take_alive_lock(conn)  # retried until registered
                last_keepalive = self.clock.monotonic()

    def run(self) -> None:
        """Connect, listen and reconnect until stopped."""
        attempt = 0
        while not self._stop.is_set():
            conn = None
            try:
                conn = self._conn = self._connect()
                self._probe(conn)
                self._take_alive_lock(conn)
                attempt = 0
                self._set_available(True)
                self._settled.set()
                self._serve(conn)
            except Exception as exc:  # noqa: BLE001 - any failure: unavailable, reconnect
                if self._stop.is_set():
                    break
                attempt += 1
                self.failures += 1
                self.last_failure = f"{type(exc).__name__}: {exc}"
                self._alive_lock_held = False
                self._pending.clear()  # the renewal reports a cancelled row all the same
                self._set_available(False, self.last_failure)
                self._settled.set()
                delay = reconnect_delay(
                    attempt, self.reconnect_initial_seconds, self.reconnect_max_seconds
                )
                logger.warning(
                    "NOTIFY connection lost (%s); reconnecting in %.1f s",
                    self.last_failure,
                    delay,
                    extra={"action": "gate_reconnect"},
                )
                self._stop.wait(delay)
            finally:
                if conn is not None:
                    conn.close()
                self._conn = None
        self._alive_lock_held = False
        self._set_available(False, "stopped", stopping=True)
        self._settled.set()
