"""Helpers the tests share, imported as `tests.helpers.<module>` (not from conftest files or test modules)."""
