"""Handlers of the cross-process tracing test, loaded by tests/settings_tracing.py only."""
