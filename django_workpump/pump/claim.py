"""ClaimWorker: the only caller of ``claim_work``.

It claims at most the free dispatch slots (plus a small prefetch), of the topics this
process has handlers for, hands rows to the dispatcher, and waits between polls by an
adaptive backoff that NOTIFY wakes can cut short at any depth. When the database refuses
the claim because this instance was evicted (or is not registered), it stops claiming for
good and calls ``on_refused``: the instance stops as on a refused heartbeat. Rows the
claim parked as dead instead of leasing (their attempts used up) never reach it:
``db.claim_work`` logs each, once, and returns the leased rows.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from django_workpump.clock import Clock, SystemClock
from django_workpump.db import ClaimedWork, InstanceRefused
from django_workpump.dead_letters import log_dead_lettered
from django_workpump.metrics import NullRecorder, recorder
from django_workpump.pump.coordinator import Coordinator
from django_workpump.pump.service import LoopService
from django_workpump.states import FailureReason, OutcomeStatus
from django_workpump.work import Lease

logger = logging.getLogger("django_workpump.claim")

# The failure reason of a row whose payload Python cannot decode.
UNDECODABLE_PAYLOAD = FailureReason.UNDECODABLE_PAYLOAD
# Wake-ups (NOTIFY, freed slots) that claimed nothing, in a row, before further wakes are
# spaced out: a NOTIFY flood must not become a claim flood. The spacing doubles from the
# base up to the tight poll interval; a wake that claims something, or a quiet second,
# ends it.
FREE_FRUITLESS_WAKES = 10
WAKE_SPACING_BASE_SECONDS = 0.01
WAKE_FLOOD_QUIET_SECONDS = 1.0
# A claim may take what the dispatcher starts in this long (beyond the free slots).
QUEUE_SECONDS = 0.25
# ... or in this many of its own round trips, when those are slower: a claim that takes
# as long as the rows it brings would leave the dispatcher waiting half the time.
CLAIM_ROUND_TRIPS_PER_BATCH = 10
# ... but never more than this long of work: a stalled claim must not make the next
# batches hoard rows that idle peers could run.
MAX_QUEUE_SECONDS = 1.0
RATE_SAMPLE_SECONDS = 0.1
# While rows of fairness keys are in reach, a claim takes few rows beyond the free slots
# (CLAIM_FAIR_PREFETCH): a quiet key's row stored during a claim waits for its end. The
# claims of underserved groups' rows (made with no slot free) stop while that many and
# this many more rows queue beyond the slots.
UNDERSERVED_QUEUE_ROOM = 8


class Gate(Protocol):
    """What the claimer needs of the NOTIFY gate."""

    @property
    def available(self) -> bool: ...


class DispatchSink(Protocol):
    def free_slots(self) -> int: ...
    def submit(self, rows: list[ClaimedWork], front: bool = False) -> None: ...


@dataclass(frozen=True)
class ClaimPolicy:
    """The claim cadence knobs, in milliseconds as in WORKPUMP."""

    polling_interval_ms: int = 250
    polling_max_interval_ms: int = 10_000
    notify_healthy_polling_interval_ms: int | None = 5_000
    enable_safety_net_poll: bool = True
    max_rows: int = 1_000
    prefetch: int = 2
    fair_prefetch: int = 8

    @classmethod
    def from_settings(cls, settings: dict[str, Any]) -> ClaimPolicy:
        return cls(
            polling_interval_ms=settings["POLLING_INTERVAL_MS"],
            polling_max_interval_ms=settings["POLLING_MAX_INTERVAL_MS"],
            notify_healthy_polling_interval_ms=settings["NOTIFY_HEALTHY_POLLING_INTERVAL_MS"],
            enable_safety_net_poll=settings["ENABLE_SAFETY_NET_POLL"],
            max_rows=settings["MAX_STREAMS_PER_BATCH"],
            prefetch=settings["CLAIM_PREFETCH"],
            fair_prefetch=settings["CLAIM_FAIR_PREFETCH"],
        )

    @property
    def fair_ahead(self) -> int:
        """Rows a claim takes beyond the free slots after a claim that reached rows of
        fairness keys."""
        return max(self.prefetch, self.fair_prefetch)


def warn_unreadable_headers(rows: list[ClaimedWork]) -> None:
    """Log each row whose stored headers cannot be read: it runs without them.

    Headers are metadata (a trace context), not the work: losing them costs a trace
    link, while parking the row would lose the work to a value anyone with table access
    could write.
    """
    for row in rows:
        if row.headers_error is None:
            continue
        logger.warning(
            "%s %s (topic %r) runs without its headers: they cannot be read (%s)",
            row.category,
            row.work_id,
            row.topic,
            row.headers_error,
            extra={
                "action": "unreadable_headers",
                "workpump_category": row.category,
                "workpump_topic": row.topic,
                "workpump_id": str(row.work_id),
                "workpump_error": row.headers_error,
            },
        )


def poll_wait_ms(policy: ClaimPolicy, empty_polls: int, gate_available: bool | None) -> int | None:
    """Milliseconds to wait before the next poll; None: wait for a wake only.

    ``gate_available`` is None when no NOTIFY gate runs (``--no-listen``).
    """
    tight = policy.polling_interval_ms
    if gate_available is False:
        return tight  # NOTIFY cannot wake us: poll tightly, never back off
    if gate_available and not policy.enable_safety_net_poll:
        return None
    base = tight
    relaxed = policy.notify_healthy_polling_interval_ms
    if gate_available and relaxed is not None and relaxed > base:
        base = relaxed
    if policy.polling_max_interval_ms <= base or empty_polls <= 1:
        return base
    return min(base << min(empty_polls - 1, 10), policy.polling_max_interval_ms)


@dataclass(frozen=True)
class ClaimResult:
    claimed: int
    has_more: bool
    skipped_busy: bool = False
    # flow control: ms until a rate-limited group may start a row again (poll then)
    flow_wait_ms: int | None = None
    error: BaseException | None = None
    refused: bool = False  # this instance was evicted (or is not registered): stop


class ClaimWorker(LoopService):
    """Poll ``claim_work`` and feed the dispatcher."""

    name = "claim"

    def __init__(
        self,
        coordinator: Coordinator,
        sink: DispatchSink,
        policy: ClaimPolicy,
        *,
        gate: Gate | None = None,
        clock: Clock | None = None,
        enabled: bool = True,
        before_first_claim: Callable[[], Any] | None = None,
        on_refused: Callable[[str], Any] | None = None,
        metrics: NullRecorder | None = None,
    ) -> None:
        super().__init__()
        self.coordinator = coordinator
        self.metrics = recorder() if metrics is None else metrics
        self.sink = sink
        self.policy = policy
        self.gate = gate
        self.clock = clock or SystemClock()
        self.enabled = enabled
        self.before_first_claim = before_first_claim
        self.on_refused = on_refused
        self.refused: str | None = None  # why the database refused this instance
        self.empty_polls = 0
        self.polls = 0
        self.claimed_total = 0
        self.last_claimed = 0
        # (number of the last poll that finished, rows it claimed or None on error)
        self.last_poll: tuple[int, int | None] = (0, None)
        self.start_rate: float | None = None  # rows/s the dispatcher starts (measured)
        self._rate_sample: tuple[float, int, float] | None = None
        # Seconds of claim round trips during which the dispatcher had nothing to run: the
        # start rate leaves them out (see _batch_size).
        self.starved_seconds = 0.0
        # a moving average of the claim's round trip (the batch covers several of them)
        self.claim_seconds: float | None = None
        self.startup_catch_up_count = 0
        self.reconnect_catch_up_count = 0
        self.wake_requests = 0
        self.fruitless_wakes = 0  # wake-triggered claims in a row that found nothing
        self._last_fruitless_wake_at = 0.0
        self.wakes_spaced = 0  # wake-ups that waited because of a flood
        self._wake = threading.Event()
        # True while the loop waits for a dispatch slot to free (rows are waiting that it
        # could not take): only then does a freed slot wake it.
        self._slot_wait = False
        self.slot_wakes_skipped = 0
        self._last_gate_state: bool | None = None
        self._gate_lost_at: float | None = None
        # The last claim reached rows of fairness keys (docs/flow-control.md): the next
        # takes at most policy.fair_ahead rows beyond the free slots, so it ends soon.
        self.fair = False
        # Work was stored since the last claim (a NOTIFY): after a fair claim, the next
        # may take the rows of underserved groups with no slot free (_underserved_rows).
        self._new_work = False
        # The last claim for free slots left rows waiting (has_more). A claim of
        # underserved groups takes a few rows of some groups only, so it says nothing of
        # the rest: the loop goes on waiting for a slot (not for the next poll) after it.
        self._more_waiting = False

    # -- signals -------------------------------------------------------------------
    def request_immediate_poll(self, new_work: bool = False) -> None:
        """Wake the loop now; requests between two polls coalesce into one.
        ``new_work``: the wake says work was stored (a NOTIFY of a category claimed here)."""
        self.wake_requests += 1
        if new_work:
            self._new_work = True
        self._wake.set()

    def slot_freed(self) -> None:
        """A dispatch slot freed: wake the loop if it waits for one, else nothing.

        Without rows left waiting a freed slot has nothing to claim: a wake then would be
        a claim that finds nothing (a stream's next run is claimable only once its
        completions are written, and the dispatcher says so apart).
        """
        if self._slot_wait:
            self.request_immediate_poll()
        else:
            self.slot_wakes_skipped += 1

    def on_gate_changed(self, available: bool) -> None:
        """React to a real availability transition of the NOTIFY gate."""
        if available == self._last_gate_state:
            return
        previous, self._last_gate_state = self._last_gate_state, available
        if not available:
            self._gate_lost_at = self.clock.monotonic()
        elif previous is False:
            lost_for = self.clock.monotonic() - (self._gate_lost_at or self.clock.monotonic())
            self.reconnect_catch_up_count += 1
            logger.info(
                "NOTIFY gate back after %.0f ms: running a catch-up claim",
                lost_for * 1000,
                extra={"action": "reconnect_catch_up"},
            )
        self.request_immediate_poll()

    def gate_available(self) -> bool | None:
        return None if self.gate is None else self.gate.available

    def current_wait_ms(self) -> int | None:
        return poll_wait_ms(self.policy, self.empty_polls, self.gate_available())

    # -- wake flood control --------------------------------------------------------
    def wake_spacing_seconds(self) -> float:
        """How long a wake-up waits before its claim: 0 unless wakes keep finding nothing."""
        if self.clock.monotonic() - self._last_fruitless_wake_at > WAKE_FLOOD_QUIET_SECONDS:
            self.fruitless_wakes = 0  # the flood is over
        excess = self.fruitless_wakes - FREE_FRUITLESS_WAKES
        if excess < 0:
            return 0.0
        cap = self.policy.polling_interval_ms / 1000
        return min(cap, WAKE_SPACING_BASE_SECONDS * 2 ** min(excess, 16))

    def note_wake_claim(self, result: ClaimResult) -> None:
        """Count a wake-triggered claim: one that found nothing feeds the flood control."""
        if result.claimed or result.error is not None or result.skipped_busy:
            self.fruitless_wakes = 0
            return
        self.fruitless_wakes += 1
        self._last_fruitless_wake_at = self.clock.monotonic()

    # -- one pass ------------------------------------------------------------------
    def run_once(self) -> ClaimResult:
        """Claim once for the free slots and hand the rows over."""
        if self.refused is not None:
            return ClaimResult(claimed=0, has_more=False, refused=True)
        free = self.sink.free_slots()
        underserved = free <= 0
        if not underserved:
            max_rows = self._batch_size(free)
        else:
            max_rows = self._underserved_rows()
            if max_rows <= 0:
                # Nothing could run now; the dispatcher wakes us when a slot frees.
                return ClaimResult(claimed=0, has_more=False, skipped_busy=True)
        self._new_work = False
        self.polls += 1
        poll_number = self.polls
        starved = getattr(self.sink, "in_flight", None) == 0
        claim_started = self.clock.monotonic()
        try:
            rows = self.coordinator.claim(max_rows, underserved_only=underserved)
        except InstanceRefused as exc:
            self.last_poll = (poll_number, None)
            self._refuse(str(exc))
            return ClaimResult(claimed=0, has_more=False, error=exc, refused=True)
        except Exception as exc:
            self.last_poll = (poll_number, None)
            self.empty_polls += 1
            logger.warning(
                "claim_work failed: %s", exc, extra={"action": "claim_failed"}, exc_info=True
            )
            return ClaimResult(claimed=0, has_more=False, error=exc)
        claim_seconds = self.clock.monotonic() - claim_started
        self.claim_seconds = (
            claim_seconds
            if self.claim_seconds is None
            else 0.8 * self.claim_seconds + 0.2 * claim_seconds
        )
        if starved:
            self.starved_seconds += claim_seconds
        self.metrics.claim(rows, claim_seconds)
        if not self.startup_catch_up_count:  # the first claim that went through
            self.startup_catch_up_count += 1
            logger.log(
                logging.INFO if rows else logging.DEBUG,
                "startup catch-up claim got %d rows",
                len(rows),
                extra={"action": "startup_catch_up"},
            )
        self.last_claimed = len(rows)
        self.last_poll = (poll_number, len(rows))
        if rows:
            self.empty_polls = 0
            self.claimed_total += len(rows)
            warn_unreadable_headers(rows)
            runnable = [row for row in rows if row.payload_error is None]
            if runnable:
                # an underserved claim's rows start before the rows queued for a slot
                self.sink.submit(runnable, front=underserved)
            if len(runnable) < len(rows):
                self._dead_letter_undecodable([row for row in rows if row.payload_error])
        else:
            self.empty_polls += 1
        has_more = any(row.has_more for row in rows)
        if underserved:
            has_more = has_more or self._more_waiting
        else:
            self._more_waiting = has_more
        flow_wait = getattr(self.coordinator, "flow_wait_ms", None)
        flow_fair = getattr(self.coordinator, "flow_fair", None)
        self.fair = bool(flow_fair()) if flow_fair is not None else False
        return ClaimResult(
            claimed=len(rows),
            has_more=has_more,
            flow_wait_ms=flow_wait() if flow_wait is not None else None,
        )

    def _dead_letter_undecodable(self, rows: list[ClaimedWork]) -> None:
        """Park rows whose payload cannot be decoded, alone: their batch-mates run.

        Running them again could never help. If parking fails, their leases expire and
        the next claim of them tries again.
        """
        by_category: dict[str, list[ClaimedWork]] = {}
        for row in rows:
            by_category.setdefault(row.category, []).append(row)
        for category, group in by_category.items():
            errors = [f"the payload cannot be decoded: {row.payload_error}" for row in group]
            try:
                outcomes = self.coordinator.dead_letter(
                    [Lease(category, row.work_id, row.lease_token) for row in group],
                    errors,
                    UNDECODABLE_PAYLOAD,
                )
            except Exception as exc:
                logger.warning(
                    "could not dead-letter %d %s rows with undecodable payloads: %s",
                    len(group),
                    category,
                    exc,
                    extra={"action": "dead_letter_failed"},
                    exc_info=True,
                )
                continue
            parked_ids = {
                outcome.work_id for outcome in outcomes if outcome.status == OutcomeStatus.DEAD
            }
            for row in group:
                if row.work_id in parked_ids:
                    self.metrics.dead_lettered(category, row.topic, UNDECODABLE_PAYLOAD)
            for row, error in zip(group, errors, strict=True):
                if row.work_id in parked_ids:
                    log_dead_lettered(
                        category,
                        row.work_id,
                        UNDECODABLE_PAYLOAD,
                        error,
                        topic=row.topic,
                        stream=row.stream,
                        attempt=row.attempts,
                        max_attempts=row.max_attempts,
                        fix="it is never run as it is: fix its payload first (the admin "
                        "shows it as stored) or delete the row",
                    )
                    continue
                fields = {
                    "action": UNDECODABLE_PAYLOAD,
                    "workpump_category": category,
                    "workpump_topic": row.topic,
                    "workpump_id": str(row.work_id),
                    "workpump_stream": row.stream,
                    "workpump_attempt": row.attempts,
                    "workpump_max_attempts": row.max_attempts,
                    "workpump_reason": str(UNDECODABLE_PAYLOAD),
                    "workpump_error": error,
                }
                logger.warning(
                    "%s %s (topic %r) not run and its lease was lost: %s",
                    category,
                    row.work_id,
                    row.topic,
                    error,
                    extra=fields,
                )

    def _refuse(self, reason: str) -> None:
        self.refused = reason
        logger.error(
            "claim_work refused this instance: %s; it stops claiming and exits",
            reason,
            extra={"action": "instance_refused"},
        )
        if self.on_refused is not None:
            self.on_refused(reason)

    def _batch_size(self, free: int) -> int:
        """Free slots plus the prefetch, or what the dispatcher starts in QUEUE_SECONDS
        (or in CLAIM_ROUND_TRIPS_PER_BATCH claim round trips, when those take longer, up
        to MAX_QUEUE_SECONDS).

        The dispatcher's start rate is measured here (a moving average over at least
        RATE_SAMPLE_SECONDS): fast work is claimed in large batches, so a backlog drains
        in few round trips, while a claimed row never waits in the local queue for much
        longer than QUEUE_SECONDS, whatever its handler costs. When claims are slow (a
        busy database, or many instances sharing few cores) the batch covers several of
        them instead, so the instance spends most of its time running rows rather than
        waiting for them.

        The rate leaves out the claims made while the dispatcher had nothing to run: a row
        waits in the queue only while the dispatcher runs the rows before it. Counting
        those round trips would make small batches look slow, so they would stay small:
        at ``CONCURRENCY`` 1 every claim is such a wait, and the claims (one commit each)
        would outnumber the work.

        After a claim that reached rows of fairness keys, no more than
        ``CLAIM_FAIR_PREFETCH`` (or the prefetch, when larger) beyond the free slots: a
        quiet key's row stored during a claim waits for its end, and a batch sized ahead
        is a long claim.
        """
        size = free + self.policy.prefetch
        started = getattr(self.sink, "started_total", None)
        if started is not None:
            now = self.clock.monotonic()
            if self._rate_sample is None:
                self._rate_sample = (now, started, self.starved_seconds)
            elif now - self._rate_sample[0] >= RATE_SAMPLE_SECONDS:
                at, count, starved = self._rate_sample
                busy = now - at - (self.starved_seconds - starved)
                if busy > 0:
                    rate = (started - count) / busy
                    self.start_rate = (
                        rate if self.start_rate is None else (0.5 * self.start_rate + 0.5 * rate)
                    )
                    self._rate_sample = (now, started, self.starved_seconds)
            if self.start_rate:
                round_trips = (self.claim_seconds or 0.0) * CLAIM_ROUND_TRIPS_PER_BATCH
                ahead = min(max(QUEUE_SECONDS, round_trips), MAX_QUEUE_SECONDS)
                size = max(size, round(self.start_rate * ahead))
        if self.fair:
            size = min(size, free + self.policy.fair_ahead)
        return min(size, self.policy.max_rows)

    def _underserved_rows(self) -> int:
        """Rows to claim with no slot free: none, unless the last claim reached rows of
        fairness keys and work was stored since. Then a claim of the rows of the groups
        that hold fewer than the one holding most (``underserved_only``), up to the
        concurrency, while fewer than a fair claim's rows beyond the slots and
        UNDERSERVED_QUEUE_ROOM more queue beyond them.

        A noisy key keeps every slot busy and the local queue full: a quiet key's new row
        would wait for a slot, then behind the queued rows. This claim takes it at once,
        and the dispatcher starts it before them; it takes no row of the group holding
        most, so a lone flood cannot grow the local queue through it.
        """
        if not (self.fair and self._new_work):
            return 0
        in_flight = getattr(self.sink, "in_flight", None)
        concurrency = getattr(self.sink, "concurrency", None)
        if in_flight is None or concurrency is None or in_flight < concurrency:
            return 0  # no slot free for another reason: the dispatcher takes no more rows
        queue_rows = self.policy.fair_ahead + UNDERSERVED_QUEUE_ROOM
        return max(min(concurrency, concurrency + queue_rows - in_flight), 0)

    # -- the loop ------------------------------------------------------------------
    def run(self) -> None:
        """Loop until ``stop()``: claim, hand over, wait (or go again in drain mode)."""
        stop = self._stop
        if not self.enabled:
            logger.warning(
                "claiming is disabled (CLAIM_ENABLED=False)", extra={"action": "claim_disabled"}
            )
            stop.wait()
            return
        if self.before_first_claim is not None:
            try:
                self.before_first_claim()
            except Exception:
                logger.exception("initial heartbeat failed", extra={"action": "heartbeat_failed"})
        woken = False
        while not stop.is_set():
            if woken:
                spacing = self.wake_spacing_seconds()
                if spacing:
                    self.wakes_spaced += 1
                    if stop.wait(spacing):  # wakes meanwhile coalesce into this claim
                        return
            self._wake.clear()
            self._slot_wait = False
            result = self.run_once()
            if woken:
                self.note_wake_claim(result)
            if result.refused:
                return
            if (result.has_more or result.skipped_busy) and not stop.is_set():
                # Rows wait that need a slot. Said before looking at the slots, so a slot
                # freed meanwhile is either seen here or wakes the wait below.
                self._slot_wait = True
                if self.sink.free_slots() > 0:
                    woken = False
                    continue  # drain mode: more is waiting and we can take it
            wait_ms = None if result.skipped_busy else self.current_wait_ms()
            if result.flow_wait_ms is not None and not result.skipped_busy:
                # a rate holds rows back: claim when its bucket has a token again
                wait_ms = min(result.flow_wait_ms, wait_ms or result.flow_wait_ms)
            # One Event serves wake and stop: stop() sets it too.
            woken = self._wake.wait(None if wait_ms is None else wait_ms / 1000)

    def _interrupt(self) -> None:
        self._wake.set()  # one Event serves wake and stop
