"""Leased jobs under Django's own test runner (``python -m django test
tests.apps.djangoproj.shop.djangotests``), on Django's test database as the job database
(celery_lease.django.testing); driven by tests/integration/test_django.py."""

from __future__ import annotations

from django.db import transaction
from django.test import TestCase, TransactionTestCase

from celery_lease import Status
from celery_lease.django.testing import job_database
from celery_lease.errors import ConfigurationError
from celery_lease.testing import eager
from tests.apps.djangoproj.celery import leases
from tests.apps.djangoproj.shop import tasks
from tests.apps.djangoproj.shop.models import Order


class Rollback(Exception):
    pass


class JobsOnDjangosTestDatabase(TransactionTestCase):
    def test_a_rolled_back_submit_leaves_no_job(self):
        with job_database(leases):
            try:
                with transaction.atomic():
                    Order.objects.create(reference="R-1")
                    job = tasks.fulfil.submit({"reference": "R-1"}, queue="held")
                    raise Rollback
            except Rollback:
                pass
            self.assertIsNone(leases.get(job.id))
            self.assertFalse(Order.objects.filter(reference="R-1").exists())
            kept = tasks.fulfil.submit({"reference": "R-2"}, queue="held")
            self.assertIsNotNone(leases.get(kept.id))

    def test_an_effect_writes_djangos_tables_in_eager_mode(self):
        Order.objects.create(reference="P-1")
        with job_database(leases) as url, eager(leases, url):
            done = tasks.pay({"reference": "P-1"})
        self.assertIs(done.status, Status.SUCCEEDED)
        self.assertEqual(Order.objects.get(reference="P-1").status, "paid")


class EagerInsideTheTestsTransaction(TestCase):
    def test_says_to_use_a_transactional_test(self):
        with job_database(leases) as url, eager(leases, url):
            with self.assertRaisesRegex(ConfigurationError, r"TransactionTestCase, django_db\(transaction=True\)"):
                tasks.pay({"reference": "P-2"})
