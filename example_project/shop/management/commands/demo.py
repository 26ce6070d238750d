"""``manage.py demo``: place orders and payment webhooks, then (``--run``) process them."""

from __future__ import annotations

import random
import time
from typing import Any

from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DEFAULT_DB_ALIAS, OperationalError, connections
from django.db.migrations.executor import MigrationExecutor
from django.db.models import Count, Sum

from django_workpump.models import Event, Inbox, Outbox, PerspectiveEvent, ReceptorProcessing
from shop import services
from shop import workpump as handlers
from shop.models import CustomerTotals, Order, ShipmentRequest

# Work tables; done_at marks a row of each done.
WORK_TABLES = {
    "outbox": Outbox,
    "inbox": Inbox,
    "perspective": PerspectiveEvent,
    "receptor": ReceptorProcessing,
}
DUPLICATE_EVERY = 10  # every 10th order's webhook is delivered twice, as providers do
BAR_WIDTH = 30


class Command(BaseCommand):
    help = (
        "Place demo orders (each emits order.placed and sends a confirmation email) and "
        "receive their payment webhooks; with --run, process all of it and check the result."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--orders", type=int, default=200, help="Orders to place (200).")
        parser.add_argument(
            "--customers", type=int, default=20, help="Customers to spread them over (20)."
        )
        parser.add_argument(
            "--run", action="store_true", help="Then run the pump until drained and verify."
        )
        parser.add_argument(
            "--concurrency", type=int, help="Dispatch threads of the pump (WORKPUMP default)."
        )
        parser.add_argument("--seed", type=int, default=7, help="Seed of the order amounts.")

    def handle(self, *args: Any, **options: Any) -> None:
        orders, customers = options["orders"], options["customers"]
        if orders < 1 or customers < 1:
            raise CommandError("--orders and --customers must be at least 1.")
        if options["concurrency"] is not None and options["concurrency"] < 1:
            raise CommandError(f"--concurrency must be at least 1, not {options['concurrency']}.")
        self._migrate()
        before = _work_counts()
        duplicates = self._place_orders(orders, customers, random.Random(options["seed"]))
        self._print_produced(before, _work_counts(), orders, duplicates)
        if not options["run"]:
            self.stdout.write(
                "Process them with `python manage.py runworkpump` (or pass --run); "
                "the admin at /admin/ shows every row."
            )
            return
        self._run_and_verify(options["concurrency"])

    # -- steps -------------------------------------------------------------------
    def _migrate(self) -> None:
        connection = connections[DEFAULT_DB_ALIAS]
        try:
            executor = MigrationExecutor(connection)
            pending = executor.migration_plan(executor.loader.graph.leaf_nodes())
        except OperationalError as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise CommandError(
                f"Cannot reach the database ({reason}). Set DATABASE_URL to a PostgreSQL "
                "database, or unset it to use the embedded server in example_project/.pgdata."
            ) from None
        if pending:
            self.stdout.write(f"Applying {len(pending)} migrations...")
            call_command("migrate", verbosity=0)

    def _place_orders(self, count: int, customers: int, rng: random.Random) -> int:
        """Place ``count`` orders with their webhooks; return how many redeliveries deduped."""
        names = [f"shopper{n:02d}" for n in range(1, customers + 1)]
        self.stdout.write(f"Placing {count} orders for {customers} customers...")
        step = max(1, count // 100)
        duplicates = 0
        for done in range(1, count + 1):
            order = services.place_order(rng.choice(names), rng.randrange(500, 20_000))
            services.simulate_payment_webhook(order)
            if done % DUPLICATE_EVERY == 0 and not services.simulate_payment_webhook(order):
                duplicates += 1
            if done % step == 0 or done == count:
                self._progress(done, count)
        self.stdout.write("")
        return duplicates

    def _progress(self, done: int, total: int) -> None:
        filled = BAR_WIDTH * done // total
        bar = "#" * filled + "-" * (BAR_WIDTH - filled)
        self.stdout.write(f"\r[{bar}] {done}/{total}", ending="")
        self.stdout.flush()

    def _print_produced(
        self, before: dict[str, int], after: dict[str, int], orders: int, duplicates: int
    ) -> None:
        made = {name: after[name] - before[name] for name in after}
        self.stdout.write("Produced:")
        self.stdout.write(f"  orders             {orders}")
        self.stdout.write(f"  events             {made['events']} (order.placed)")
        self.stdout.write(f"  perspective rows   {made['perspective']} (customer_totals)")
        self.stdout.write(f"  receptor rows      {made['receptor']} (shipping)")
        self.stdout.write(f"  outbox rows        {made['outbox']} (shop.order_confirmation)")
        self.stdout.write(
            f"  inbox rows         {made['inbox']} (payments.webhook; "
            f"{duplicates} duplicate webhooks ignored)"
        )

    def _run_and_verify(self, concurrency: int | None) -> None:
        done_before = _done_counts()
        self.stdout.write("Running the pump until nothing is left to claim...")
        started = time.monotonic()
        call_command("runworkpump", drain=True, concurrency=concurrency)
        elapsed = time.monotonic() - started
        done_after = _done_counts()
        processed = sum(done_after.values()) - sum(done_before.values())
        undone = _undone_count()
        checks = [
            ("work left undone", f"{undone}", undone == 0),
            *_verify_read_models(),
        ]
        self.stdout.write("Outcome:")
        self.stdout.write(
            f"  work processed     {processed} rows in {elapsed:.1f} s "
            f"({processed / max(elapsed, 1e-9):.0f} rows/s)"
        )
        for label, value, ok in checks:
            verdict = self.style.SUCCESS("OK") if ok else self.style.ERROR("MISMATCH")
            self.stdout.write(f"  {label:<18} {value}  {verdict}")
        self.stdout.write(f"  emails sent        {handlers.emails_sent.value} (by this process)")
        failed = [label for label, _, ok in checks if not ok]
        if failed:
            raise CommandError(
                f"The demo's checks failed: {', '.join(failed)}. Failed or dead rows are listed "
                "in the admin under Work pump."
            )


def _work_counts() -> dict[str, int]:
    counts = {name: model.objects.count() for name, model in WORK_TABLES.items()}
    counts["events"] = Event.objects.count()
    return counts


def _done_counts() -> dict[str, int]:
    return {
        name: model.objects.filter(done_at__isnull=False).count()
        for name, model in WORK_TABLES.items()
    }


def _undone_count() -> int:
    return sum(model.objects.filter(done_at__isnull=True).count() for model in WORK_TABLES.values())


def _verify_read_models() -> list[tuple[str, str, bool]]:
    """Compare what the handlers built with what the orders say it should be."""
    orders = Order.objects.count()
    paid = Order.objects.filter(paid=True).count()
    shipments = ShipmentRequest.objects.count()
    expected = {
        row["customer"]: (row["n"], row["total"])
        for row in Order.objects.values("customer").annotate(
            n=Count("id"), total=Sum("amount_cents")
        )
    }
    actual = {t.customer: (t.orders, t.amount_cents) for t in CustomerTotals.objects.all()}
    wrong = sorted(
        set(expected) ^ set(actual) | {c for c in expected if expected[c] != actual.get(c)}
    )
    totals = (
        f"{len(actual)} customers match their orders"
        if not wrong
        else f"{len(wrong)} customers differ from their orders ({', '.join(wrong[:5])})"
    )
    return [
        ("orders paid", f"{paid}/{orders}", paid == orders),
        ("shipment requests", f"{shipments}/{orders}", shipments == orders),
        ("customer totals", totals, not wrong),
    ]
