"""The benchmark's one table: what the ORM-insert handler writes."""

from django.db import models


class BenchRecord(models.Model):
    """One row per job the ORM handler ran (its payload's ``i``)."""

    n = models.IntegerField()

    def __str__(self) -> str:
        return f"bench record {self.n}"
