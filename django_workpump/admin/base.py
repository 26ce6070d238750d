"""What every workpump admin page shares: it reads and writes the pump's database, and
its queries run in one transaction without JIT.

The pump, the producers, the SQL of the admin's actions and the summary all use
``WORKPUMP["DATABASE_ALIAS"]``; so do the admin's querysets (``pump_database``), rather
than whatever database the project's routers pick for the workpump models: a page and
its actions always see the same rows, also when that alias is not ``default``.

The pages' queries are short and interactive, but the planner may cost some of them
(the liveness and stuck rules per row) past ``jit_above_cost``; compiling them then
takes longer than running them, and how long depends on the server's JIT setting. A
page runs in one transaction with ``SET LOCAL jit = off`` (``db.without_jit``), its
template rendered inside it: a ``TemplateResponse`` renders lazily, and the page's rows
are fetched while it renders. On every page a stored time Python's datetime cannot hold
('infinity', past year 9999: anyone with table access can write one) reads as its text
(``db.StoredTime``) and shows as stored, rather than failing the page.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import SimpleTemplateResponse

from django_workpump import db
from django_workpump.conf import setting


def pump_database() -> str:
    """The alias of the database the pump works on (``WORKPUMP["DATABASE_ALIAS"]``)."""
    return str(setting("DATABASE_ALIAS"))


class PumpDatabaseAdmin(admin.ModelAdmin):
    """A ModelAdmin whose rows are read, and saved, on ``pump_database()``; its list and
    detail pages show a stored time Python cannot hold as stored
    (``rendered_with_stored_times``)."""

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        # A row fetched here is saved back to the database it came from.
        return super().get_queryset(request).using(pump_database())

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        parent = super().changelist_view
        return rendered_with_stored_times(lambda: parent(request, extra_context))

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        parent = super().change_view
        return rendered_with_stored_times(
            lambda: parent(request, object_id, form_url, extra_context)
        )


def rendered_without_jit(model: Any, view: Callable[[], HttpResponse]) -> HttpResponse:
    """The response of ``view``, run and rendered in one transaction without JIT."""
    with db.without_jit(using=pump_database()):
        return _rendered(view)


def rendered_with_stored_times(view: Callable[[], HttpResponse]) -> HttpResponse:
    """The response of ``view``, run and rendered with every time Python cannot hold
    (written through SQL) read as its stored text (``db.StoredTime``)."""
    with db.stored_times_readable(using=pump_database()):
        return _rendered(view)


def _rendered(view: Callable[[], HttpResponse]) -> HttpResponse:
    response = view()
    if isinstance(response, SimpleTemplateResponse) and not response.is_rendered:
        response.render()
    return response


class WorkpumpModelAdmin(PumpDatabaseAdmin):
    """A ModelAdmin on the pump's database whose list and detail pages run without JIT
    (``rendered_without_jit``)."""

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        parent = super().changelist_view
        return rendered_without_jit(self.model, lambda: parent(request, extra_context))

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        parent = super().change_view
        return rendered_without_jit(
            self.model, lambda: parent(request, object_id, form_url, extra_context)
        )
