"""What the plugin's parts hand each other through pytest's stash (per test item)."""

import pytest

from dsconform.results import records

ITEM_CAPABILITY = pytest.StashKey[str]()
BROKEN_PROMISE = pytest.StashKey[str]()
RECORDER = pytest.StashKey[records.MetricsRecorder]()
COVERED_BY = pytest.StashKey[list]()  # the known issues covering this case on this DeepSpeed
