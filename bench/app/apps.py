from django.apps import AppConfig


class BenchAppConfig(AppConfig):
    name = "bench.app"
    label = "benchapp"
