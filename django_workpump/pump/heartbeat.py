"""HeartbeatWorker: proves this instance is alive and looks for dead peers.

Two timers in one loop: the beat (fast cadence, or slow while the alive-lock proves
liveness) and a short-cadence probe, a read that calls the reap only when a peer is
evictable and otherwise says when one will be, so the next probe lands then rather than
at the next regular tick (docs/design-decisions.md). A refused beat means this
instance was evicted: everything stops.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django_workpump.clock import Clock, SystemClock
from django_workpump.pump.coordinator import Coordinator
from django_workpump.pump.service import LoopService

logger = logging.getLogger("django_workpump.heartbeat")

ADVISORY_LOCK_MODE = "advisory_lock_when_available"
TABLE_ONLY_MODE = "heartbeat_table_only"

# A probe scheduled for when a peer becomes evictable runs this much later, so that the
# database clock has certainly passed that time.
PROBE_MARGIN_SECONDS = 0.05
# A failed beat is retried after this, doubling up to the cadence: an instance that just
# lost its alive-lock (often with its other connections) must beat again long before
# one grace has passed.
FAILED_BEAT_RETRY_SECONDS = 0.5


@dataclass(frozen=True)
class HeartbeatPolicy:
    interval_seconds: float = 10
    slow_interval_seconds: float = 60
    stale_peer_probe_interval_seconds: float = 4
    liveness_source_mode: str = ADVISORY_LOCK_MODE
    enabled: bool = True

    @classmethod
    def from_settings(cls, settings: dict[str, Any]) -> HeartbeatPolicy:
        return cls(
            interval_seconds=settings["HEARTBEAT_INTERVAL_SECONDS"],
            slow_interval_seconds=settings["HEARTBEAT_SLOW_INTERVAL_SECONDS"],
            stale_peer_probe_interval_seconds=settings["STALE_PEER_PROBE_INTERVAL_SECONDS"],
            liveness_source_mode=settings["LIVENESS_SOURCE_MODE"],
            enabled=settings["HEARTBEAT_ENABLED"],
        )


def heartbeat_cadence(policy: HeartbeatPolicy, alive_lock_held: bool | None) -> float:
    """Seconds until the next beat; ``alive_lock_held`` is None with no lock source."""
    if policy.liveness_source_mode == TABLE_ONLY_MODE or not alive_lock_held:
        return policy.interval_seconds
    return policy.slow_interval_seconds


@dataclass(frozen=True)
class BeatResult:
    accepted: bool | None  # None: the call failed (logged; peers may reap us)
    cadence: float


class HeartbeatWorker(LoopService):
    """Beat at the cadence and probe for evictable peers until stopped or evicted."""

    name = "heartbeat"

    def __init__(
        self,
        coordinator: Coordinator,
        policy: HeartbeatPolicy,
        *,
        alive_lock_held: Callable[[], bool] | None = None,
        on_evicted: Callable[[], Any] | None = None,
        metadata: Callable[[], dict[str, Any]] | None = None,
        clock: Clock | None = None,
    ) -> None:
        super().__init__()
        self.coordinator = coordinator
        self.policy = policy
        self.alive_lock_held = alive_lock_held
        self.on_evicted = on_evicted
        self.metadata = metadata or dict
        self.clock = clock or SystemClock()
        self.beats = 0
        self.failed_beats = 0
        self.probes = 0
        self.reaped: list[Any] = []
        self.evicted = False
        self.last_beat_at: float | None = None
        self.next_eviction_in: float | None = None  # as the last probe said
        self._failed_in_a_row = 0
        self._wake = threading.Event()  # set by stop() and request_beat()
        self._beat_requested = False

    def cadence(self) -> float:
        """The beat cadence now, resolved from the alive-lock state every time."""
        held = None if self.alive_lock_held is None else self.alive_lock_held()
        return heartbeat_cadence(self.policy, held)

    def beat(self) -> BeatResult:
        """Record one heartbeat; on refusal mark this instance evicted and say so."""
        cadence = self.cadence()
        try:
            accepted = self.coordinator.heartbeat(self.metadata())
        except Exception as exc:  # noqa: BLE001 - a failed beat is retried next tick
            self.failed_beats += 1
            self._failed_in_a_row += 1
            logger.warning("heartbeat failed: %s", exc, extra={"action": "heartbeat_failed"})
            retry = FAILED_BEAT_RETRY_SECONDS * 2 ** (self._failed_in_a_row - 1)
            return BeatResult(accepted=None, cadence=min(cadence, retry))
        self._failed_in_a_row = 0
        self.beats += 1
        self.last_beat_at = self.clock.monotonic()
        if not accepted:
            self.evicted = True
            logger.error(
                "this instance %s was evicted by its peers: it stops claiming and exits",
                self.coordinator.identity.instance_id,
                extra={"action": "evicted"},
            )
            if self.on_evicted is not None:
                self.on_evicted()
        return BeatResult(accepted=accepted, cadence=cadence)

    def probe_peers(self) -> list[Any]:
        """Ask when a peer becomes evictable (a read); reap only when one is now."""
        self.probes += 1
        self.next_eviction_in = None
        try:
            due_in = self.coordinator.next_eviction_in()
            if due_in is None or due_in > 0:
                self.next_eviction_in = due_in
                return []
            evicted = self.coordinator.reap_stale()
        except Exception as exc:  # noqa: BLE001 - the next probe or maintenance retries
            logger.warning("stale-peer probe failed: %s", exc, extra={"action": "probe_failed"})
            return []
        if evicted:
            self.reaped.extend(evicted)
            logger.warning(
                "evicted stale instances %s",
                ", ".join(map(str, evicted)),
                extra={"action": "reaped"},
            )
        return list(evicted)

    def run_once(self, next_beat_at: float, next_probe_at: float) -> tuple[float, float]:
        """Do whatever is due now; return the next due times of beat and probe."""
        now = self.clock.monotonic()
        if self._beat_requested:
            self._beat_requested = False
            next_beat_at = now
        if self.last_beat_at is not None:
            # Resolved every tick: a lost alive-lock brings a slow-cadence beat forward.
            next_beat_at = min(next_beat_at, self.last_beat_at + self.cadence())
        if self.policy.enabled and now >= next_beat_at:
            result = self.beat()
            next_beat_at = now + result.cadence
        if now >= next_probe_at:
            self.probe_peers()
            next_probe_at = now + self.policy.stale_peer_probe_interval_seconds
            if self.next_eviction_in is not None:
                # a peer's grace ends before the next regular probe: look again then
                next_probe_at = min(
                    next_probe_at, now + self.next_eviction_in + PROBE_MARGIN_SECONDS
                )
        return next_beat_at, next_probe_at

    def run(self) -> None:
        """Loop until stopped or evicted."""
        if not self.policy.enabled:
            logger.warning(
                "heartbeats are disabled (HEARTBEAT_ENABLED=False): peers will evict this instance",
                extra={"action": "heartbeat_disabled"},
            )
        now = self.clock.monotonic()
        # The supervisor beat once before starting the claim; start with the cadence.
        next_beat = now + (self.cadence() if self.beats else 0)
        next_probe = now + self.policy.stale_peer_probe_interval_seconds
        while not self._stop.is_set() and not self.evicted:
            next_beat, next_probe = self.run_once(next_beat, next_probe)
            due = min(next_beat, next_probe) if self.policy.enabled else next_probe
            self._wake.wait(max(0.0, due - self.clock.monotonic()))
            self._wake.clear()

    def request_beat(self) -> None:
        """Beat now rather than at the cadence (the alive-lock was just lost: until this
        beat lands, a slow-cadence heartbeat may already look stale to peers)."""
        self._beat_requested = True
        self._wake.set()

    def _interrupt(self) -> None:
        self._wake.set()
