#!/usr/bin/env python
"""Command-line entry of the example shop: ``python example_project/manage.py demo --run``."""

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    # Importable as "example" and "shop" from the repo root as well as from this folder.
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    # A checkout that has not pip-installed django-workpump still finds the package.
    if str(HERE.parent) not in sys.path:
        sys.path.append(str(HERE.parent))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "example.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
