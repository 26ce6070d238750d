"""Timestamps written by the benchmark handlers of all three systems.

Every mark is one line appended to the file named by ``BENCH_MARKS`` with a single
``write`` (atomic for short lines), stamped with CLOCK_MONOTONIC, which every process of
this machine shares, so producer and worker times can be subtracted.
"""

from __future__ import annotations

import os
import time

_PATH = os.environ.get("BENCH_MARKS")
_first_seen = False


def now_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def _write(line: str) -> None:
    if not _PATH:
        return
    fd = os.open(_PATH, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def first_start() -> None:
    """Mark the first handler start of this process (later calls cost one check)."""
    global _first_seen
    if _first_seen:
        return
    _first_seen = True
    _write(f"first {os.getpid()} {now_ns()}\n")


def handler_start(key: int) -> None:
    """Mark the start of the handler of latency job ``key``."""
    t = now_ns()
    _write(f"lat {key} {t}\n")


def mark(kind: str, key: int, *extra: str) -> None:
    """Mark event ``kind`` of job ``key`` now (with optional extra words)."""
    t = now_ns()
    _write(" ".join([kind, str(key), str(t), *extra]) + "\n")
