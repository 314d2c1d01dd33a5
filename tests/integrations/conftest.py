"""What every adapter test against the real frameworks shares."""

from __future__ import annotations

import sys

import pytest


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """Accelerate's process-wide state (an HF ``Trainer`` or an ``Accelerator`` makes one) reset
    after each test that made it: the next test's Trainer or Accelerator gets its own settings."""
    yield
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)
