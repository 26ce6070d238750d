from django.test import TestCase

import django_workpump as workpump
from django_workpump.testing import run_pending

from .models import Notice


class TellWarehouseTests(TestCase):
    def test_an_order_tells_the_warehouse(self):
        workpump.emit("order.placed", {"order": 42}, stream="order-42")

        self.assertEqual(run_pending(), 1)

        self.assertEqual(list(Notice.objects.values_list("order", flat=True)), [42])

    def test_the_other_tests_notice_is_gone(self):  # runs after it (tests run in name order)
        self.assertFalse(Notice.objects.exists())
