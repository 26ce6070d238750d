from django.apps import AppConfig
from django.db.models.signals import post_migrate
from django.utils.module_loading import autodiscover_modules


class WorkPumpConfig(AppConfig):
    name = "django_workpump"
    label = "workpump"
    verbose_name = "Work pump"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        import django_workpump.checks  # noqa: F401  (registers the system checks)
        from django_workpump import conf  # noqa: F401  (connects the setting_changed receiver)

        # Handlers live in <app>/workpump.py, found the way admin.py is.
        autodiscover_modules("workpump")

        from django_workpump.tasks import register_backends

        # One inbox handler per queue of each TASKS backend of ours (no-op without
        # django.tasks), so a fresh runworkpump can run task rows.
        register_backends()

        from django_workpump.subscriptions import sync_on_migrate

        # After migrate the project's code is loaded whole: the registry's subscriptions
        # replace the table SQL emit fans out from.
        post_migrate.connect(sync_on_migrate, sender=self, dispatch_uid="workpump_subscriptions")
