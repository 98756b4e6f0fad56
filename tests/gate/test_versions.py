"""Versions compare as versions, never as text."""

from __future__ import annotations

import pytest

from dsconform.base import versions
from dsconform.gate.requires import evaluate
from dsconform.profile.schema import from_data
from tests.node.test_detect import fake_node


def test_ordering_is_numeric():
    assert versions.parse("0.19.10") > versions.parse("0.19.9") > versions.parse("0.19.1")
    assert versions.parse("0.19.10") != versions.parse("0.19.1")
    assert versions.at_least("2.28.10", "2.28.9") and not versions.at_least("2.9", "2.21")
    assert versions.parse("unknown") is None and not versions.at_least(None, "1")
    assert versions.public("2.11.0+cu130") == versions.parse("2.11.0")


def test_specifier_errors_name_the_text():
    with pytest.raises(ValueError, match="'0.19.x' is not a version specifier"):
        versions.specifier("0.19.x")


@pytest.mark.parametrize("installed, spec, ok", [
    ("0.19.10", "<0.19.7", False),   # as text "0.19.10" < "0.19.7"
    ("0.19.10", ">=0.19.9", True),
    ("0.19.6", "<0.19.7", True),
])
def test_deepspeed_gate_uses_parsed_versions(installed, spec, ok):
    node = fake_node(0)
    node.deepspeed_version = installed
    prof = from_data({"profile": {"name": "p"}, "gpus": {"count": 0}}, "t")
    assert evaluate({"deepspeed": spec}, node, prof).ok is ok


def test_nccl_gate_uses_parsed_versions():
    node = fake_node(2)
    node.nccl_version = "2.28.10"
    prof = from_data({"profile": {"name": "p"}, "gpus": {"count": 2}}, "t")
    assert evaluate({"nccl": "2.28.9"}, node, prof).ok
    node.nccl_version = "2.9.1"
    assert not evaluate({"nccl": "2.21"}, node, prof).ok
