"""Test doubles: a fake backend (registered as a plugin by tests/conftest.py) and a fake transport."""
