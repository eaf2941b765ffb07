"""The typed component value and the check of its arguments against the constructor."""

import pytest

from trinity_trl.algorithms import POLICY_LOSS_FN, resolve_algorithm_config
from trinity_trl.algorithms.component import Component, argument_types, check_arguments, rename_trl_arguments


@pytest.mark.parametrize(
    "value, expected",
    [
        (None, None),
        ("cispo", Component("cispo")),
        ({"name": "cispo", "clip_range_high": 5.0}, Component("cispo", clip_range_high=5.0)),
        ('{"name": "cispo", "clip_range_high": 5.0}', Component("cispo", clip_range_high=5.0)),
        ({"clip_range_high": 5.0}, Component(clip_range_high=5.0)),
        (Component("ppo"), Component("ppo")),
    ],
)
def test_parse_reads_every_spelling(value, expected):
    assert Component.parse("TrinityConfig", "policy_loss", value) == expected


def test_parse_rejects_what_is_not_a_component():
    with pytest.raises(ValueError, match="policy_loss is not a JSON object"):
        Component.parse("TrinityConfig", "policy_loss", "{not json")
    with pytest.raises(ValueError, match="must be a name, a mapping"):
        Component.parse("TrinityConfig", "policy_loss", [1, 2])
    with pytest.raises(ValueError, match="name must be a string"):
        Component.parse("TrinityConfig", "policy_loss", {"name": 3})


def test_to_dict_is_the_yaml_spelling():
    assert Component("cispo", clip_range_high=5.0).to_dict() == {"name": "cispo", "clip_range_high": 5.0}
    assert Component(kl_coef=0.1).to_dict() == {"kl_coef": 0.1}


def test_check_arguments_names_allowed_keys_and_types_on_one_line():
    cispo = POLICY_LOSS_FN.get("cispo")
    with pytest.raises(ValueError, match=r"takes no argument\(s\) \['clip_range_hi'\].*clip_range_high: float") as err:
        check_arguments("policy loss", "cispo", cispo, {"clip_range_hi": 5.0})
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="clip_range_high must be float, got str '5.0x'") as err:
        check_arguments("policy loss", "cispo", cispo, {"clip_range_high": "5.0x"})
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="enable_mask_clip must be bool, got int"):
        check_arguments("policy loss", "cispo", cispo, {"enable_mask_clip": 1})
    check_arguments("policy loss", "cispo", cispo, {"clip_range_high": 5})  # an int is a float
    assert argument_types(cispo)["clip_range_high"] == "float"


def test_trl_names_are_renamed_once():
    ppo = POLICY_LOSS_FN.get("ppo")
    assert rename_trl_arguments("policy loss", "ppo", ppo, {"epsilon_high": 0.28}) == {"clip_range_high": 0.28}
    with pytest.raises(ValueError, match="set it once"):
        rename_trl_arguments("policy loss", "ppo", ppo, {"epsilon_high": 0.28, "clip_range_high": 0.3})
    resolved = resolve_algorithm_config("grpo", merge_args=True, policy_loss={"epsilon": 0.1})
    assert resolved.policy_loss.args["clip_range"] == 0.1 and "epsilon" not in resolved.policy_loss.args
    # CISPO's TRL cap means another quantity: not a name of its argument, so an error lists its arguments
    with pytest.raises(ValueError, match="epsilon_high.*clip_range_high: float"):
        resolve_algorithm_config("cispo", policy_loss={"epsilon_high": 5.0})
