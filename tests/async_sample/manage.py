#!/usr/bin/env python
"""A small project whose TestCase runs an async receptor through ``run_pending``.

tests/pump/test_async_handlers.py runs its ``manage.py test`` twice in a row: the first run
must leave no test database (nor any session on it) behind.
"""

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "sample.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
