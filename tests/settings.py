"""Settings of the test suite: PostgreSQL from DATABASE_URL, else an embedded server."""

import json
import os

import environ

from django_workpump.embedded import embedded_database_url

env = environ.Env()

# The embedded server is started once, by the first process that reads these settings:
# the processes it starts (pytest -n workers) find its URL here and share it.
DATABASE_URL = env.str("DATABASE_URL", default="") or env.str("WORKPUMP_TESTS_EMBEDDED_URL", "")
if not DATABASE_URL:
    DATABASE_URL = os.environ["WORKPUMP_TESTS_EMBEDDED_URL"] = embedded_database_url()
DATABASES = {"default": env.db_url_config(DATABASE_URL)}
DATABASES["default"]["TEST"] = {"NAME": "test_" + DATABASES["default"]["NAME"]}
# A second database on the same server, for one pump per database (runworkpump
# --database). Its test database is created only for tests that name it. Under pytest -n
# pytest-django appends the worker's id to both test names (test_<name>_gw0).
DATABASES["second"] = {
    **DATABASES["default"],
    "NAME": DATABASES["default"]["NAME"] + "_second",
    "TEST": {"NAME": "test_" + DATABASES["default"]["NAME"] + "_second"},
}

SECRET_KEY = "tests-only-not-secret"
USE_TZ = True
TIME_ZONE = "UTC"
INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.admin",
    "django_workpump",
    "tests.app",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
ROOT_URLCONF = "tests.urls"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
# Subprocess tests (runworkpump) pass their timing settings as JSON.
WORKPUMP = json.loads(env.str("WORKPUMP_JSON", default="{}"))
