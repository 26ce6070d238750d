from django.apps import AppConfig


class PeriodicBenchConfig(AppConfig):
    name = "bench.periodic_app"
    label = "benchperiodic"
