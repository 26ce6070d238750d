"""System checks of the WORKPUMP setting: ids, exact messages and hints for unknown keys,
wrong types, out-of-range values and unsafe combinations, and their place in `manage.py check`.
"""

from __future__ import annotations

from importlib import import_module
from io import StringIO
from typing import Any

import pytest
from django.conf import settings
from django.core.checks import CheckMessage, Error, Info, Warning, run_checks
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.test import override_settings

from django_workpump.checks import validate_settings
from django_workpump.conf import DEFAULTS

# A backend of another vendor that is never connected to: Django's placeholder for an
# unconfigured database. The check reads the vendor, so any non-PostgreSQL one stands in.
OTHER_DATABASE = {"ENGINE": "django.db.backends.dummy"}


def check(**workpump: Any) -> list[CheckMessage]:
    """Run the workpump-tagged checks with ``WORKPUMP`` set to ``workpump``."""
    with override_settings(WORKPUMP=workpump):
        return run_checks(tags=["workpump"])


def only(messages: list[CheckMessage]) -> CheckMessage:
    assert len(messages) == 1, messages
    return messages[0]


# Defaults and registration.


def test_defaults_produce_no_messages():
    assert check() == []


def test_missing_workpump_setting_produces_no_messages():
    with override_settings():
        del settings.WORKPUMP
        assert run_checks(tags=["workpump"]) == []


def test_validate_settings_returns_what_the_registered_check_returns():
    with override_settings(WORKPUMP={"LEASE_SECONDS": 0, "CLAIM_ENABLED": False}):
        direct = validate_settings()
        assert run_checks(tags=["workpump"]) == direct
    assert [m.id for m in direct] == ["workpump.E004", "workpump.I002"]


def test_manage_py_check_fails_on_a_workpump_error():
    with (
        override_settings(WORKPUMP={"STALE_AFTER_SECONDS": 15}),
        pytest.raises(SystemCheckError) as raised,
    ):
        call_command("check", stdout=StringIO(), stderr=StringIO())
    assert "(workpump.E008)" in str(raised.value)


def test_manage_py_check_passes_with_only_info_messages():
    out, err = StringIO(), StringIO()
    with override_settings(WORKPUMP={"CLAIM_ENABLED": False}):
        call_command("check", stdout=out, stderr=err)
    assert "(workpump.I002)" in err.getvalue()
    assert "System check identified 1 issue" in err.getvalue()


# Shape of the dict and unknown keys.


def test_workpump_not_a_dict_is_the_only_error():
    with override_settings(WORKPUMP=[("LEASE_SECONDS", 10)]):
        messages = run_checks(tags=["workpump"])
    assert messages == [
        Error(
            "WORKPUMP must be a dict, not list.",
            hint="Set WORKPUMP to a dict of the keys to override, or leave it out.",
            id="workpump.E001",
        )
    ]


def test_unknown_key_with_a_close_match_suggests_it():
    assert check(LEASE_SECOND=60) == [
        Error(
            "WORKPUMP['LEASE_SECOND'] is not a known setting.",
            hint="Did you mean 'LEASE_SECONDS'?",
            id="workpump.E002",
        )
    ]


def test_unknown_key_without_a_close_match_says_where_the_keys_are():
    assert check(XYZZY=1) == [
        Error(
            "WORKPUMP['XYZZY'] is not a known setting.",
            hint="Remove it; the known keys are listed in django_workpump.conf.DEFAULTS.",
            id="workpump.E002",
        )
    ]


def test_each_unknown_key_gets_its_own_error():
    messages = check(FOO=1, BAR=2, CONCURRENCY=8)
    assert [(m.id, m.msg) for m in messages] == [
        ("workpump.E002", "WORKPUMP['FOO'] is not a known setting."),
        ("workpump.E002", "WORKPUMP['BAR'] is not a known setting."),
    ]


# Types.


def test_every_known_key_has_a_type_check():
    """An object() is the wrong type for every key: one error per key, none from combinations."""
    messages = check(**{key: object() for key in DEFAULTS})
    named = [m.msg.split("]")[0] + "]" for m in messages]
    assert named == [f"WORKPUMP[{key!r}]" for key in DEFAULTS]
    assert {m.id for m in messages} == {"workpump.E003", "workpump.E005", "workpump.E016"}
    assert all(m.is_serious() for m in messages)


def test_bool_for_an_integer_key_is_rejected():
    assert check(CONCURRENCY=True) == [
        Error(
            "WORKPUMP['CONCURRENCY'] (True) must be an integer, not a boolean.",
            hint="Set it to a whole number such as 4 (the default).",
            id="workpump.E003",
        )
    ]


@pytest.mark.parametrize("value", ["300", 300.0, None])
def test_non_integer_for_an_integer_key_is_rejected(value):
    assert only(check(LEASE_SECONDS=value)) == Error(
        f"WORKPUMP['LEASE_SECONDS'] ({value!r}) must be an integer.",
        hint="Set it to a whole number such as 300 (the default).",
        id="workpump.E003",
    )


def test_optional_integer_accepts_none():
    assert check(NOTIFY_HEALTHY_POLLING_INTERVAL_MS=None) == []


def test_optional_integer_rejects_a_string():
    assert check(NOTIFY_HEALTHY_POLLING_INTERVAL_MS="5s") == [
        Error(
            "WORKPUMP['NOTIFY_HEALTHY_POLLING_INTERVAL_MS'] ('5s') must be an integer or None.",
            hint="Set it to a whole number such as 5000 (the default).",
            id="workpump.E003",
        )
    ]


def test_optional_integer_rejects_zero():
    assert check(NOTIFY_HEALTHY_POLLING_INTERVAL_MS=0) == [
        Error(
            "WORKPUMP['NOTIFY_HEALTHY_POLLING_INTERVAL_MS'] (0) must be at least 1.",
            hint="Set it to 1 or more; the default is 5000.",
            id="workpump.E004",
        )
    ]


@pytest.mark.parametrize(
    ("key", "default"),
    [
        ("HEARTBEAT_ENABLED", True),
        ("CLAIM_ENABLED", True),
        ("ENABLE_SAFETY_NET_POLL", True),
        ("CLAIM_SYNCHRONOUS_COMMIT", False),
        ("PREPARED_STATEMENTS", True),
    ],
)
def test_boolean_key_rejects_an_integer(key, default):
    assert check(**{key: 1}) == [
        Error(
            f"WORKPUMP[{key!r}] (1) must be True or False.",
            hint=f"Set it to a boolean; the default is {default}.",
            id="workpump.E003",
        )
    ]


def test_unknown_liveness_mode_is_rejected():
    assert check(LIVENESS_SOURCE_MODE="advisory") == [
        Error(
            "WORKPUMP['LIVENESS_SOURCE_MODE'] ('advisory') must be "
            "'advisory_lock_when_available' or 'heartbeat_table_only'.",
            hint=(
                "Use 'heartbeat_table_only' behind a transaction pooler, "
                "else 'advisory_lock_when_available'."
            ),
            id="workpump.E005",
        )
    ]


def test_heartbeat_table_only_mode_is_accepted():
    assert check(LIVENESS_SOURCE_MODE="heartbeat_table_only") == []


# Ranges.

AT_LEAST_ONE = [key for key in DEFAULTS if key.endswith(("_INTERVAL_SECONDS", "_INTERVAL_MS"))] + [
    "LEASE_SECONDS",
    "MAX_ATTEMPTS",
    "CONCURRENCY",
    "PARTITION_COUNT",
    "MAX_STREAMS_PER_BATCH",
    "RENEWAL_MAX_BATCH",
    "RENEWAL_COALESCE_WINDOW_MS",
    "RENEWAL_IMMEDIATE_FLUSH_AT",
    "RENEWAL_CAPACITY",
    "STALE_AFTER_SECONDS",
    "DEFINITIVELY_DEAD_AFTER_SECONDS",
    "MAX_PAYLOAD_BYTES",
]
AT_LEAST_ZERO = [
    "RETENTION_SECONDS",
    "RETRY_BACKOFF_BASE_SECONDS",
    "RETRY_BACKOFF_MAX_SECONDS",
    "MAX_RENEWALS_PER_WORK",
    "LEASE_GRACE_SECONDS",
    "CLAIM_PREFETCH",
    "CLAIM_FAIR_PREFETCH",
    "SHUTDOWN_TIMEOUT_SECONDS",
    "MAX_ABANDONED_HANDLERS",
]


def test_range_lists_cover_the_expected_interval_keys():
    assert {
        "HEARTBEAT_INTERVAL_SECONDS",
        "HEARTBEAT_SLOW_INTERVAL_SECONDS",
        "STALE_PEER_PROBE_INTERVAL_SECONDS",
        "POLLING_INTERVAL_MS",
        "POLLING_MAX_INTERVAL_MS",
        "NOTIFY_HEALTHY_POLLING_INTERVAL_MS",
        "MAINTENANCE_INTERVAL_SECONDS",
        "STATUS_INTERVAL_SECONDS",
    } <= set(AT_LEAST_ONE)


@pytest.mark.parametrize("key", AT_LEAST_ONE)
def test_zero_is_rejected_where_at_least_one_is_required(key):
    assert check(**{key: 0}) == [
        Error(
            f"WORKPUMP[{key!r}] (0) must be at least 1.",
            hint=f"Set it to 1 or more; the default is {DEFAULTS[key]!r}.",
            id="workpump.E004",
        )
    ]


@pytest.mark.parametrize("key", AT_LEAST_ZERO)
def test_zero_is_accepted_where_at_least_zero_is_required(key):
    assert check(**{key: 0}) == []


@pytest.mark.parametrize("key", AT_LEAST_ZERO)
def test_negative_is_rejected_where_at_least_zero_is_required(key):
    assert check(**{key: -1}) == [
        Error(
            f"WORKPUMP[{key!r}] (-1) must be at least 0.",
            hint=f"Set it to 0 or more; the default is {DEFAULTS[key]!r}.",
            id="workpump.E004",
        )
    ]


def test_retry_backoff_of_zero_means_retry_at_once_and_is_clean():
    assert check(RETRY_BACKOFF_BASE_SECONDS=0, RETRY_BACKOFF_MAX_SECONDS=0) == []


def test_renewal_immediate_flush_above_max_batch_is_an_error():
    assert check(RENEWAL_IMMEDIATE_FLUSH_AT=6000) == [
        Error(
            "WORKPUMP['RENEWAL_IMMEDIATE_FLUSH_AT'] (6000) must be at most RENEWAL_MAX_BATCH "
            "(5000).",
            hint="Lower RENEWAL_IMMEDIATE_FLUSH_AT or raise RENEWAL_MAX_BATCH.",
            id="workpump.E006",
        )
    ]


def test_renewal_max_batch_above_capacity_is_an_error():
    assert check(RENEWAL_MAX_BATCH=30000) == [
        Error(
            "WORKPUMP['RENEWAL_MAX_BATCH'] (30000) must be at most RENEWAL_CAPACITY (20000).",
            hint="Lower RENEWAL_MAX_BATCH or raise RENEWAL_CAPACITY.",
            id="workpump.E006",
        )
    ]


def test_renewal_sizes_may_be_equal():
    assert check(RENEWAL_IMMEDIATE_FLUSH_AT=50, RENEWAL_MAX_BATCH=50, RENEWAL_CAPACITY=50) == []


def test_lease_grace_not_below_lease_is_an_error_without_the_lease_warning():
    assert check(LEASE_SECONDS=30) == [
        Error(
            "WORKPUMP['LEASE_GRACE_SECONDS'] (30) must be less than LEASE_SECONDS (30).",
            hint=(
                "A handler would be cancelled as soon as it starts; "
                "lower LEASE_GRACE_SECONDS or raise LEASE_SECONDS."
            ),
            id="workpump.E007",
        )
    ]


# Combinations.


def test_stale_cutoff_below_twice_the_fast_heartbeat_is_an_error():
    assert check(STALE_AFTER_SECONDS=19) == [
        Error(
            "WORKPUMP['STALE_AFTER_SECONDS'] (19) must be at least twice "
            "HEARTBEAT_INTERVAL_SECONDS (10).",
            hint=(
                "A live instance whose heartbeat is a little late would be evicted; "
                "raise STALE_AFTER_SECONDS to 20 or more, or lower HEARTBEAT_INTERVAL_SECONDS."
            ),
            id="workpump.E008",
        )
    ]


def test_stale_cutoff_of_exactly_twice_the_fast_heartbeat_is_clean():
    assert check(STALE_AFTER_SECONDS=20) == []


def test_seed_cadence_equal_to_the_stale_cutoff_is_rejected():
    messages = check(HEARTBEAT_INTERVAL_SECONDS=30, STALE_AFTER_SECONDS=30)
    assert [(m.id, m.msg) for m in messages] == [
        (
            "workpump.E008",
            "WORKPUMP['STALE_AFTER_SECONDS'] (30) must be at least twice "
            "HEARTBEAT_INTERVAL_SECONDS (30).",
        )
    ]


def test_definitively_dead_before_stale_is_an_error():
    assert check(DEFINITIVELY_DEAD_AFTER_SECONDS=25, HEARTBEAT_SLOW_INTERVAL_SECONDS=20) == [
        Error(
            "WORKPUMP['DEFINITIVELY_DEAD_AFTER_SECONDS'] (25) must be at least "
            "STALE_AFTER_SECONDS (30).",
            hint=(
                "An instance is stale before it is definitively dead; raise "
                "DEFINITIVELY_DEAD_AFTER_SECONDS or lower STALE_AFTER_SECONDS."
            ),
            id="workpump.E009",
        )
    ]


def test_slow_heartbeat_reaching_the_dead_cutoff_is_an_error_in_alive_lock_mode():
    assert check(HEARTBEAT_SLOW_INTERVAL_SECONDS=300) == [
        Error(
            "WORKPUMP['HEARTBEAT_SLOW_INTERVAL_SECONDS'] (300) must be less than "
            "DEFINITIVELY_DEAD_AFTER_SECONDS (300) when LIVENESS_SOURCE_MODE is "
            "'advisory_lock_when_available'.",
            hint=(
                "A live instance beating at the slow cadence would be evicted as "
                "definitively dead; lower HEARTBEAT_SLOW_INTERVAL_SECONDS or raise "
                "DEFINITIVELY_DEAD_AFTER_SECONDS."
            ),
            id="workpump.E010",
        )
    ]


def test_slow_heartbeat_reaching_the_dead_cutoff_is_fine_in_heartbeat_table_mode():
    messages = check(
        HEARTBEAT_SLOW_INTERVAL_SECONDS=300, LIVENESS_SOURCE_MODE="heartbeat_table_only"
    )
    assert messages == []


def test_slow_heartbeat_faster_than_the_fast_one_is_a_warning():
    assert check(HEARTBEAT_SLOW_INTERVAL_SECONDS=5) == [
        Warning(
            "WORKPUMP['HEARTBEAT_SLOW_INTERVAL_SECONDS'] (5) should be at least "
            "HEARTBEAT_INTERVAL_SECONDS (10).",
            hint=(
                "The slow cadence applies while the alive-lock proves liveness; "
                "set it to HEARTBEAT_INTERVAL_SECONDS or more."
            ),
            id="workpump.W001",
        )
    ]


@pytest.mark.parametrize("cap", [250, 100])
def test_polling_cap_not_above_base_notes_backoff_disabled(cap):
    assert check(POLLING_MAX_INTERVAL_MS=cap) == [
        Info(
            f"WORKPUMP['POLLING_MAX_INTERVAL_MS'] ({cap}) is not above "
            "POLLING_INTERVAL_MS (250), so backoff is disabled.",
            hint=(
                "Empty polls will not slow down; raise POLLING_MAX_INTERVAL_MS above "
                "POLLING_INTERVAL_MS to let idle instances poll less often."
            ),
            id="workpump.I001",
        )
    ]


def test_polling_cap_one_above_base_is_clean():
    assert check(POLLING_MAX_INTERVAL_MS=251) == []


def test_lease_at_most_twice_grace_is_a_warning():
    assert check(LEASE_SECONDS=60) == [
        Warning(
            "WORKPUMP['LEASE_SECONDS'] (60) should be more than twice LEASE_GRACE_SECONDS (30).",
            hint=(
                "A handler's deadline is LEASE_SECONDS minus LEASE_GRACE_SECONDS, "
                "which leaves renewals hardly any time to run; raise LEASE_SECONDS "
                "or lower LEASE_GRACE_SECONDS."
            ),
            id="workpump.W002",
        )
    ]


def test_lease_just_above_twice_grace_is_clean():
    assert check(LEASE_SECONDS=61) == []


def test_heartbeat_disabled_is_a_drain_only_warning():
    assert check(HEARTBEAT_ENABLED=False) == [
        Warning(
            "WORKPUMP['HEARTBEAT_ENABLED'] (False) stops heartbeats, "
            "so peers will evict this instance.",
            hint="Use it only to drain an instance; set it to True for normal running.",
            id="workpump.W003",
        )
    ]


def test_claim_disabled_is_info():
    assert check(CLAIM_ENABLED=False) == [
        Info(
            "WORKPUMP['CLAIM_ENABLED'] (False) stops this instance from claiming work.",
            hint="Set it to True to process work again.",
            id="workpump.I002",
        )
    ]


def test_combination_is_skipped_when_one_of_its_keys_has_the_wrong_type():
    messages = check(STALE_AFTER_SECONDS=5, HEARTBEAT_INTERVAL_SECONDS="10")
    assert [m.id for m in messages] == ["workpump.E003"]
    assert messages[0].msg == ("WORKPUMP['HEARTBEAT_INTERVAL_SECONDS'] ('10') must be an integer.")


def test_combination_is_skipped_when_one_of_its_keys_is_out_of_range():
    messages = check(LEASE_GRACE_SECONDS=-5, LEASE_SECONDS=1)
    assert [(m.id, m.msg) for m in messages] == [
        ("workpump.E004", "WORKPUMP['LEASE_GRACE_SECONDS'] (-5) must be at least 0.")
    ]


def test_a_type_error_is_reported_once_per_key():
    messages = check(STALE_AFTER_SECONDS=True)
    assert [(m.id, m.msg) for m in messages] == [
        (
            "workpump.E003",
            "WORKPUMP['STALE_AFTER_SECONDS'] (True) must be an integer, not a boolean.",
        )
    ]


def test_several_independent_faults_are_all_reported():
    messages = check(CONCURRENCY=0, STALE_AFTER_SECONDS=10, CLAIM_ENABLED=False, NOPE=1)
    assert [m.id for m in messages] == [
        "workpump.E002",
        "workpump.E004",
        "workpump.E008",
        "workpump.I002",
    ]


# Connections.


def test_database_alias_must_exist():
    assert check(DATABASE_ALIAS="replica") == [
        Error(
            "WORKPUMP['DATABASE_ALIAS'] ('replica') must name a database in settings.DATABASES.",
            hint="Use one of the configured aliases: 'default', 'second'.",
            id="workpump.E011",
        )
    ]


def test_database_alias_must_be_a_string():
    assert check(DATABASE_ALIAS=0) == [
        Error(
            "WORKPUMP['DATABASE_ALIAS'] (0) must be a string.",
            hint="Set it to an alias of settings.DATABASES, such as 'default'.",
            id="workpump.E003",
        )
    ]


@pytest.mark.filterwarnings("ignore:Overriding setting DATABASES")
def test_database_alias_must_be_postgresql():
    # The engine is a real backend, of another vendor: not merely a name that fails to import.
    assert import_module(f"{OTHER_DATABASE['ENGINE']}.base").DatabaseWrapper.vendor == "unknown"
    databases = {**settings.DATABASES, "legacy": OTHER_DATABASE}
    with override_settings(DATABASES=databases, WORKPUMP={"DATABASE_ALIAS": "legacy"}):
        messages = run_checks(tags=["workpump"])
    assert messages == [
        Error(
            "WORKPUMP['DATABASE_ALIAS'] ('legacy') must name a PostgreSQL database, "
            f"not {OTHER_DATABASE['ENGINE']!r}.",
            hint=(
                "Point DATABASE_ALIAS at a database whose ENGINE is "
                "'django.db.backends.postgresql'."
            ),
            id="workpump.E012",
        )
    ]


@pytest.mark.filterwarnings("ignore:Overriding setting DATABASES")
def test_default_alias_on_another_database_is_rejected_with_default_settings():
    with override_settings(DATABASES={"default": OTHER_DATABASE}, WORKPUMP={}):
        messages = run_checks(tags=["workpump"])
    assert [m.id for m in messages] == ["workpump.E012"]


@pytest.mark.filterwarnings("ignore:Overriding setting DATABASES")
def test_postgis_alias_is_accepted():
    postgis = {**settings.DATABASES["default"], "ENGINE": "django.contrib.gis.db.backends.postgis"}
    with override_settings(DATABASES={"default": postgis}, WORKPUMP={}):
        assert run_checks(tags=["workpump"]) == []


@pytest.mark.parametrize(
    "dsn", ["postgresql://workpump@db.internal:5432/app", "host=db.internal dbname=app"]
)
def test_parsable_listen_dsn_is_accepted(dsn):
    assert check(LISTEN_DSN=dsn) == []


def test_unparsable_listen_dsn_is_an_error_that_does_not_echo_it():
    messages = check(LISTEN_DSN="host=db secret_password=hunter2")
    assert messages == [
        Error(
            "WORKPUMP['LISTEN_DSN'] cannot be parsed as a libpq connection string: "
            'invalid connection option "secret_password".',
            hint=(
                "Use 'host=... port=... dbname=... user=...' or "
                "'postgresql://user@host:port/dbname'."
            ),
            id="workpump.E013",
        )
    ]
    assert "hunter2" not in messages[0].msg


def test_empty_listen_dsn_is_an_error():
    assert check(LISTEN_DSN="  ") == [
        Error(
            "WORKPUMP['LISTEN_DSN'] ('  ') must be None or a non-empty connection string.",
            hint="Set it to None to use the DATABASE_ALIAS connection settings.",
            id="workpump.E013",
        )
    ]


def test_listen_dsn_of_the_wrong_type_is_an_error():
    assert check(LISTEN_DSN={"host": "db"}) == [
        Error(
            "WORKPUMP['LISTEN_DSN'] ({'host': 'db'}) must be None or a string.",
            hint="Set it to a libpq connection string or URL, or None to use DATABASE_ALIAS.",
            id="workpump.E003",
        )
    ]


def test_every_message_is_a_sentence_with_an_id_and_a_hint():
    faulty = dict(
        LEASE_SECONDS=60,
        STALE_AFTER_SECONDS=10,
        HEARTBEAT_SLOW_INTERVAL_SECONDS=5,
        POLLING_MAX_INTERVAL_MS=1,
        HEARTBEAT_ENABLED=False,
        CLAIM_ENABLED=False,
        LISTEN_DSN="nonsense",
        TYPO=1,
    )
    messages = check(**faulty)
    assert len(messages) == 8
    for message in messages:
        assert message.id.startswith("workpump.")
        assert message.msg.endswith(".") and message.msg.startswith("WORKPUMP[")
        assert message.hint


def test_a_metrics_port_above_65535_is_refused():
    assert check(METRICS_PORT=70000) == [
        Error(
            "WORKPUMP['METRICS_PORT'] (70000) must be a TCP port, at most 65535.",
            hint="Choose a free port such as 9464, or None to serve no metrics.",
            id="workpump.E015",
        )
    ]


def test_a_metrics_port_without_prometheus_client_names_the_extra(monkeypatch):
    from django_workpump import metrics

    assert check(METRICS_PORT=9464) == []
    monkeypatch.setattr(metrics, "AVAILABLE", False)
    assert check(METRICS_PORT=9464) == [
        Error(
            "WORKPUMP['METRICS_PORT'] (9464) serves Prometheus metrics, but "
            "prometheus_client is not installed.",
            hint="Install it with: pip install 'django-workpump[prometheus]'; or set "
            "METRICS_PORT to None.",
            id="workpump.E015",
        )
    ]


@pytest.mark.parametrize("value", ["LOUD", 0, 101])
def test_attempt_log_level_must_be_a_level_name_or_a_number_from_1_to_100(value):
    assert check(ATTEMPT_LOG_LEVEL=value) == [
        Error(
            f"WORKPUMP['ATTEMPT_LOG_LEVEL'] ({value!r}) must be a level name (DEBUG, INFO,"
            " WARNING, ERROR, CRITICAL), a number from 1 to 100, or None.",
            hint='Set it to "WARNING" (the default), "INFO", "DEBUG", or None for none.',
            id="workpump.E017",
        )
    ]


@pytest.mark.parametrize("value", ["info", "WARNING", 15, None])
def test_attempt_log_level_takes_names_numbers_and_none(value):
    assert check(ATTEMPT_LOG_LEVEL=value) == []
