"""Settings of the sample project: the database from ``DATABASE_URL``."""

import environ

env = environ.Env()

DATABASES = {"default": env.db_url("DATABASE_URL")}
SECRET_KEY = "sample-only-not-secret"
USE_TZ = True
TIME_ZONE = "UTC"
INSTALLED_APPS = ["django_workpump", "warehouse"]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
WORKPUMP: dict[str, object] = {}
