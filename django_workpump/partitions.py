"""The stream partition hash, identical to ``workpump.partition_of`` in SQL."""

from __future__ import annotations

import hashlib


def partition_of(key: str, partition_count: int = 10_000) -> int:
    """First 32 bits of the key's MD5, modulo ``partition_count``."""
    if partition_count < 1:
        raise ValueError(f"partition_count must be >= 1, not {partition_count}.")
    digest = hashlib.md5(key.encode(), usedforsecurity=False).hexdigest()
    return int(digest[:8], 16) % partition_count
