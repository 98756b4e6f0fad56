"""A property test on a case a known issue covers is not shrunk: its first failing example is
judged against the registry at once (dsconform.plugin.hooks._no_shrinking)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsconform.plugin.hooks import _no_shrinking


def _failing_property(calls: list):
    @settings(max_examples=50, database=None, derandomize=True, deadline=None)
    @given(st.integers(min_value=1000, max_value=10**9), st.lists(st.integers(), min_size=5))
    def prop(n, xs):
        calls.append(n)
        raise AssertionError("always fails")
    return prop


def test_a_covered_property_test_is_not_shrunk():
    shrunk, plain = [], []
    with pytest.raises(AssertionError):
        _failing_property(shrunk)()
    prop = _failing_property(plain)
    restore = _no_shrinking(SimpleNamespace(obj=prop))
    with pytest.raises(AssertionError):
        prop()
    assert len(plain) <= 3 < len(shrunk)  # the failing example and its replay
    restore()
    plain.clear()
    with pytest.raises(AssertionError):
        prop()
    assert len(plain) == len(shrunk)  # restored: shrunk as before
    assert _no_shrinking(SimpleNamespace(obj=lambda: None)) is None  # not a property test
