"""Coalesce small writes (renewals, completions, failures) into batched flushes.

A failed write is sorted by its error. A connection error (``is_transient``) puts the
batch back in front and retries it after a doubling, capped delay. Any other error is the
data's: the batch is split in halves until the items that fail are alone, every other
item is written, and each item that fails alone goes to ``on_rejected`` (the owner's safe
path) or is dropped and logged. One bad item never holds back the others.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from django_workpump.clock import Clock, SystemClock
from django_workpump.storable import ascii_text, is_transient

logger = logging.getLogger(__name__)

T = TypeVar("T")

# An idle flusher still wakes this often, so a stop event set by someone other than stop()
# is noticed.
_IDLE_WAIT_SECONDS = 1.0
# Retries after a connection error start at the coalescing window (at least this) and
# double up to the cap.
MIN_RETRY_DELAY_SECONDS = 0.05
MAX_RETRY_DELAY_SECONDS = 5.0
# After this many failed flushes in a row a flusher reports itself stalled.
STALL_AFTER_FAILURES = 3


@dataclass(frozen=True)
class FlusherHealth:
    """Whether a flusher is writing: its failures in a row, since when, and why."""

    name: str
    pending: int
    failures: int  # failed flushes in a row (0: the last flush worked)
    failing_seconds: float  # since the first of them
    last_error: str | None
    rejected: int  # items the database refused for their data, since start
    dropped: int  # items given up on (buffer overflow, or refused on every safe path)

    @property
    def stalled(self) -> bool:
        return self.failures >= STALL_AFTER_FAILURES

    def summary(self) -> str:
        """One short phrase for the status line."""
        return (
            f"{self.name.removeprefix('workpump-')}({self.failures} failures in "
            f"{self.failing_seconds:.0f}s, {self.pending} waiting: {self.last_error})"
        )


class BatchFlusher(Generic[T]):
    """Buffer items and hand them to ``flush`` in batches, on size or after a window."""

    def __init__(
        self,
        name: str,
        flush: Callable[[list[T]], None],
        *,
        max_batch: int = 200,
        coalesce_window: float = 0.2,
        immediate_flush_at: int = 100,
        capacity: int = 5000,
        clock: Clock | None = None,
        on_thread_start: Callable[[], object] | None = None,
        on_thread_exit: Callable[[], object] | None = None,
        group_by: Callable[[T], Hashable] | None = None,
        on_rejected: Callable[[T, Exception], object] | None = None,
        max_retry_delay: float = MAX_RETRY_DELAY_SECONDS,
    ) -> None:
        if max_batch < 1 or immediate_flush_at < 1:
            raise ValueError(
                f"Flusher {name!r}: max_batch ({max_batch}) and immediate_flush_at "
                f"({immediate_flush_at}) must be at least 1."
            )
        if capacity < max_batch:
            raise ValueError(
                f"Flusher {name!r}: capacity ({capacity}) must be at least max_batch ({max_batch})."
            )
        if coalesce_window < 0:
            raise ValueError(f"Flusher {name!r}: coalesce_window ({coalesce_window}) must be >= 0.")
        self.name = name
        self.max_batch = max_batch
        self.coalesce_window = coalesce_window
        self.immediate_flush_at = immediate_flush_at
        self.capacity = capacity
        self.flushed_items = 0
        self.failed_flushes = 0
        self.dropped_items = 0
        self.rejected_items = 0
        self.max_retry_delay = max_retry_delay
        self._flush = flush
        # Items of one group are flushed together (e.g. one SQL call per category).
        self._group_by = group_by
        # The safe path of an item the database refuses on its own; raising a connection
        # error puts it back, raising anything else drops it.
        self._on_rejected = on_rejected
        self._on_thread_start = on_thread_start  # e.g. name the thread's DB connection
        self._on_thread_exit = on_thread_exit  # e.g. close the thread's DB connection
        self._failures = 0  # failed flushes in a row
        self._failing_since: float | None = None
        self._last_error: str | None = None
        self._clock: Clock = clock if clock is not None else SystemClock()
        self._cond = threading.Condition()
        self._buffer: list[T] = []
        self._first_at: float | None = None  # when the oldest buffered item arrived
        self._retry_at: float | None = None  # after a failed flush, not due before this
        # One batch in flight at a time, so a put-back batch keeps its place in the order.
        self._flushing = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __len__(self) -> int:
        with self._cond:
            return len(self._buffer)

    def put(self, item: T) -> bool:
        """Buffer an item; return False (and drop it) if the buffer is full."""
        with self._cond:
            size = len(self._buffer)
            if size < self.capacity:
                if size == 0:
                    self._first_at = self._clock.monotonic()
                self._buffer.append(item)
                size += 1
                # Wake the thread on the first item (to arm the window) and at the size triggers.
                if size == 1 or size >= min(self.immediate_flush_at, self.max_batch):
                    self._cond.notify()
                return True
        # Refuse rather than block: a producer stuck on a full buffer would hold a handler slot,
        # and lost renewals or completions are recovered by lease expiry.
        logger.warning(
            "Flusher %s is full (%s items); an item was refused.",
            self.name,
            self.capacity,
            extra={"action": "flusher_full"},
        )
        return False

    def put_many(self, items: list[T]) -> int:
        """Buffer items at once, so one flush sees them all; return how many were taken.

        Items past the capacity are refused (dropped), as ``put`` refuses one.
        """
        if not items:
            return 0
        with self._cond:
            size = len(self._buffer)
            taken = max(0, min(len(items), self.capacity - size))
            if taken:
                if size == 0:
                    self._first_at = self._clock.monotonic()
                self._buffer.extend(items[:taken])
                self._cond.notify()
        if taken < len(items):
            logger.warning(
                "Flusher %s is full (%s items); %s items were refused.",
                self.name,
                self.capacity,
                len(items) - taken,
                extra={"action": "flusher_full"},
            )
        return taken

    def hurry(self) -> None:
        """Make what is buffered due now, without waiting out the window (someone waits
        on it: a stream's next row waits on its predecessor's completion)."""
        with self._cond:
            if self._buffer and self._first_at is not None:
                now = self._clock.monotonic()
                self._first_at = min(self._first_at, now - self.coalesce_window)
                self._cond.notify()

    def due(self) -> bool:
        """Return whether a flush should happen now."""
        with self._cond:
            return self._seconds_until_due() == 0.0

    def flush_once(self) -> int:
        """Flush up to max_batch items in arrival order; return how many were delivered."""
        return self._flush_batch()[0]

    def run(self, stop: threading.Event) -> None:
        """Flush whenever due until ``stop`` is set, then drain what is left."""
        while True:
            with self._cond:
                if stop.is_set():
                    break
                wait = self._seconds_until_due()
                if wait is None or wait > 0:
                    self._cond.wait(_IDLE_WAIT_SECONDS if wait is None else wait)
                    continue
            while not stop.is_set() and self.due():
                self.flush_once()
        self._drain()

    def start(self) -> None:
        """Run the flusher in a daemon thread named after the flusher."""
        if self._thread is not None or self._stop.is_set():
            raise RuntimeError(f"Flusher {self.name!r} was already started or stopped.")
        self._thread = threading.Thread(target=self._thread_main, name=self.name, daemon=True)
        self._thread.start()

    def _thread_main(self) -> None:
        try:
            if self._on_thread_start is not None:
                self._on_thread_start()
            self.run(self._stop)
        finally:
            if self._on_thread_exit is not None:
                self._on_thread_exit()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread after its final drain; safe to call twice or before start()."""
        with self._cond:
            self._stop.set()
            self._cond.notify_all()
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return
        thread.join(timeout)
        if thread.is_alive():
            logger.warning(
                "Flusher %s did not finish its final drain within %s s.",
                self.name,
                timeout,
                extra={"action": "flusher_stop_timeout"},
            )

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread to end; True when it is not running."""
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return thread is None
        thread.join(timeout)
        return not thread.is_alive()

    def _seconds_until_due(self) -> float | None:
        """Return 0.0 if due, the seconds to wait if not yet, None if empty (lock held)."""
        size = len(self._buffer)
        if size == 0 or self._first_at is None:
            return None
        now = self._clock.monotonic()
        if self._retry_at is not None and now < self._retry_at:
            # A failed flush waits one window, so a broken database is not hammered.
            return self._retry_at - now
        if size >= self.immediate_flush_at or size >= self.max_batch:
            return 0.0
        return max(0.0, self._first_at + self.coalesce_window - now)

    def health(self) -> FlusherHealth:
        """Return whether this flusher is writing, for the status line and heartbeats."""
        with self._cond:
            since = self._failing_since
            return FlusherHealth(
                name=self.name,
                pending=len(self._buffer),
                failures=self._failures,
                failing_seconds=0.0 if since is None else self._clock.monotonic() - since,
                last_error=self._last_error,
                rejected=self.rejected_items,
                dropped=self.dropped_items,
            )

    def _flush_batch(self) -> tuple[int, bool]:
        """Flush one batch; return (items delivered, whether the flush succeeded)."""
        with self._flushing:
            with self._cond:
                if not self._buffer:
                    return 0, True
                first_at = self._first_at
                if len(self._buffer) <= self.max_batch:
                    batch, self._buffer = self._buffer, []
                    self._first_at = None
                else:
                    # Leftovers keep the old arrival time: they waited behind a full batch.
                    batch = self._buffer[: self.max_batch]
                    del self._buffer[: self.max_batch]
            delivered, unwritten, error = self._deliver(batch)
            if error is not None:
                with self._cond:
                    self.flushed_items += delivered
                self._failed(error, unwritten, first_at)
                return delivered, False
            with self._cond:
                self.flushed_items += delivered
                self._retry_at = None
                recovered = self._failures
                self._failures, self._failing_since, self._last_error = 0, None, None
            if recovered >= STALL_AFTER_FAILURES:
                logger.warning(
                    "Flusher %s writes again after %s failed flushes.",
                    self.name,
                    recovered,
                    extra={"action": "flusher_recovered"},
                )
            return delivered, True

    def _groups(self, batch: list[T]) -> list[list[T]]:
        if self._group_by is None:
            return [batch]
        groups: dict[Hashable, list[T]] = {}
        for item in batch:
            groups.setdefault(self._group_by(item), []).append(item)
        return list(groups.values())

    def _deliver(self, batch: list[T]) -> tuple[int, list[T], Exception | None]:
        """Write a batch group by group, splitting around data errors.

        Return (items written or settled, items left unwritten, the connection error that
        stopped the flush or None). Arrival order is kept within each group.
        """
        chunks = self._groups(batch)
        delivered = 0
        while chunks:
            chunk = chunks.pop(0)
            try:
                self._flush(chunk)
                delivered += len(chunk)
                continue
            except Exception as exc:  # noqa: BLE001 - sorted below: retried or split
                if is_transient(exc):
                    return delivered, [*chunk, *(i for c in chunks for i in c)], exc
                error = exc
            if len(chunk) > 1:
                middle = len(chunk) // 2
                chunks[:0] = [chunk[:middle], chunk[middle:]]
                continue
            try:
                self._reject(chunk[0], error)
            except Exception as exc:  # noqa: BLE001 - the safe path failed: retried or dropped
                if is_transient(exc):
                    return delivered, [*chunk, *(i for c in chunks for i in c)], exc
                self._drop(chunk[0], exc)
            delivered += 1
        return delivered, [], None

    def _reject(self, item: T, error: Exception) -> None:
        """Hand an item the database refused on its own to the safe path."""
        with self._cond:
            self.rejected_items += 1
        logger.error(
            "Flusher %s: the database refused one item for its data (%s: %s); the others "
            "were written without it.",
            self.name,
            type(error).__name__,
            ascii_text(str(error))[:500],
            extra={"action": "flusher_item_rejected"},
        )
        if self._on_rejected is None:
            raise error
        self._on_rejected(item, error)

    def _drop(self, item: T, error: Exception) -> None:
        with self._cond:
            self.dropped_items += 1
        logger.error(
            "Flusher %s dropped an item the database refuses (%s: %s): %r",
            self.name,
            type(error).__name__,
            ascii_text(str(error))[:500],
            ascii_text(repr(item))[:500],
            extra={"action": "flusher_item_dropped"},
        )

    def _failed(self, error: Exception, unwritten: list[T], first_at: float | None) -> None:
        """Put what a connection error left unwritten back in front; back off."""
        with self._cond:
            self.failed_flushes += 1
            self._failures += 1
            now = self._clock.monotonic()
            if self._failing_since is None:
                self._failing_since = now
            self._last_error = f"{type(error).__name__}: {ascii_text(str(error)).strip()}"[:200]
            failures, since = self._failures, self._failing_since
            delay = min(
                max(self.coalesce_window, MIN_RETRY_DELAY_SECONDS) * 2 ** (failures - 1),
                self.max_retry_delay,
            )
            self._buffer[:0] = unwritten
            overflow = len(self._buffer) - self.capacity
            if overflow > 0:
                del self._buffer[self.capacity :]
                self.dropped_items += overflow
            if self._buffer:
                self._first_at = first_at if first_at is not None else now
            self._retry_at = now + delay
            waiting = len(self._buffer)
        if failures == STALL_AFTER_FAILURES:
            logger.error(
                "Flusher %s is stalled: %s flushes in a row failed over %.1f s (%s); %s items "
                "wait and are retried every %.1f s at most. Check the database connection.",
                self.name,
                failures,
                now - since,
                self._last_error,
                waiting,
                self.max_retry_delay,
                extra={"action": "flusher_stalled"},
            )
        else:
            logger.warning(
                "Flusher %s failed to flush %s items (%s); they go back to the front and are "
                "retried in %.2f s.",
                self.name,
                len(unwritten),
                self._last_error,
                delay,
                extra={"action": "flusher_flush_failed"},
            )
        if overflow > 0:
            logger.warning(
                "Flusher %s dropped the %s newest items to put a failed batch back.",
                self.name,
                overflow,
                extra={"action": "flusher_overflow_dropped"},
            )

    def _drain(self) -> None:
        """Flush everything left; give up after two failed flushes in a row."""
        failures = 0
        while failures < 2 and len(self) > 0:
            _, ok = self._flush_batch()
            failures = 0 if ok else failures + 1
        if len(self) > 0:
            logger.error(
                "Flusher %s stopped with %s items unflushed.",
                self.name,
                len(self),
                extra={"action": "flusher_drain_incomplete"},
            )
