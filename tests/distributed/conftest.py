"""Fixtures shared by the multi-process tests."""

from __future__ import annotations

import pytest
from test_layouts import References


@pytest.fixture(scope="session")
def refs(tmp_path_factory: pytest.TempPathFactory) -> References:
    """The single-process reference runs, trained when first asked for, once per session:
    test_layouts.py and test_restarts.py compare against the same ones."""
    return References(tmp_path_factory.mktemp("ref"))
