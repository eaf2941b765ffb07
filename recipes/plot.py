"""A PNG of the training curves from a trainer's ``log_history``: reward (and the share of rollout groups with
non-zero advantages), μ, the SFT and RL losses."""

from __future__ import annotations

import logging
from collections.abc import Sequence

logger = logging.getLogger(__name__)

# panel title -> metric keys, first present wins per line; panels without any logged key are left out
PANELS: list[tuple[str, list[tuple[str, Sequence[str]]]]] = [
    (
        "reward",
        [("mean reward", ("reward",)), ("groups with non-zero advantages (fraction)", ("frac_reward_zero_std",))],
    ),
    ("μ (SFT weight)", [("mu", ("actor/mu",))]),
    (
        "losses",
        [
            ("SFT loss", ("actor/expert/sft_phi_loss", "actor/expert/sft_loss")),
            ("RL loss", ("actor/usual/pg_loss", "actor/pg_loss")),
            ("total loss", ("loss",)),
        ],
    ),
    ("value loss", [("value loss", ("critic/vf_loss", "value_loss"))]),
]
# keys plotted as a function of the logged value: TRL logs the fraction of groups whose rewards are all equal
TRANSFORMS = {"frac_reward_zero_std": lambda value: 1.0 - value}


def curves(log_history: list[dict]) -> dict[str, dict[str, tuple[list[int], list[float]]]]:
    """``{panel: {line: (steps, values)}}`` for the keys present in ``log_history`` (training entries only)."""
    found: dict[str, dict[str, tuple[list[int], list[float]]]] = {}
    for title, lines in PANELS:
        for label, keys in lines:
            key = next((k for k in keys if any(k in entry for entry in log_history)), None)
            if key is None:
                continue
            transform = TRANSFORMS.get(key, float)
            points = [
                (entry["step"], transform(float(entry[key])))
                for entry in log_history
                if key in entry and "step" in entry and "train_runtime" not in entry
            ]
            if points:
                found.setdefault(title, {})[label] = ([s for s, _ in points], [v for _, v in points])
    return found


def plot_training(log_history: list[dict], path: str) -> str | None:
    """Write the curves to ``path`` (PNG); returns the path, or None when matplotlib is missing or nothing was
    logged."""
    data = curves(log_history)
    if not data:
        logger.warning("no training metrics to plot")
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no plot written (pip install matplotlib)")
        return None
    fig, axes = plt.subplots(1, len(data), figsize=(4.2 * len(data), 3.4), squeeze=False)
    for ax, (title, lines) in zip(axes[0], data.items()):
        for label, (steps, values) in lines.items():
            ax.plot(steps, values, marker="o", markersize=2.5, linewidth=1.2, label=label)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(lines) > 1:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
