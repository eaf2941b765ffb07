"""Gradient accumulation drops no micro-batch, under every engine we ship (issue 45 item 2).

A 2026 study (arXiv 2604.23747) traced published wins of mixed SFT+RL methods over SFT then RL partly to a DeepSpeed
ZeRO-1/2 optimizer with CPU offload that kept only some micro-batches' gradients under accumulation (fixed in
DeepSpeed's pull requests 7967 and 7981, in the DeepSpeed we pin). These tests keep it from coming back unseen.

`scripts/accumulation_run.py`, launched with the shipped accelerate configs on 2 CPU processes: DDP and FSDP2 through
Accelerate (float64), and one DeepSpeed launch playing ZeRO-2 and ZeRO-3, with and without CPU offload of the
optimizer, each accumulating as Accelerate drives DeepSpeed, as DeepSpeed's own loop does, and with
`gradient_accumulation_steps=1` and several backward passes per step (PPO's critic, `training/critic_engine.py`)
(float32). For each, the gradients the engine is about to apply at the optimizer step must equal the sum of the 4
micro-batches' gradients (each of the loss divided by 4), averaged over the 2 ranks, computed by plain single-process
PyTorch in float64; and the same run with one micro-batch left out must fail that comparison (and equal the sum
without it).

Tolerance: float64 engines within float64 rounding; float32 engines within float32 rounding of the longest chain of
additions behind one gradient element (rows x widest layer x micro-batches x ranks), relative to the largest
per-micro-batch gradient (tests/tolerance.py). A dropped micro-batch moves the gradients by O(1) of that scale.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from engine_helpers import SCRIPTS, accelerate_launch, run_script
from tolerance import tolerance

sys.path.insert(0, str(SCRIPTS))
from accumulation_run import ACCUMULATION, DROPPED, MODES, ROWS, WIDTHS  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

WORLD = 2
DEEPSPEED_CASES = [
    f"zero{stage}_{'offload_' if offload else ''}{mode}"
    for stage in (2, 3)
    for offload in (False, True)
    for mode in MODES
]
CASES = ["ddp", "fsdp", *DEEPSPEED_CASES]
LAUNCH_OF = {"ddp": "ddp", "fsdp": "fsdp", **dict.fromkeys(DEEPSPEED_CASES, "zero2")}
EXPECTED_ENGINE = {"ddp": ("MULTI_CPU", None, None), "fsdp": ("FSDP", None, 2)}
# the longest chain of additions behind one gradient element: the rows of a micro-batch times the widest layer (the
# backward's matrix products), over the micro-batches and the ranks
TERMS = ROWS * max(WIDTHS) * ACCUMULATION * WORLD


class Launches:
    """One launch per engine config, when a test first needs it."""

    def __init__(self, root: Path):
        self.root, self._done = root, {}

    def result(self, case: str) -> dict:
        launch = LAUNCH_OF[case.removesuffix("_dropped")]
        if launch not in self._done:
            if launch.startswith("zero") and importlib.util.find_spec("deepspeed") is None:
                pytest.fail("deepspeed is not installed (it comes with the test extra: pip install -e '.[test]')")
            out = self.root / launch
            run_script(accelerate_launch(launch, "accumulation_run.py", str(out)), f"accumulation ({launch})")
            self._done[launch] = out
        return torch.load(self._done[launch] / f"{case}.pt", weights_only=True)


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> Launches:
    return Launches(tmp_path_factory.mktemp("accumulation"))


def mismatch(result: dict, without: int | None = None) -> dict[str, float]:
    """Per parameter, how far the engine's gradient is from the reference sum (without micro-batch ``without``), in
    units of the tolerance; at most 1 means equal within rounding."""
    dtype = getattr(torch, result["dtype"].removeprefix("torch."))
    out = {}
    for name, grad in result["grads"].items():
        per_micro_batch = result["reference"][name]  # [ranks, micro-batches, *shape], float64
        kept = [i for i in range(ACCUMULATION) if i != without]
        expected = per_micro_batch[:, kept].sum(1).mean(0)
        bound = tolerance(dtype, terms=TERMS, scale=float(per_micro_batch.abs().max()))
        allowed = bound["atol"] + bound["rtol"] * expected.abs()
        out[name] = float(((grad - expected).abs() / allowed).max())
    return out


@pytest.mark.parametrize("case", CASES)
def test_one_step_with_accumulation_applies_every_micro_batch(launches, case):
    result = launches.result(case)
    engine = result["engine"]
    if case in EXPECTED_ENGINE:
        assert (engine["distributed_type"], engine["zero_stage"], engine["fsdp_version"]) == EXPECTED_ENGINE[case]
        assert result["dtype"] == "torch.float64"
    else:
        stage, offload = int(case[4]), "offload" in case
        assert (engine["distributed_type"], engine["zero_stage"], engine["offload_optimizer"]) == (
            "DEEPSPEED",
            stage,
            offload,
        )
    assert engine["world_size"] == WORLD and result["dropped"] is None
    assert set(result["grads"]) == set(result["reference"]) and len(result["grads"]) == 2 * (len(WIDTHS) - 1)
    far = {name: ratio for name, ratio in mismatch(result).items() if ratio > 1.0}
    assert not far, f"{case}: gradients differ from the sum of the {ACCUMULATION} micro-batches (in tolerances): {far}"


@pytest.mark.parametrize("case", CASES)
def test_a_dropped_micro_batch_fails_the_comparison(launches, case):
    """The same step with micro-batch DROPPED left out (its loss times 0) is far from the full sum on every parameter,
    and equals the sum of the others: the comparison above can see one missing micro-batch."""
    result = launches.result(f"{case}_dropped")
    assert result["dropped"] == DROPPED
    assert min(mismatch(result).values()) > 100.0, case
    assert max(mismatch(result, without=DROPPED).values()) <= 1.0, case
