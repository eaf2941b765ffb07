"""Registries (``registry.py``): exactly Trinity-RFT's keys (docs/algorithms/index.md), unknown names listed in the
error, unregistering."""

from __future__ import annotations

import pytest

from trinity_trl.algorithms import ADVANTAGE_FN, ALGORITHM_TYPE, ENTROPY_LOSS_FN, KL_FN, POLICY_LOSS_FN
from trinity_trl.algorithms.registry import Registry

from .support import BATCH_ADV_KEYS, ENTROPY_KEYS, GROUP_ADV_KEYS, KL_KEYS, POLICY_KEYS, PRESETS


@pytest.mark.parametrize(
    "registry, expected",
    [
        (POLICY_LOSS_FN, POLICY_KEYS),
        (KL_FN, KL_KEYS),
        (ENTROPY_LOSS_FN, ENTROPY_KEYS),
        (ADVANTAGE_FN, GROUP_ADV_KEYS + BATCH_ADV_KEYS),
        (ALGORITHM_TYPE, PRESETS),
    ],
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


def test_register_and_unregister():
    registry = Registry("widget")

    @registry.register("w")
    class Widget:
        pass

    assert registry.get("w") is Widget and Widget.name == "w"
    with pytest.raises(ValueError, match="already registered"):
        registry.register("w")(type("Other", (), {}))
    assert registry.unregister("w") is Widget
    assert "w" not in registry and len(registry) == 0
    with pytest.raises(ValueError, match="'w' is not registered"):
        registry.unregister("w")
    registry.register("w")(Widget)  # the name is free again
    assert registry.names() == ["w"]


def test_entry_points_of_the_components_group_register_on_first_lookup(tmp_path, monkeypatch):
    """A package declaring ``[project.entry-points."trinity_trl.components"]`` gets its components registered the
    first time a registry is asked for a name it lacks."""
    import importlib
    import sys

    from trinity_trl.algorithms import POLICY_LOSS_FN, registry

    (tmp_path / "ep_losses.py").write_text(
        "from trinity_trl.algorithms import POLICY_LOSS_FN\n"
        "from trinity_trl.algorithms.policy_loss.ppo import PPOPolicyLossFn\n"
        "POLICY_LOSS_FN.register('entry_point_ppo')(type('EntryPointPPO', (PPOPolicyLossFn,), {}))\n"
    )
    dist = tmp_path / "ep_losses-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-losses\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[trinity_trl.components]\nlosses = ep_losses\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    monkeypatch.setattr(registry, "_entry_points_loaded", False)
    try:
        assert POLICY_LOSS_FN.get("entry_point_ppo").__name__ == "EntryPointPPO"
    finally:
        if "entry_point_ppo" in POLICY_LOSS_FN._entries:
            POLICY_LOSS_FN.unregister("entry_point_ppo")
        sys.modules.pop("ep_losses", None)
