"""``shardwise.mesh._simulation`` outside any LocalTensorMode: what a mesh asks on every call."""

from __future__ import annotations

import sys
import types

import pytest

from shardwise.mesh import _simulation


@pytest.fixture
def half_imported_local_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    # What another thread's import leaves in sys.modules until the module body has run.
    monkeypatch.setitem(sys.modules, _simulation._LOCAL_TENSOR_MODULE, types.ModuleType("half"))


def test_half_imported_local_tensor_module_means_no_mode(half_imported_local_tensor: None) -> None:
    assert _simulation.simulated_ranks() is None
    assert _simulation.simulated_view() is None
    with _simulation.mode_disabled():
        assert _simulation.simulated_ranks() is None


def test_pinned_rank_is_reported_and_restored() -> None:
    assert _simulation.simulated_view() is None
    with _simulation.as_simulated_rank(3):
        assert _simulation.pinned_rank() == 3
        assert _simulation.simulated_view() == 3
    assert _simulation.pinned_rank() is None


def test_pinning_a_bad_rank_raises() -> None:
    with pytest.raises(ValueError, match="expects a global rank"):
        with _simulation.as_simulated_rank(-1):
            pass
