"""Benchmarks of django-workpump against PgQueuer and Procrastinate (``python bench/run.py``)."""
