"""Registries (``registry.py``): exactly the spec's keys, and unknown names listed in the error."""

from __future__ import annotations

import pytest

from trinity_trl.algorithms import ADVANTAGE_FN, ALGORITHM_TYPE, ENTROPY_LOSS_FN, KL_FN, POLICY_LOSS_FN

from .support import BATCH_ADV_KEYS, ENTROPY_KEYS, GROUP_ADV_KEYS, KL_KEYS, POLICY_KEYS, PRESETS


@pytest.mark.parametrize(
    "registry, expected",
    [(POLICY_LOSS_FN, POLICY_KEYS), (KL_FN, KL_KEYS), (ENTROPY_LOSS_FN, ENTROPY_KEYS),
     (ADVANTAGE_FN, GROUP_ADV_KEYS + BATCH_ADV_KEYS), (ALGORITHM_TYPE, PRESETS)],
)
def test_registry_lists_exactly_the_spec_keys(registry, expected):
    assert sorted(registry.names()) == sorted(expected)
    assert sorted(registry.list()) == sorted(expected)
    for name in expected:
        assert name in registry


@pytest.mark.parametrize("registry", [POLICY_LOSS_FN, KL_FN, ENTROPY_LOSS_FN, ADVANTAGE_FN, ALGORITHM_TYPE])
def test_unknown_name_lists_known_names(registry):
    with pytest.raises(ValueError) as info:
        registry.get("no_such_component")
    message = str(info.value)
    assert "no_such_component" in message
    for name in registry.names():
        assert name in message
