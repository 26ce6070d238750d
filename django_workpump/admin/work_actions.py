"""The operator actions of the work admins (retry, release, dead-letter, re-queue,
cancel), each through the SQL function that keeps leases fenced, and their confirmation
page (docs/admin.md).
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.utils import model_ngettext
from django.db.models import QuerySet
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.utils.html import format_html

from django_workpump import db
from django_workpump.actions import MAX_REASON_CHARS
from django_workpump.admin.base import WorkpumpModelAdmin, pump_database
from django_workpump.admin.expressions import ADMIN_QUERIES, HOLDER_LIVE, WorkSpec
from django_workpump.admin.perms import has_model_permission
from django_workpump.conf import get_settings
from django_workpump.dead_letters import log_when_committed

# The most rows one admin action changes: "select all" over a large table is refused
# with a message instead of one statement that locks every row.
MAX_ACTION_ROWS = 1_000


def admin_reason(username: str) -> str:
    """The failure reason of rows a user dead-lettered in the admin, cut to fit its column
    (the dead-letter's ERROR log line names the user in full)."""
    reason = f"dead-lettered in the admin by {username}"
    return reason if len(reason) <= MAX_REASON_CHARS else reason[: MAX_REASON_CHARS - 1] + "…"


class WorkActionsAdmin(WorkpumpModelAdmin):
    """The operator actions of a work admin and their permissions, over ``spec``'s table."""

    spec: WorkSpec
    actions = [
        "retry_now",
        "release_lease",
        "force_release_lease",
        "dead_letter",
        "requeue_dead",
        "cancel",
    ]

    # -- permissions of the actions

    def has_retry_work_permission(self, request: HttpRequest) -> bool:
        return has_model_permission(request, self.model, "retry_work")

    def has_release_work_lease_permission(self, request: HttpRequest) -> bool:
        return has_model_permission(request, self.model, "release_work_lease")

    def has_force_release_work_lease_permission(self, request: HttpRequest) -> bool:
        return has_model_permission(request, self.model, "force_release_work_lease")

    def has_dead_letter_work_permission(self, request: HttpRequest) -> bool:
        return has_model_permission(request, self.model, "dead_letter_work")

    def has_requeue_work_permission(self, request: HttpRequest) -> bool:
        return has_model_permission(request, self.model, "requeue_work")

    def has_cancel_work_permission(self, request: HttpRequest) -> bool:
        return has_model_permission(request, self.model, "cancel_work")

    # -- actions

    def _ids(self, queryset: QuerySet[Any]) -> list[Any]:
        return list(queryset.values_list("work_id", flat=True))

    def _too_many(self, request: HttpRequest, queryset: QuerySet[Any]) -> bool:
        """Refuse (with a message) a selection over MAX_ACTION_ROWS, e.g. "select all"."""
        selected = len(queryset.values_list("pk", flat=True)[: MAX_ACTION_ROWS + 1])
        if selected <= MAX_ACTION_ROWS:
            return False
        self.message_user(
            request,
            f"More than {MAX_ACTION_ROWS:,} {model_ngettext(self.opts, 2)} selected: an action "
            f"changes at most {MAX_ACTION_ROWS:,} at a time. Narrow the selection with the "
            "filters, or use manage.py workpump_action for bulk changes.",
            messages.ERROR,
        )
        return True

    def _run(self, name: str, **params: Any) -> set[Any]:
        rows = db.fetch_named(ADMIN_QUERIES, name, {"category": self.spec.category, **params})
        return {row["id"] for row in rows}

    def _rows(self, count: int) -> str:
        return f"{count} {model_ngettext(self.opts, count)}"

    @admin.action(permissions=["retry_work"], description="Retry now (scheduled → pending)")
    def retry_now(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        if self._too_many(request, queryset):
            return
        ids = self._ids(queryset)
        changed = self._run("retry_now", ids=ids)
        if changed:
            self.message_user(request, f"Retried {self._rows(len(changed))} now.", messages.SUCCESS)
        if skipped := len(ids) - len(changed):
            self.message_user(
                request,
                f"{self._rows(skipped)} left as they were: only scheduled rows (waiting for a "
                "retry or a deferral; not leased, done or dead) can be retried now.",
                messages.WARNING,
            )

    @admin.action(
        permissions=["release_work_lease"],
        description="Release lease (held → pending; not from a live instance)",
    )
    def release_lease(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        if self._too_many(request, queryset):
            return
        self._release(request, queryset, force=False)

    @admin.action(
        permissions=["force_release_work_lease"],
        description="Force-release lease, even from a live instance (asks first)",
    )
    def force_release_lease(
        self, request: HttpRequest, queryset: QuerySet[Any]
    ) -> TemplateResponse | None:
        if self._too_many(request, queryset):
            return None
        if request.POST.get("post") != "yes":
            return self._confirm(
                request,
                queryset,
                action="force_release_lease",
                title="Force-release leases?",
                warning=(
                    "A live instance may still be running these rows: released, they can be "
                    "claimed again and run twice. Its late completion is fenced out."
                ),
                button="Yes, release these leases",
            )
        self._release(request, queryset, force=True)
        return None

    def _release(self, request: HttpRequest, queryset: QuerySet[Any], *, force: bool) -> None:
        settings = get_settings()
        ids = self._ids(queryset)
        released = self._run(
            "release_leases",
            ids=ids,
            force=force,
            stale_after_seconds=settings["STALE_AFTER_SECONDS"],
            definitively_dead_after_seconds=settings["DEFINITIVELY_DEAD_AFTER_SECONDS"],
        )
        if released:
            self.message_user(
                request,
                f"Released the leases of {self._rows(len(released))}; they can be claimed again.",
                messages.SUCCESS,
            )
        # What is still held after the call was refused: its holder is live.
        refused = (
            self.model._default_manager.using(pump_database())
            .filter(
                work_id__in=ids,
                done_at__isnull=True,
                instance_id__isnull=False,
            )
            .count()
        )
        if refused:
            self.message_user(
                request,
                f"{self._rows(refused)} not released: held by a live instance, which may "
                "still be running them. Use “Force-release lease” if that instance is hung.",
                messages.ERROR,
            )
        if unheld := len(ids) - len(released) - refused:
            self.message_user(
                request, f"{self._rows(unheld)} had no lease to release.", messages.WARNING
            )

    @admin.action(
        permissions=["dead_letter_work"],
        description="Dead-letter (park as dead; asks first for rows a live instance holds)",
    )
    def dead_letter(self, request: HttpRequest, queryset: QuerySet[Any]) -> TemplateResponse | None:
        if self._too_many(request, queryset):
            return None
        held_live = any(
            obj.instance_id is not None and obj.wp_holder == HOLDER_LIVE for obj in queryset
        )
        if held_live and request.POST.get("post") != "yes":
            return self._confirm(
                request,
                queryset,
                action="dead_letter",
                title="Dead-letter rows a live instance is running?",
                warning=(
                    "A live instance holds some of these rows and may be running them now: "
                    "dead-lettered, their handlers' outcomes are fenced out, but what the "
                    "handlers already did is not undone."
                ),
                button="Yes, dead-letter these rows",
            )
        self._dead_letter(request, queryset)
        return None

    def _dead_letter(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        ids = self._ids(queryset)
        user = request.user.get_username()
        reason = admin_reason(user)
        changed = self._run("dead_letter", ids=ids, reason=reason)
        log_when_committed(
            self.spec.category,
            changed,
            reason,
            by=f"{user!r} in the admin",
            using=get_settings()["DATABASE_ALIAS"],
        )
        if changed:
            self.message_user(
                request,
                f"Dead-lettered {self._rows(len(changed))}; they are never claimed again "
                "until re-queued.",
                messages.SUCCESS,
            )
        if skipped := len(ids) - len(changed):
            self.message_user(
                request,
                f"{self._rows(skipped)} left as they were: already done or dead.",
                messages.WARNING,
            )

    @admin.action(permissions=["requeue_work"], description="Re-queue dead rows (attempts reset)")
    def requeue_dead(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        if self._too_many(request, queryset):
            return
        ids = self._ids(queryset)
        changed = self._run("requeue_dead", ids=ids)
        if changed:
            self.message_user(
                request,
                f"Re-queued {self._rows(len(changed))}: attempts reset to 0, last error kept.",
                messages.SUCCESS,
            )
        if skipped := len(ids) - len(changed):
            self.message_user(
                request,
                f"{self._rows(skipped)} left as they were: only dead rows can be re-queued.",
                messages.WARNING,
            )

    @admin.action(
        permissions=["cancel_work"],
        description="Cancel (end as cancelled; asks first for rows a live instance runs)",
    )
    def cancel(self, request: HttpRequest, queryset: QuerySet[Any]) -> TemplateResponse | None:
        if self._too_many(request, queryset):
            return None
        held = any(obj.instance_id is not None for obj in queryset)
        if held and request.POST.get("post") != "yes":
            return self._confirm(
                request,
                queryset,
                action="cancel",
                title="Cancel rows that are running?",
                warning=(
                    "Some of these rows are leased: their handlers are told to stop at once "
                    "(work.cancelled; an async handler's task is cancelled) and what they "
                    "report later is fenced out, but what they already did is not undone."
                ),
                button="Yes, cancel these rows",
            )
        ids = self._ids(queryset)
        changed = self._run("cancel_work", ids=ids)
        if changed:
            self.message_user(
                request,
                f"Cancelled {self._rows(len(changed))}; they never run again and their "
                "streams move on.",
                messages.SUCCESS,
            )
        if skipped := len(ids) - len(changed):
            self.message_user(
                request,
                f"{self._rows(skipped)} left as they were: already ended (done, cancelled or "
                "discarded).",
                messages.WARNING,
            )
        return None

    def _confirm(
        self,
        request: HttpRequest,
        queryset: QuerySet[Any],
        *,
        action: str,
        title: str,
        warning: str,
        button: str,
    ) -> TemplateResponse:
        return confirmation(
            self,
            request,
            queryset,
            action=action,
            title=title,
            warning=warning,
            button=button,
            describe=lambda obj: format_html(
                "{} — {} {}, held by {}",
                obj,
                obj.wp_state,
                "(stuck)" if obj.wp_stuck else "",
                (obj.wp_owner_label or obj.instance_id or "nobody")
                if obj.instance_id is None or obj.wp_holder == HOLDER_LIVE
                else f"{obj.wp_owner_label or obj.instance_id} ({obj.wp_holder})",
            ),
        )


def confirmation(
    model_admin: admin.ModelAdmin,
    request: HttpRequest,
    queryset: QuerySet[Any],
    *,
    action: str,
    title: str,
    warning: str,
    button: str,
    describe: Any,
) -> TemplateResponse:
    """An intermediate page that posts the same action back with ``post=yes``."""
    opts = model_admin.model._meta
    context = {
        **model_admin.admin_site.each_context(request),
        "title": title,
        "subtitle": None,
        "opts": opts,
        "app_label": opts.app_label,
        "action": action,
        "warning": warning,
        "button": button,
        "objects": [(obj.pk, describe(obj)) for obj in queryset],
        "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
        "media": model_admin.media,
    }
    request.current_app = model_admin.admin_site.name
    return TemplateResponse(request, "admin/workpump/confirm_action.html", context)
