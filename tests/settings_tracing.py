"""tests.settings plus an OpenTelemetry SDK exporting every span to a file, one per line.

The runworkpump child of tests/api/test_tracing.py runs with ``--settings=tests.settings_tracing``
and ``WORKPUMP_TEST_SPANS`` naming the file; the test reads the spans back.
"""

import os

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

from tests.settings import *  # noqa: F403
from tests.settings import INSTALLED_APPS

INSTALLED_APPS = [*INSTALLED_APPS, "tests.tracing_app"]

_spans = open(os.environ["WORKPUMP_TEST_SPANS"], "a", encoding="utf-8")  # noqa: SIM115
_provider = TracerProvider()
_provider.add_span_processor(
    SimpleSpanProcessor(
        ConsoleSpanExporter(out=_spans, formatter=lambda span: span.to_json(indent=None) + "\n")
    )
)
trace.set_tracer_provider(_provider)
