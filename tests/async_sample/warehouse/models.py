from django.db import models


class Notice(models.Model):
    """What the warehouse was told: one row per order placed."""

    order = models.IntegerField()

    def __str__(self) -> str:
        return f"order {self.order}"
