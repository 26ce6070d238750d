"""The admin console's per-minute series (docs/console.md), in a module of their own.

Written only by SQL: the work tables' counting trigger (ConsoleCount, ConsoleTotal) and
the maintenance worker's sample (the rest; ConsoleRollup is folded from ConsoleCount);
read by the console's pages through ``db.console``. ``models`` imports them, so Django
finds them as the app's models.
"""

from __future__ import annotations

from django.db import models

from django_workpump.fields import IntegerArrayField


class ConsoleCount(models.Model):
    """Rows that ended one way (or were claimed, renewed) in a minute, per topic and
    instance; for claims, a pickup-latency histogram (``workpump.console_latency_bounds``)."""

    pk = models.CompositePrimaryKey("minute", "category", "topic", "outcome", "instance_id")
    minute = models.DateTimeField()
    category = models.TextField()
    topic = models.TextField()
    outcome = models.TextField()  # claimed, renewed, done, failed, dead, released, ...
    instance_id = models.UUIDField()  # the nil uuid: no holder (an operator's action)
    n = models.BigIntegerField()
    latency = IntegerArrayField(null=True)

    class Meta:
        db_table = "workpump_console_count"

    def __str__(self) -> str:
        return f"{self.minute} {self.category} {self.topic} {self.outcome}: {self.n}"


class ConsoleTotal(models.Model):
    """ConsoleCount summed over categories and topics: per minute, outcome and instance,
    so the console's whole-pump charts read a few rows a minute, not one per topic. Folded
    by the sampler once a 10-minute bucket is complete; ``workpump.console_totals`` reads
    the counters after it."""

    pk = models.CompositePrimaryKey("minute", "outcome", "instance_id")
    minute = models.DateTimeField()
    outcome = models.TextField()
    instance_id = models.UUIDField()
    n = models.BigIntegerField()
    latency = IntegerArrayField(null=True)

    class Meta:
        db_table = "workpump_console_total"

    def __str__(self) -> str:
        return f"{self.minute} {self.outcome}: {self.n}"


class ConsoleRollup(models.Model):
    """ConsoleCount in 10-minute buckets, summed over instances (``minute``: the bucket's
    first), folded by the sampler once a bucket is complete: the day window reads a
    sixth of the rows per topic that it would read a minute at a time."""

    pk = models.CompositePrimaryKey("minute", "category", "topic", "outcome")
    minute = models.DateTimeField()
    category = models.TextField()
    topic = models.TextField()
    outcome = models.TextField()
    n = models.BigIntegerField()
    latency = IntegerArrayField(null=True)

    class Meta:
        db_table = "workpump_console_rollup"
        # a topic's buckets in a window: the console's per-topic lines and topic page
        indexes = [
            models.Index(fields=["category", "topic", "minute"], name="wp_console_rollup_topic"),
            # the busiest topics of a window, summed from the index alone: the day's sum
            # over 200 topics read 86,000 rows from the heap, 81 ms of the day overview
            models.Index(
                fields=["minute"],
                include=["category", "topic", "outcome", "n"],
                name="wp_console_rollup_sums",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.minute} {self.category} {self.topic} {self.outcome}: {self.n}"


class ConsoleBacklog(models.Model):
    """A topic's waiting rows and oldest pending age, sampled once in a minute."""

    pk = models.CompositePrimaryKey("minute", "category", "topic")
    minute = models.DateTimeField()
    category = models.TextField()
    topic = models.TextField()
    pending = models.BigIntegerField()  # waiting and due (orphaned rows included)
    scheduled = models.BigIntegerField()  # waiting for a retry, deferral or snooze
    leased = models.BigIntegerField()
    oldest_pending_seconds = models.FloatField(null=True)

    class Meta:
        db_table = "workpump_console_backlog"
        # a bin's last sample summed over topics from the index alone: a day's chart
        # read one heap page a topic and bin, 28,800 pages (57 ms of the day overview)
        indexes = [
            models.Index(
                fields=["minute"],
                include=["pending", "scheduled", "leased", "oldest_pending_seconds"],
                name="wp_console_backlog_sums",
            )
        ]

    def __str__(self) -> str:
        return f"{self.minute} {self.category} {self.topic}: {self.pending} pending"


class ConsoleInstance(models.Model):
    """A registered instance's heartbeat age and rows in flight, sampled once in a minute."""

    pk = models.CompositePrimaryKey("minute", "instance_id")
    minute = models.DateTimeField()
    instance_id = models.UUIDField()
    service_name = models.TextField(null=True)
    host_name = models.TextField(null=True)
    process_id = models.IntegerField(null=True)
    heartbeat_age_seconds = models.FloatField(null=True)
    # alive by the liveness rule when sampled (a held alive-lock keeps a slow beater alive)
    alive = models.BooleanField(db_default=False)
    in_flight = models.BigIntegerField()

    class Meta:
        db_table = "workpump_console_instance"

    def __str__(self) -> str:
        return f"{self.minute} {self.instance_id}: {self.in_flight} in flight"


class ConsoleSample(models.Model):
    """A minute the sampler took (its high-water mark: one sample per minute)."""

    minute = models.DateTimeField(primary_key=True)
    taken_at = models.DateTimeField()
    # the rollup holds every bucket before this (the fold of this sample)
    folded_until = models.DateTimeField(null=True)

    class Meta:
        db_table = "workpump_console_sample"

    def __str__(self) -> str:
        return f"{self.minute}"
