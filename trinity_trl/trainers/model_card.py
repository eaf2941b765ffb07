"""What a model card says about the algorithm: its name, paper and resolved hyper-parameters."""

from __future__ import annotations

import json

from ..algorithms import ALGORITHM_TYPE, AlgorithmConfig

# preset -> (display name, paper title); titles only where the reference is unambiguous
_DISPLAY = {
    "grpo": ("GRPO", "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models"),
    "ppo": ("PPO", "Proximal Policy Optimization Algorithms"),
    "reinforceplusplus": ("REINFORCE++", "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models"),
    "rloo": ("RLOO", "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human Feedback in LLMs"),
    "opmd": ("OPMD", "Trinity-RFT: A General-Purpose and Unified Framework for Reinforcement Fine-Tuning of Large Language Models"),
    "asymre": ("AsymRE", None),
    "dpo": ("DPO", "Direct Preference Optimization: Your Language Model is Secretly a Reward Model"),
    "topr": ("TOPR", None),
    "cispo": ("CISPO", "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention"),
    "gspo": ("GSPO", "Group Sequence Policy Optimization"),
    "sapo": ("SAPO", "Soft Adaptive Policy Optimization"),
    "mix": ("MIX", "On-Policy RL Meets Off-Policy Experts: Harmonizing Supervised Fine-Tuning and Reinforcement "
                   "Learning via Dynamic Weighting"),
    "mix_chord": ("CHORD", "On-Policy RL Meets Off-Policy Experts: Harmonizing Supervised Fine-Tuning and "
                           "Reinforcement Learning via Dynamic Weighting"),
    "raft": ("RAFT", "RAFT: Reward rAnked FineTuning for Generative Foundation Model Alignment"),
    "sppo": ("sPPO", None),
    "rec": ("REC", None),
    "multi_step_grpo": ("Step-wise GRPO", None),
    "on_policy_distill": ("On-policy distillation", "On-Policy Distillation of Language Models: Learning from "
                                                    "Self-Generated Mistakes"),
    "sft": ("SFT", None),
}


def paper_for(algorithm: str) -> tuple[str, dict]:
    """``(display name, TRL _paper dict)`` for a preset."""
    name, title = _DISPLAY.get(algorithm, (algorithm, None))
    reference = ALGORITHM_TYPE.get(algorithm).paper
    paper: dict = {}
    if reference.startswith("arXiv:"):
        paper = {"id": reference.removeprefix("arXiv:"), "title": title or f"{name} ({reference})"}
    return name, paper


def algorithm_card_section(algorithm: AlgorithmConfig, trainer_name: str) -> str:
    """A Markdown section naming the algorithm, its paper and every resolved hyper-parameter."""
    name, paper = paper_for(algorithm.algorithm)
    preset = ALGORITHM_TYPE.get(algorithm.algorithm)
    lines = [
        "",
        f"## Algorithm: {name}",
        "",
        f"Trained with `trinity_trl`'s `{trainer_name}` using the `{algorithm.algorithm}` preset: {preset.description}.",
    ]
    if paper:
        lines.append(f"Paper: [{paper['title']}](https://huggingface.co/papers/{paper['id']}) (arXiv:{paper['id']}).")
    elif preset.paper:
        lines.append(f"Reference: {preset.paper}.")
    lines += ["", "| component | name | arguments |", "|---|---|---|"]
    for component in ("policy_loss_fn", "advantage_fn", "kl_loss_fn", "kl_penalty_fn", "entropy_loss_fn"):
        args = getattr(algorithm, f"{component}_args")
        lines.append(f"| {component} | `{getattr(algorithm, component)}` | `{json.dumps(args, sort_keys=True, default=str)}` |")
    lines.append(f"| loss_agg_mode | `{algorithm.loss_agg_mode}` | |")
    return "\n".join(lines) + "\n"
