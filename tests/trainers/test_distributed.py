"""One process and two processes give the same advantages, loss and gradient for the same global batch.

`dist_scripts/equivalence.py` runs one optimizer step of each case below and saves, per rank, the rows of the
generation batch (prompt and completion ids, advantages), the loss of each micro-batch and the gradient just before
the optimizer step. It is launched twice on the same saved tiny model:

* world 1: `python equivalence.py ...`, `per_device_train_batch_size=8`;
* world 2: `python -m torch.distributed.run --standalone --nproc_per_node 2 equivalence.py ...`,
  `per_device_train_batch_size=4` (CPU + gloo through `use_cpu=True`, docs/distributed.md#tested).

Both see the same global generation batch of 8 rollouts (2 prompts x 4 generations) in the same order:
`generation_batch_size` is 8 in both, `RepeatSampler` yields the same rows, and accelerate hands rank 0 the first
contiguous half. Sampling is replaced by a deterministic `rollout_func`, so the completions are identical too.

What must be equal, and why:

* advantages, row by row in global order (rank 0's rows, then rank 1's): they are computed on the rewards (or padded
  token batch) gathered from every process and sliced back;
* the loss: each process's loss is aggregated over its own micro-batch and DDP averages the two processes'
  gradients, so the 1-process loss must equal the MEAN of the two per-process losses, and the 1-process gradient the
  DDP-averaged gradient. That holds when the aggregation is a mean over equally sized halves:
  - `token-mean` (grpo case): both halves must hold the same number of loss tokens, so every completion has the
    same length there;
  - `seq-mean-token-mean` (reinforceplusplus, sapo, chord): the mean over rows of per-row token means; each process
    holds the same number of rows (4 rollouts, and for CHORD 2 expert rows), so completion lengths may differ;
  - `loss_normalization="global"` (cispo_global, step_grpo): each process divides its token sum by the global token
    count / world, so halves with different token counts match exactly (cispo_micro shows they do not otherwise).

Every case runs in the same two launches (one `python`, one `torchrun`), each playing all cases in turn.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from helpers import TINY_LOGP_SCALE, TINY_MODEL_TERMS
from launching import run_launch
from tolerance import approx, assert_close

SCRIPT = Path(__file__).resolve().parent / "dist_scripts" / "equivalence.py"
REPO_ROOT = Path(__file__).resolve().parents[2]
CASES = ("grpo", "grpo_refill", "reinforceplusplus", "cispo_global", "cispo_micro", "sapo", "chord", "step_grpo")
GLOBAL_ROLLOUTS = 8
GLOBAL_EXPERT_ROWS = 4
# generous for an idle 2-core machine (a launch takes about a minute there), scaled by the load when it starts
LAUNCH_TIMEOUT_S = 600
# advantages: a z-score over a group, or whitening over the batch's rows x tokens (8 x at most 8)
ADVANTAGE_TERMS = GLOBAL_ROLLOUTS * 8
# variables a launcher (torchrun, accelerate) sets; the world-1 run must not inherit them
_DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


def _launch(cmd: list[str], label: str) -> None:
    """Run one launch; a start-up that lost its port is retried, nothing else (tests/launching.py)."""
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
    env.update(
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRL_EXPERIMENTAL_SILENCE="1",
        TOKENIZERS_PARALLELISM="false",
        WANDB_MODE="disabled",
    )
    run_launch(cmd, label, timeout_s=LAUNCH_TIMEOUT_S, env=env, cwd=REPO_ROOT)


@pytest.fixture(scope="module")
def runs(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory with `<case>_world1_rank0.pt` and `<case>_world2_rank{0,1}.pt` for every case."""
    out = tmp_path_factory.mktemp("dist_equivalence")
    args = [str(SCRIPT), tiny_model_dir, str(out), *CASES]
    _launch([sys.executable, *args], "1-process run")
    _launch(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args],
        "2-process torchrun",
    )
    return out


def _load(out: Path, case: str):
    one = torch.load(out / f"{case}_world1_rank0.pt", weights_only=False)
    ranks = [torch.load(out / f"{case}_world2_rank{r}.pt", weights_only=False) for r in range(2)]
    assert one["world"] == 1 and one["rank"] == 0
    # a real 2-process group: without use_cpu=True torchrun would run two independent world-1 trainings
    assert [(r["world"], r["rank"]) for r in ranks] == [(2, 0), (2, 1)]
    return one, ranks


def _assert_same_rows(rows_1: list[dict], rows_2: list[dict], expected: int, what: str) -> None:
    assert len(rows_1) == len(rows_2) == expected, (what, len(rows_1), len(rows_2))
    for i, (a, b) in enumerate(zip(rows_1, rows_2, strict=True)):
        assert a["prompt_ids"] == b["prompt_ids"], f"{what} row {i}: prompt differs"
        assert a["completion_ids"] == b["completion_ids"], f"{what} row {i}: completion differs"
        assert len(a["advantages"]) == len(b["advantages"]), f"{what} row {i}: advantage length differs"
        # z-scores of the same rewards (a group's, or whitening over the batch's 8 x 8 tokens) on 1 or 2 processes
        assert_close(
            torch.tensor(b["advantages"]),
            torch.tensor(a["advantages"]),
            terms=ADVANTAGE_TERMS,
            scale=max(1.0, max(abs(x) for row in rows_1 for x in row["advantages"])),
            msg=lambda m, i=i: f"{what} row {i}: advantages differ\n{m}",
        )


def _assert_same_step(one: dict, ranks: list[dict]) -> None:
    """The 1-process rollouts and advantages, loss and gradient equal the 2-process ones (see module docstring)."""
    per_rank = GLOBAL_ROLLOUTS // 2
    assert [len(r["rollouts"]) for r in ranks] == [per_rank, per_rank]
    # global order: rank 0 holds the first contiguous half of the generation batch
    _assert_same_rows(one["rollouts"], ranks[0]["rollouts"] + ranks[1]["rollouts"], GLOBAL_ROLLOUTS, "rollout")
    # one micro-batch per process (gradient_accumulation_steps=1, steps_per_generation=1, max_steps=1)
    assert len(one["losses"]) == 1 and [len(r["losses"]) for r in ranks] == [1, 1]
    mean_of_ranks = sum(r["losses"][0] for r in ranks) / 2
    assert mean_of_ranks == approx(one["losses"][0], terms=TINY_MODEL_TERMS, scale=_loss_scale(one))
    # DDP all-reduces the gradient: both ranks hold the same average, which must be the 1-process gradient
    # exact: every rank receives the same all-reduced buffer (with 2 ranks, a + b == b + a bit for bit)
    assert torch.equal(ranks[0]["grad"], ranks[1]["grad"])
    assert one["grad"].norm() > 0.1  # a real gradient, so the comparison means something
    # the all-reduce sums the ranks' gradients, one process sums all rows: the tiny model's chain, another order
    assert_close(ranks[0]["grad"], one["grad"], terms=TINY_MODEL_TERMS)


def _loss_scale(one: dict) -> float:
    """The magnitude of a policy loss's per-token terms: an advantage times a ratio exp(logp - old), whose rounding is
    relative to the log-probs; the advantages of a group cancel, so the loss itself may be near zero."""
    return max(1.0, max(abs(x) for row in one["rollouts"] for x in row["advantages"])) * TINY_LOGP_SCALE


def _scalar_advantages(rows: list[dict]) -> list[float]:
    assert all(len(r["advantages"]) == 1 for r in rows)
    return [r["advantages"][0] for r in rows]


def test_grpo_one_vs_two_processes(runs: Path):
    """Group advantages (TrinityConfig(algorithm="grpo")), token-mean loss on equal-length completions."""
    one, ranks = _load(runs, "grpo")
    lengths = {len(r["completion_ids"]) for r in one["rollouts"]}
    assert len(lengths) == 1, f"token-mean needs equal token counts per process here, got lengths {lengths}"
    advantages = _scalar_advantages(one["rollouts"])
    # each group's advantages are z-scores with distinct patterns: a slice from the wrong group would not match
    assert advantages[:4] != advantages[4:] and any(abs(a) > 0.5 for a in advantages)
    _assert_same_step(one, ranks)


def test_duplicate_experiences_refill_across_processes(runs: Path):
    """GRPO's duplicate_experiences: the filtered group (rank 0's) is refilled with copies of the kept group, which
    lives on rank 1; both ranks train the same rows, advantages, loss and gradient as one process."""
    one, ranks = _load(runs, "grpo_refill")
    # the 1-process batch: the first group's rows became copies of the second group's (nothing dropped)
    assert one["rollouts"][:4] == one["rollouts"][4:]
    assert any(abs(a) > 0.5 for a in _scalar_advantages(one["rollouts"]))
    # on 2 processes rank 0's rows are the copies drawn from rank 1's group
    assert ranks[0]["rollouts"] == ranks[1]["rollouts"]
    _assert_same_step(one, ranks)


def test_reinforceplusplus_one_vs_two_processes(runs: Path):
    """Batch advantages (global whitening over the gathered, padded (B, T) batch), seq-mean-token-mean loss."""
    one, ranks = _load(runs, "reinforceplusplus")
    widths = [max(len(r["completion_ids"]) for r in rank["rollouts"]) for rank in ranks]
    assert widths[0] < widths[1], f"the processes' padded widths must differ to exercise the padding: {widths}"
    # token-level advantages: one value per completion token
    assert all(len(r["advantages"]) == len(r["completion_ids"]) > 1 for r in one["rollouts"])
    _assert_same_step(one, ranks)


def test_global_token_normalization_makes_token_mean_exact(runs: Path):
    """token-mean over processes with different token counts: loss_normalization="global" gives the 1-process
    loss and gradient exactly; Trinity's default per-micro-batch token mean does not (documented behaviour)."""
    one, ranks = _load(runs, "cispo_global")
    tokens = [sum(len(r["completion_ids"]) for r in rank["rollouts"]) for rank in ranks]
    assert tokens[0] != tokens[1], f"the processes must hold different token counts: {tokens}"
    _assert_same_step(one, ranks)
    one, ranks = _load(runs, "cispo_micro")
    _assert_same_rows(one["rollouts"], ranks[0]["rollouts"] + ranks[1]["rollouts"], GLOBAL_ROLLOUTS, "rollout")
    assert not torch.allclose(ranks[0]["grad"], one["grad"], rtol=1e-3, atol=1e-6)


def test_sapo_one_vs_two_processes(runs: Path):
    """SAPOTrainer (soft gate, seq-mean-token-mean) on ragged completions: same advantages, loss and gradient."""
    one, ranks = _load(runs, "sapo")
    widths = [max(len(r["completion_ids"]) for r in rank["rollouts"]) for rank in ranks]
    assert widths[0] != widths[1]
    _assert_same_step(one, ranks)


def test_chord_one_vs_two_processes(runs: Path):
    """ChordTrainer (mix_chord): same rollouts and advantages, and the two processes' expert rows together are the
    1-process expert rows (one global expert stream, split contiguously), with the same loss and gradient."""
    one, ranks = _load(runs, "chord")
    assert len(one["experts"]) == GLOBAL_EXPERT_ROWS
    assert [len(r["experts"]) for r in ranks] == [GLOBAL_EXPERT_ROWS // 2] * 2
    _assert_same_rows(one["experts"], ranks[0]["experts"] + ranks[1]["experts"], GLOBAL_EXPERT_ROWS, "expert")
    assert _scalar_advantages(one["experts"]) == [0.0] * GLOBAL_EXPERT_ROWS
    assert len({tuple(r["completion_ids"]) for r in one["experts"]}) == GLOBAL_EXPERT_ROWS  # 4 distinct rows
    advantages = _scalar_advantages(one["rollouts"])
    assert advantages[:4] != advantages[4:] and any(abs(a) > 0.5 for a in advantages)
    _assert_same_step(one, ranks)


def test_step_grpo_one_vs_two_processes(runs: Path):
    """StepGRPOTrainer: the same runs give the same step-wise advantages (whole-run rows, token-level
    advantages) and, with global token normalisation, the same gradient on 1 and 2 processes."""
    one, ranks = _load(runs, "step_grpo")
    assert one["steps"] == ranks[0]["steps"] + ranks[1]["steps"]
    assert len(set(one["steps"])) > 1  # runs of different lengths
    _assert_same_rows(one["rollouts"], ranks[0]["rollouts"] + ranks[1]["rollouts"], GLOBAL_ROLLOUTS, "run")
    assert any(abs(a) > 0.1 for row in one["rollouts"] for a in row["advantages"])
    # global token normalisation: each process divides its token sum by the global count / world, so the mean of the
    # two per-process losses is the 1-process loss
    assert len(one["losses"]) == 1 and [len(r["losses"]) for r in ranks] == [1, 1]
    assert sum(r["losses"][0] for r in ranks) / 2 == approx(
        one["losses"][0], terms=TINY_MODEL_TERMS, scale=_loss_scale(one)
    )
    assert torch.equal(ranks[0]["grad"], ranks[1]["grad"])
    assert one["grad"].norm() > 0.01
    assert_close(ranks[0]["grad"], one["grad"], terms=TINY_MODEL_TERMS)
