"""The NOTIFY gate: one dedicated psycopg connection per instance.

It LISTENs on the work channels and on ``workpump_cancel`` (``cancel_work`` names there
the instance holding each cancelled attempt; the gate passes this instance's to
``on_cancel``), proves itself with a self-NOTIFY probe, holds the
instance's alive-lock, sends a keepalive, and on any error reports itself unavailable
and reconnects with capped exponential backoff. Availability changes are reported
exactly once per real transition.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql

from django_workpump import db
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


def reconnect_delay(attempt: int, initial: float = 1.0, maximum: float = 30.0) -> float:
    """Seconds before reconnect attempt ``attempt`` (1-based): doubling, capped."""
    return float(min(initial * 2 ** max(attempt - 1, 0), maximum))


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
        self.cancels_received = 0
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
        for notify in conn.notifies(timeout=self.probe_timeout_seconds):
            if notify.channel == channel:
                seen = True
                break
            self._dispatch(notify.channel, notify.payload)
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

    def _dispatch(self, channel: str, payload: str = "") -> None:
        if channel == CANCEL_CHANNEL:
            self._cancel(payload)
            return
        signal = CHANNELS.get(channel)
        if signal is None:
            return
        self.signals_received += 1
        try:
            self.on_signal(signal)
        except Exception:
            logger.exception("signal subscriber failed", extra={"action": "signal_subscriber"})

    def _cancel(self, payload: str) -> None:
        """Pass the attempts of this instance that ``cancel_work`` names to ``on_cancel``."""
        try:
            message = json.loads(payload)
            if message.get("instance") != str(self.instance_id):
                return  # another instance's attempts
            category = str(message["category"])
            attempts = [(uuid.UUID(i), uuid.UUID(t)) for i, t in message["work"] if t]
        except (ValueError, TypeError, KeyError, AttributeError):
            logger.warning(
                "ignored a malformed %s notification: %r",
                CANCEL_CHANNEL,
                payload[:200],
                extra={"action": "cancel_malformed"},
            )
            return
        self.cancels_received += 1
        if self.on_cancel is None or not attempts:
            return
        try:
            self.on_cancel(category, attempts)
        except Exception:
            logger.exception("cancel subscriber failed", extra={"action": "cancel_subscriber"})

    def _serve(self, conn: psycopg.Connection[Any]) -> None:
        last_keepalive = self.clock.monotonic()
        while not self._stop.is_set():
            for notify in conn.notifies(timeout=0.5):
                self._dispatch(notify.channel, notify.payload)
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
