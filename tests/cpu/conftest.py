"""The fixture of the `cpu_isa` engine tests (tests/cpu/test_cpu_isa_levels*.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture
def two_threads() -> Iterator[None]:
    """Two threads for the test, as users run the engine (test_cpu_isa_levels.py says why)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)
