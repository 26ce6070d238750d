"""Settings of the runworkpump processes of the fault-injection suite."""

import os

from tests.settings import *  # noqa: F403
from tests.settings import DATABASES, INSTALLED_APPS

INSTALLED_APPS = [*INSTALLED_APPS, "tests.faults.app"]

# FAULTS_CONN_MAX_AGE: persistent Django connections ("none" = forever), as production
# deployments often run them; the default 0 opens a connection per unit of work.
_max_age = os.environ.get("FAULTS_CONN_MAX_AGE")
if _max_age:
    DATABASES["default"]["CONN_MAX_AGE"] = None if _max_age == "none" else int(_max_age)
