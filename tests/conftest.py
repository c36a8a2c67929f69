"""Test-wide fixtures (the shared fakes live in tests/fakes/)."""

pytest_plugins = ["tests.fakes.fixtures"]
