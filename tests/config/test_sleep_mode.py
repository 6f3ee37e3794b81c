"""Sleep mode's argument checks name the argument and its allowed values."""

from __future__ import annotations

import pytest

from pagedllm.config.sleep_mode import check_sleep_level, check_wake_tags


def test_sleep_levels() -> None:
    assert check_sleep_level(1) == 1 and check_sleep_level(2) == 2
    for bad in (0, 3, "1"):
        with pytest.raises(ValueError, match="sleep level must be 1 .* or 2"):
            check_sleep_level(bad)  # type: ignore[arg-type]


def test_wake_tags_in_release_order() -> None:
    assert check_wake_tags(None) == ("weights", "kv_cache")
    assert check_wake_tags(["kv_cache", "weights"]) == ("weights", "kv_cache")
    assert check_wake_tags("kv_cache") == ("kv_cache",)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"unknown wake_up tags \['gpu'\] \(known: weights, kv_cache\)"):
        check_wake_tags(["weights", "gpu"])
