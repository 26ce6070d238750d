from django.apps import AppConfig


class FaultsAppConfig(AppConfig):
    name = "tests.faults.app"
    label = "faultsapp"
