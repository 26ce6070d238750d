"""Per-model checks of the operator permissions (the models' ``Meta.permissions``).

The four work models share the codenames ``retry_work``, ``release_work_lease``,
``force_release_work_lease``, ``dead_letter_work``, ``requeue_work`` and ``cancel_work``,
so ``user.has_perm("workpump.retry_work")`` alone cannot tell an outbox grant from a
receptor grant. An action therefore needs the
permission on its own model's content type, read once per request (one query for every
workpump permission of the user). The summary and the console show every category and
instance: ``can_view_summary`` asks for view access to each.
"""

from __future__ import annotations

from django.contrib import admin
from django.contrib.auth.models import Permission
from django.db import models
from django.db.models import Q
from django.http import HttpRequest

from django_workpump.models import (
    Inbox,
    Outbox,
    PerspectiveEvent,
    ReceptorProcessing,
    ServiceInstance,
)

_CACHE_ATTRIBUTE = "_workpump_permissions"


def has_model_permission(request: HttpRequest, model: type[models.Model], codename: str) -> bool:
    """Whether the user holds ``codename`` on ``model`` itself (superusers hold all)."""
    user = request.user
    if not user.is_active or not user.is_staff:
        return False
    if user.is_superuser:
        return True
    app_label = model._meta.app_label
    # Any authentication backend may refuse it; the model-backend grant names the model.
    if not user.has_perm(f"{app_label}.{codename}"):
        return False
    granted: set[tuple[str, str]] | None = getattr(request, _CACHE_ATTRIBUTE, None)
    if granted is None:
        granted = set(
            Permission.objects.filter(
                Q(user=user) | Q(group__user=user), content_type__app_label=app_label
            ).values_list("content_type__model", "codename")
        )
        setattr(request, _CACHE_ATTRIBUTE, granted)
    return (model._meta.model_name, codename) in granted


# What the summary and the console list: the four work models and the instances.
SUMMARY_MODELS = (Outbox, Inbox, PerspectiveEvent, ReceptorProcessing, ServiceInstance)


def can_view_summary(site: admin.AdminSite, request: HttpRequest) -> bool:
    """The summary shows every category and instance: it needs view access to each."""
    registry = site._registry
    return all(m in registry and registry[m].has_view_permission(request) for m in SUMMARY_MODELS)
