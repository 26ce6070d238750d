"""Bulk actions on a changelist's search result: retry, re-queue, cancel, dead-letter or
release every row the filters and search select, up to ``BULK_MAX_ROWS`` (docs/admin.md).

The page ``<changelist>/bulk/<action>/?<the changelist's query>`` counts the rows and
shows which run now (leased by a live instance), then runs the action in chunks the page
drives: each POST works through batches of ``BULK_BATCH_ROWS`` rows in seq order, one
transaction each, for at most ``BULK_REQUEST_SECONDS``, and answers with a page that
posts the next chunk (a cursor: the last seq done), so no request runs long. Each batch
locks its rows and calls the same SQL function as the single-row action; rows a live
instance holds are left alone unless the operator ticks "also the running rows", which
releasing needs the force permission for.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.db import transaction
from django.db.models import Q, QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse

from django_workpump.admin.base import pump_database
from django_workpump.admin.expressions import HOLDER_LIVE
from django_workpump.admin.work_actions import admin_reason
from django_workpump.conf import get_settings
from django_workpump.dead_letters import log_when_committed

BULK_MAX_ROWS = 100_000  # the most rows one bulk action goes through
BULK_BATCH_ROWS = 1_000  # rows per transaction
BULK_REQUEST_SECONDS = 2.0  # one request stops starting batches after this long
RUNNING_SHOWN = 20  # running rows listed by name on the confirmation page


@dataclass(frozen=True)
class BulkAction:
    name: str
    label: str
    permission: str  # the single-row action's codename
    query: str  # the named query of sql/admin.sql
    changes: str  # which rows it changes (the others are left alone)


BULK_ACTIONS = {
    a.name: a
    for a in [
        BulkAction("retry", "Retry now", "retry_work", "retry_now", "scheduled rows"),
        BulkAction("requeue", "Re-queue dead rows", "requeue_work", "requeue_dead", "dead rows"),
        BulkAction("cancel", "Cancel", "cancel_work", "cancel_work", "undone rows"),
        BulkAction("dead-letter", "Dead-letter", "dead_letter_work", "dead_letter", "undone rows"),
        BulkAction(
            "release",
            "Release leases",
            "release_work_lease",
            "release_leases",
            "held rows whose holder is not live",
        ),
    ]
}


def running(queryset: QuerySet[Any]) -> QuerySet[Any]:
    """The rows of an annotated work queryset that a live instance holds now."""
    return queryset.filter(Q(instance_id__isnull=False) & Q(wp_holder=HOLDER_LIVE))


class BulkActionsAdmin:
    """The bulk page of a work admin (mixed into WorkAdmin)."""

    @property
    def bulk_choices(self) -> list[tuple[str, str]]:
        """The changelist's links to the bulk page: (action, label)."""
        return [(a.name, f"Bulk: {a.label.lower()}") for a in BULK_ACTIONS.values()]

    def bulk_urls(self) -> list[URLPattern]:
        view = self.admin_site.admin_view(self.bulk_view)  # type: ignore[attr-defined]
        return [path("bulk/<str:action>/", view, name=self._bulk_url_name())]

    def _bulk_url_name(self) -> str:
        opts = self.opts  # type: ignore[attr-defined]
        return f"{opts.app_label}_{opts.model_name}_bulk"

    def _may(self, request: HttpRequest, action: BulkAction) -> bool:
        return bool(getattr(self, f"has_{action.permission}_permission")(request))

    def bulk_view(self, request: HttpRequest, action: str) -> HttpResponse:
        found = BULK_ACTIONS.get(action)
        if found is None:
            raise PermissionDenied(f"Unknown bulk action {action!r}.")
        admin: Any = self
        if not admin.has_view_or_change_permission(request):
            raise PermissionDenied
        # the changelist's own result (its filters and search, applied once)
        selected = admin.get_changelist_instance(request).queryset
        if request.method == "POST":
            if not self._may(request, found):
                raise PermissionDenied(f"You may not {found.label.lower()} {admin.opts}.")
            return self._bulk_chunk(request, found, selected)
        return self._bulk_page(request, found, selected)

    def _bulk_page(
        self, request: HttpRequest, action: BulkAction, selected: QuerySet[Any], **more: Any
    ) -> TemplateResponse:
        admin: Any = self
        opts = admin.model._meta
        matching = selected.order_by().values("pk")[: BULK_MAX_ROWS + 1].count()
        live = running(selected).order_by("seq")
        context = {
            **admin.admin_site.each_context(request),
            "title": f"{action.label}: {opts.verbose_name_plural} of this search",
            "opts": opts,
            "action": action,
            "matching": min(matching, BULK_MAX_ROWS),
            "over_cap": matching > BULK_MAX_ROWS,
            "cap": BULK_MAX_ROWS,
            "batch": BULK_BATCH_ROWS,
            "running_count": live.values("pk")[:BULK_MAX_ROWS].count(),
            "running_shown": list(live[:RUNNING_SHOWN]),
            "may_act": self._may(request, action),
            "may_force": action.name != "release"
            or admin.has_force_release_work_lease_permission(request),
            "changelist_url": self._changelist_url(request),
            **more,
        }
        request.current_app = admin.admin_site.name
        return TemplateResponse(request, "admin/workpump/bulk_action.html", context)

    def _changelist_url(self, request: HttpRequest) -> str:
        opts = self.opts  # type: ignore[attr-defined]
        url = reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist")
        query = request.GET.urlencode()
        return f"{url}?{query}" if query else url

    def _bulk_chunk(
        self, request: HttpRequest, action: BulkAction, selected: QuerySet[Any]
    ) -> HttpResponse:
        admin: Any = self
        try:
            cursor = int(request.POST.get("cursor", "0"))
            tally = {k: int(request.POST.get(k, "0")) for k in ("seen", "changed", "running")}
        except ValueError:
            raise PermissionDenied("The bulk action's progress fields are not numbers.") from None
        force = request.POST.get("force") == "yes"
        if (
            force
            and action.name == "release"
            and not admin.has_force_release_work_lease_permission(request)
        ):
            raise PermissionDenied("Releasing a live instance's leases needs force permission.")
        started = time.monotonic()
        finished = False
        batches = 0  # at least one per request, however long the last one took
        while not finished and (batches == 0 or time.monotonic() - started < BULK_REQUEST_SECONDS):
            size = min(BULK_MAX_ROWS - tally["seen"], BULK_BATCH_ROWS)
            if size <= 0:
                break  # the cap
            seen, changed, skipped, cursor = self._bulk_batch(
                request, action, selected, cursor, size, force
            )
            batches += 1
            tally["seen"] += seen
            tally["changed"] += changed
            tally["running"] += skipped
            finished = seen < size
        finished = finished or tally["seen"] >= BULK_MAX_ROWS
        if not finished:
            return self._bulk_page(
                request, action, selected, progress=True, cursor=cursor, force=force, **tally
            )
        rows = f"{tally['seen']:,} {admin.opts.verbose_name_plural}"
        admin.message_user(
            request,
            f"{action.label}: went through {rows}; changed {tally['changed']:,}, left "
            f"{tally['seen'] - tally['changed']:,} as they were (only {action.changes} change"
            + (
                f"; {tally['running']:,} running on a live instance "
                f"{'was' if tally['running'] == 1 else 'were'} left alone"
                if tally["running"]
                else ""
            )
            + ").",
            messages.SUCCESS if tally["changed"] else messages.WARNING,
        )
        return HttpResponseRedirect(self._changelist_url(request))

    def _bulk_batch(
        self,
        request: HttpRequest,
        action: BulkAction,
        selected: QuerySet[Any],
        cursor: int,
        size: int,
        force: bool,
    ) -> tuple[int, int, int, int]:
        """One batch in one transaction: (rows gone through, changed, running rows left
        alone, the new cursor)."""
        admin: Any = self
        settings = get_settings()
        with transaction.atomic(using=pump_database()):
            seqs = list(
                selected.filter(seq__gt=cursor).order_by("seq").values_list("seq", flat=True)[:size]
            )
            if not seqs:
                return 0, 0, 0, cursor
            # Lock them, then read who holds them: a claim skips a locked row and a holder's
            # outcome waits for this commit, so what is read here stays true until then. A
            # row claimed since the first read shows its holder; one that left the search
            # since (e.g. done) drops out.
            batch = list(
                selected.filter(seq__in=seqs)
                .order_by("seq")
                .select_for_update(of=("self",))
                .values_list("seq", "work_id", "instance_id", "wp_holder")
            )
            ids = [row[1] for row in batch]
            held_live = {row[1] for row in batch if row[2] is not None and row[3] == HOLDER_LIVE}
            skipped = 0
            if not force and action.name in ("cancel", "dead-letter"):
                ids = [i for i in ids if i not in held_live]
                skipped = len(held_live)
            params: dict[str, Any] = {"ids": ids}
            user = request.user.get_username()
            if action.name == "dead-letter":
                params["reason"] = admin_reason(user)
            if action.name == "release":
                params.update(
                    force=force,
                    stale_after_seconds=settings["STALE_AFTER_SECONDS"],
                    definitively_dead_after_seconds=settings["DEFINITIVELY_DEAD_AFTER_SECONDS"],
                )
                if not force:
                    skipped = len(held_live)
            changed = admin._run(action.query, **params) if ids else set()
            if action.name == "dead-letter" and changed:
                log_when_committed(
                    admin.spec.category,
                    changed,
                    params["reason"],
                    by=f"{user!r} in the admin (bulk)",
                    using=settings["DATABASE_ALIAS"],
                )
        return len(seqs), len(changed), skipped, seqs[-1]
