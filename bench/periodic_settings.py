"""Settings of bench/periodic_lateness.py: bench.settings plus the periodic schedule."""

from bench.settings import *  # noqa: F403

INSTALLED_APPS = [*INSTALLED_APPS, "bench.periodic_app"]  # noqa: F405
