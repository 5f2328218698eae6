"""Fixtures of the dashboard tests: the API tests' ``make_server`` (live servers on free loopback ports)."""

from tests.api.conftest import make_server, wait_for  # noqa: F401 - fixtures used by the tests
