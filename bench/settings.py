"""Django settings of the benchmark worker: ``runworkpump --settings=bench.settings``.

The database comes from DATABASE_URL (the bench's own database), WORKPUMP from
WORKPUMP_JSON ("{}" = the documented defaults).
"""

import json
import os

import environ

env = environ.Env()

DATABASES = {"default": env.db_url_config(os.environ["DATABASE_URL"])}
# Django's default CONN_MAX_AGE is 0; BENCH_CONN_MAX_AGE ("none" = persistent) changes it.
if os.environ.get("BENCH_CONN_MAX_AGE"):
    value = os.environ["BENCH_CONN_MAX_AGE"]
    DATABASES["default"]["CONN_MAX_AGE"] = None if value == "none" else int(value)
SECRET_KEY = "bench-only-not-secret"
USE_TZ = True
TIME_ZONE = "UTC"
INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django_workpump",
    "bench.app",
]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
WORKPUMP = json.loads(os.environ.get("WORKPUMP_JSON") or "{}")
