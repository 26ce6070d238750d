"""Coalesce small writes (renewals, completions, failures) into batched flushes (DESIGN §5)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from django_workpump.clock import Clock, SystemClock

logger = logging.getLogger(__name__)

T = TypeVar("T")

# An idle flusher still wakes this often, so a stop event set by someone other than stop()
# is noticed.
_IDLE_WAIT_SECONDS = 1.0


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
        on_thread_exit: Callable[[], object] | None = None,
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
        self._flush = flush
        self._on_thread_exit = on_thread_exit  # e.g. close the thread's DB connection
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
            try:
                self._flush(batch)
            except Exception:
                logger.exception(
                    "Flusher %s failed to flush %s items; they go back to the front.",
                    self.name,
                    len(batch),
                    extra={"action": "flusher_flush_failed"},
                )
                self._put_back(batch, first_at)
                return 0, False
            with self._cond:
                self.flushed_items += len(batch)
                self._retry_at = None
            return len(batch), True

    def _put_back(self, batch: list[T], first_at: float | None) -> None:
        """Return a failed batch to the front, dropping the newest items that do not fit."""
        with self._cond:
            self.failed_flushes += 1
            self._buffer[:0] = batch
            overflow = len(self._buffer) - self.capacity
            if overflow > 0:
                del self._buffer[self.capacity :]
                self.dropped_items += overflow
            self._first_at = first_at
            self._retry_at = self._clock.monotonic() + self.coalesce_window
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
