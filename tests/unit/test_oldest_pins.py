"""The Celery, kombu and redis bounds pyproject.toml declares are exactly the ones tested:
the lower bounds are the pins of tests/oldest-constraints.txt (the .venv-oldest tier of
``bash dev.sh test`` runs on them), and whatever is installed lies within the bounds."""

from __future__ import annotations

import os
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

PINS = Path(__file__).resolve().parents[1] / "oldest-constraints.txt"
PINNED = ("celery", "kombu", "redis")


def _pins() -> dict[str, Version]:
    out = {}
    for line in PINS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            out[name.strip()] = Version(version.strip())
    return out


def _declared() -> dict[str, Requirement]:
    reqs = [Requirement(r) for r in metadata.requires("celery-lease") or []]
    return {r.name: r for r in reqs if r.name in PINNED and r.marker is None}


def test_the_declared_lower_bounds_are_the_oldest_pins():
    pins, declared = _pins(), _declared()
    assert set(pins) == set(PINNED) == set(declared)
    for name in PINNED:
        lower = [Version(s.version) for s in declared[name].specifier if s.operator == ">="]
        assert lower == [pins[name]], f"{name}: declared {declared[name].specifier}, oldest tested {pins[name]}"
        assert declared[name].specifier.contains(pins[name])


@pytest.mark.parametrize("name", PINNED)
def test_the_installed_release_is_within_the_declared_bounds(name):
    installed = Version(metadata.version(name))
    assert _declared()[name].specifier.contains(installed)
    if os.environ.get("CL_TEST_OLDEST"):  # the .venv-oldest tier: really on the oldest
        assert installed == _pins()[name]
