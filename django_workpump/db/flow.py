"""Flow rules (docs/flow-control.md): setting them, syncing the code's declarations, and
reading how each stands (their functions in sql/schema.sql)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django_workpump.db.queries import _fetch, _scalar
from django_workpump.db.rows import FromRow


def set_flow_rule(
    *,
    kind: str,
    category: str,
    name: str,
    settings: dict[str, Any],
    declared: bool = False,
    now: datetime | None = None,
    using: str | None = None,
) -> int:
    """Create or change one rule; its id. ``settings``: what to set (None clears)."""
    params = {
        "kind": kind,
        "category": category,
        "name": name,
        "settings": json.dumps(settings),
        "declared": declared,
        "now": now,
    }
    return int(_scalar("set_flow_rule", params, using))


def sync_flow_rules(
    *, rules: list[dict[str, Any]], now: datetime | None = None, using: str | None = None
) -> int:
    """Set the code's declarations and clear those it no longer makes; rules declared."""
    return int(_scalar("sync_flow_rules", {"rules": json.dumps(rules), "now": now}, using))


def flag_flow_stragglers(*, batch: int, using: str | None = None) -> int:
    """Flag up to ``batch`` unflagged rows per category of topics with a rule."""
    return int(_scalar("flag_flow_stragglers", {"batch": batch}, using))


@dataclass(frozen=True)
class FlowRuleStatus(FromRow):
    """One rule as it stands: its limits, rows held now, tokens left, rows waiting."""

    id: int
    kind: str
    category: str
    name: str
    concurrency: int | None
    key_concurrency: int | None
    rate: float | None
    burst: float | None
    weight: int
    paused: bool
    in_flight: int | None
    tokens: float | None
    waiting: int | None

    @property
    def subject(self) -> str:
        if self.kind == "key":
            return f"key {self.name}"
        if self.kind == "category":
            return f"category {self.category}"
        return f"{self.category} {self.name}"


def flow_rule_status(
    *,
    waiting_cap: int = 10_000,
    category: str | None = None,
    topic: str | None = None,
    now: datetime | None = None,
    using: str | None = None,
) -> list[FlowRuleStatus]:
    """Every rule as it stands; with ``category`` and ``topic``, the rules holding that
    topic back (its own and its category's)."""
    params = {"waiting_cap": waiting_cap, "category": category, "topic": topic, "now": now}
    rows = _fetch("flow_rule_status", params, using)
    return [FlowRuleStatus.from_row(row) for row in rows]


def flow_reason(
    *,
    category: str,
    topic: str,
    concurrency_key: str,
    fairness_key: str,
    now: datetime | None = None,
    using: str | None = None,
) -> str | None:
    """Why a flow-controlled row waits now ("waiting: concurrency cap ... 5/5"), or None."""
    params = {
        "category": category,
        "topic": topic,
        "concurrency_key": concurrency_key,
        "fairness_key": fairness_key,
        "now": now,
    }
    return _scalar("flow_reason", params, using)
