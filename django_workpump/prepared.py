"""Named queries run as statements prepared once per database session.

PostgreSQL parses and plans a statement sent as text on every call. For the claim, which
runs on every NOTIFY wake-up and usually meets an idle server backend, that was about a
tenth of the call. A prepared statement is parsed and planned once per session.

Statements are prepared with SQL ``PREPARE`` under a name unique to this process, not
with the driver's protocol-level names (``_pg3_0``, the same in every client): behind a
transaction pooler that hands one server session to many clients, no other client's
statement can answer to this name. When a connection's session loses the statement
under it (a transaction pooler moved the connection to another server session, or
someone ran ``DISCARD ALL``), ``EXECUTE`` finds none: nothing ran, so the call is sent
again as plain text, and preparing stops for the rest of the process with one warning.

Only a statement that is its own transaction is prepared: an error inside a caller's
transaction would abort it. Connections that bind parameters server-side (Django's
``server_side_binding`` option) send plain text too, as ``EXECUTE`` cannot take
protocol-level parameters.
"""

from __future__ import annotations

import logging
import re
import threading
import uuid
import weakref
from typing import Any

import psycopg

logger = logging.getLogger("django_workpump.db")

# PostgreSQL's SQLSTATEs for "no prepared statement of that name" and "already exists".
STATEMENT_MISSING = "26000"
STATEMENT_EXISTS = "42P05"
_PLACEHOLDER = re.compile(r"%\((\w+)\)s")
# One prefix per process: a statement name no other client uses.
_PROCESS_TAG = uuid.uuid4().hex[:16]


class PreparedQuery:
    """One named query as a prepared statement: ``param_types`` gives the SQL type of
    each of its placeholders."""

    def __init__(self, name: str, text: str, param_types: dict[str, str]) -> None:
        names = list(dict.fromkeys(_PLACEHOLDER.findall(text)))
        if set(names) != set(param_types):
            raise ValueError(
                f"Query {name!r} has the placeholders {sorted(names)}; param_types names "
                f"{sorted(param_types)}."
            )
        self.statement = f"workpump_{name}_{_PROCESS_TAG}"
        body = _PLACEHOLDER.sub(lambda m: f"${names.index(m.group(1)) + 1}", text)
        types = ", ".join(param_types[n] for n in names)
        self.prepare_sql = f"PREPARE {self.statement} ({types}) AS {body}"
        self.execute_sql = f"EXECUTE {self.statement} ({', '.join(f'%({n})s' for n in names)})"
        self.text = text
        # the psycopg connections whose session holds the statement
        self._prepared: weakref.WeakSet[Any] = weakref.WeakSet()
        self._lock = threading.Lock()
        self.disabled: str | None = None  # why preparing stopped, if it did

    def execute(
        self, cursor: psycopg.Cursor[Any], params: dict[str, Any], *, own_transaction: bool
    ) -> None:
        """Run the query on psycopg cursor ``cursor``: prepared when it can be."""
        if (
            self.disabled is not None
            or not own_transaction
            or not isinstance(cursor, psycopg.ClientCursor)
        ):
            cursor.execute(self.text, params)
            return
        connection = cursor.connection
        if connection not in self._prepared:
            try:
                cursor.execute(self.prepare_sql)
            except psycopg.Error as exc:
                if exc.sqlstate != STATEMENT_EXISTS:
                    raise
            with self._lock:
                self._prepared.add(connection)
        try:
            cursor.execute(self.execute_sql, params)
        except psycopg.Error as exc:
            if exc.sqlstate != STATEMENT_MISSING:
                raise
            self._stop(str(exc).splitlines()[0])
            cursor.execute(self.text, params)

    def _stop(self, error: str) -> None:
        with self._lock:
            if self.disabled is not None:
                return
            self.disabled = error
            self._prepared = weakref.WeakSet()
        logger.warning(
            "%s is no longer prepared in this process: its session lost the prepared "
            "statement (%s). A transaction pooler between the pump and PostgreSQL does "
            "this; each call is now parsed and planned again. Set "
            "WORKPUMP['PREPARED_STATEMENTS'] = False to skip the attempt.",
            self.statement,
            error,
            extra={"action": "prepared_statement_lost"},
        )
