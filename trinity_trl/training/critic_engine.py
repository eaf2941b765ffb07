"""PPO's value model in the run's engine: its own wrapping, optimizer, backward, optimizer step and checkpoint files.

The policy is TRL's: transformers prepares it (DDP, a DeepSpeed engine, FSDP) with its optimizer. The critic is a
second trained model with its own optimizer and learning rate, so it gets a wrapping of its own in the same engine:

* one process or DDP: ``accelerator.prepare_model`` (DDP) and a torch optimizer; the value loss is summed with the
  policy loss (one backward: the parameters are disjoint); a checkpoint holds ``critic_optimizer.pt``, the
  trainable parameters and the optimizer state, full, keyed by parameter name;
* FSDP (2): Accelerate's ``fsdp2_prepare_model`` (``fully_shard``) and a torch optimizer over the shards; the same
  single backward; the same file, gathered with ``torch.distributed.checkpoint``'s state-dict functions;
* DeepSpeed ZeRO-1/2/3: a ``DeepSpeedEngine`` of its own (the policy's DeepSpeed config without its optimizer and
  scheduler blocks, our torch optimizer); its own ``engine.backward`` per micro-batch and ``engine.step`` per
  optimizer step; a checkpoint holds ``critic_optimizer_rank{r}.pt``, each process's ZeRO partition (fp32 master
  weights and moments).

Every checkpoint file is read with ``torch.load(weights_only=True)`` (`checkpoint.load_plain`). A ZeRO
optimizer's ``state_dict()`` also holds a few objects derived from the config and the model's layout, not learned
(the loss scaler, the ZeRO stage enum, parameter-slice mappings): they are left out of the file and taken from the
live engine when loading, so the file holds tensors, numbers, strings, lists and dicts only.

The critic's weights for people (``critic/``, ``save_pretrained`` format) are gathered from every process
(`Critic.full_state_dict`) and written by the main process.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from ..checkpointing.checkpoints import load_plain, save_plain
from .engines import engine_of, zero_stage

CRITIC_OPTIMIZER_FILE = "critic_optimizer.pt"
CRITIC_ZERO_FILE = "critic_optimizer_rank{rank}.pt"
_PLAIN_SCALARS = (bool, int, float, str, bytes, type(None))


def _is_plain(value: Any) -> bool:
    """Whether ``torch.load(weights_only=True)`` reads ``value`` back (containers of tensors and scalars)."""
    if isinstance(value, torch.Tensor) or type(value) in _PLAIN_SCALARS:
        return True
    if type(value) in (list, tuple):
        return all(_is_plain(v) for v in value)
    if type(value) is dict:
        return all(type(k) in _PLAIN_SCALARS and _is_plain(v) for k, v in value.items())
    return False


class Critic:
    """The value model, its optimizer and its engine. ``module`` is what a training forward calls (gradients flow
    through the engine); ``model`` is the unwrapped model."""

    module: torch.nn.Module
    model: torch.nn.Module
    optimizer: Any
    #: the critic's loss needs a backward of its own (True: DeepSpeed, whose engine owns backward and step)
    separate_backward: bool = False

    def __init__(self, accelerator):
        self.accelerator = accelerator

    def scoring_module(self) -> torch.nn.Module:
        """What to call for no-grad scoring (generation-time values)."""
        return self.module

    def backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError

    def step(self, lr: float, max_grad_norm: float) -> dict[str, Any]:
        """One optimizer step (after the gradients of every accumulated micro-batch are in) at learning rate
        ``lr``, clipping the critic's own gradient norm at ``max_grad_norm`` (0: no clipping). Returns metrics."""
        raise NotImplementedError

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The critic's full weights on the main process ({} elsewhere); every process must call it."""
        state = self.accelerator.get_state_dict(self.module)
        return state if self.accelerator.is_main_process else {}

    def save(self, folder: str) -> None:
        """Write the resume state into checkpoint ``folder`` (every process calls it)."""
        raise NotImplementedError

    def load(self, folder: str) -> None:
        """Restore the weights and optimizer state written by `save` (every process calls it)."""
        raise NotImplementedError


class TorchCritic(Critic):
    """One process, DDP or FSDP: Accelerate wraps the critic, a torch optimizer trains it."""

    def __init__(self, model: torch.nn.Module, accelerator, build_optimizer: Callable[[torch.nn.Module], Any]):
        super().__init__(accelerator)
        if accelerator.is_fsdp2:
            # Accelerate's prepare_model wants the optimizer too for FSDP2 (it swaps the optimizer's parameters for
            # the shards); the critic's optimizer is built below, over the shards, so the model is sharded alone
            from accelerate.utils.fsdp_utils import fsdp2_prepare_model

            self.module = fsdp2_prepare_model(accelerator, model)
        else:
            self.module = accelerator.prepare_model(model)
        self.model = accelerator.unwrap_model(self.module)
        # after wrapping: FSDP replaces the parameters by their shards
        self.optimizer = build_optimizer(self.model)
        self._fsdp = engine_of(accelerator) == "fsdp"

    def scoring_module(self) -> torch.nn.Module:
        # DDP: the bare model (no gradient, so no DDP bookkeeping or collective per call); FSDP's sharded model
        # must be called as is (it gathers its parameters, every process calls it alike)
        return self.module if self._fsdp else self.model

    def backward(self, loss: torch.Tensor) -> None:
        self.accelerator.backward(loss)

    def step(self, lr: float, max_grad_norm: float) -> dict[str, Any]:
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        metrics: dict[str, Any] = {}
        if max_grad_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            metrics["critic/grad_norm"] = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return metrics

    def _options(self, **extra):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(full_state_dict=True, **extra)

    def save(self, folder: str) -> None:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        weights, optimizer = get_state_dict(
            self.module, self.optimizer, options=self._options(cpu_offload=True, ignore_frozen_params=True)
        )
        if self.accelerator.is_main_process:
            save_plain(
                {"format": 1, "trainable": weights, "optimizer": optimizer}, os.path.join(folder, CRITIC_OPTIMIZER_FILE)
            )

    def load(self, folder: str) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        path = os.path.join(folder, CRITIC_OPTIMIZER_FILE)
        if not os.path.isfile(path):
            raise ValueError(
                f"checkpoint {folder} has no {CRITIC_OPTIMIZER_FILE}: it was not written by PPOTrainer "
                "(or with save_only_model=True, which leaves the critic's optimizer out)"
            )
        state = load_plain(path, what="critic state")
        if not (isinstance(state, dict) and {"trainable", "optimizer"} <= set(state)):
            raise ValueError(f"{path} is not a critic state written by this version of PPOTrainer")
        set_state_dict(
            self.module,
            self.optimizer,
            model_state_dict=state["trainable"],
            optim_state_dict=state["optimizer"],
            options=self._options(strict=False),
        )
        for group in self.optimizer.param_groups:  # set_state_dict hands tuples (Adam's betas) back as lists
            for key, default in self.optimizer.defaults.items():
                if isinstance(default, tuple) and isinstance(group.get(key), list):
                    group[key] = tuple(group[key])


class DeepSpeedCritic(Critic):
    """DeepSpeed: the critic is a DeepSpeed engine of its own, configured like the policy's."""

    separate_backward = True

    def __init__(self, model: torch.nn.Module, accelerator, build_optimizer: Callable[[torch.nn.Module], Any]):
        import deepspeed

        super().__init__(accelerator)
        config = _critic_deepspeed_config(accelerator)
        self.stage = config["zero_optimization"]["stage"]
        self.module, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=build_optimizer(model), config=config
        )
        self.model = self.module.module

    def backward(self, loss: torch.Tensor) -> None:
        # as Accelerate drives the policy's engine: the boundary is the Trainer's, the loss is already divided by
        # the accumulation steps
        self.module.set_gradient_accumulation_boundary(self.accelerator.sync_gradients)
        self.module.backward(loss, scale_wrt_gas=False)

    def step(self, lr: float, max_grad_norm: float) -> dict[str, Any]:
        # clipping: the engine's gradient_clipping, the policy's max_grad_norm (it has no value of its own)
        for group in self.module.optimizer.param_groups:
            group["lr"] = lr
        self.module.step()
        norm = self.module.get_global_grad_norm()
        return {} if norm is None else {"critic/grad_norm": float(norm)}

    def _file(self, folder: str, rank: int) -> str:
        return os.path.join(folder, CRITIC_ZERO_FILE.format(rank=rank))

    def save(self, folder: str) -> None:
        state = self.module.optimizer.state_dict()
        learned = {}
        for key, value in state.items():
            if _is_plain(value):
                learned[key] = value
            elif key in _DERIVED_ZERO_KEYS:
                continue  # taken from the live engine when loading (module docstring)
            else:
                raise TypeError(
                    f"the critic's ZeRO optimizer state has {key!r} of type {type(value).__name__}, "
                    "which a safe checkpoint cannot hold"
                )
        save_plain(
            {"format": 1, "zero_stage": self.stage, "world_size": self.accelerator.num_processes, "optimizer": learned},
            self._file(folder, self.accelerator.process_index),
        )

    def load(self, folder: str) -> None:
        world = self.accelerator.num_processes
        files = [self._file(folder, rank) for rank in range(world)]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ValueError(
                f"checkpoint {folder} lacks {', '.join(os.path.basename(f) for f in missing)}: it was "
                f"not written by PPOTrainer under DeepSpeed with {world} processes (or with "
                "save_only_model=True)"
            )
        live = self.module.optimizer.state_dict()
        derived = {key: live[key] for key in _DERIVED_ZERO_KEYS if key in live}
        states = []
        for path in files:
            saved = load_plain(path, what="critic ZeRO optimizer state")
            if saved.get("zero_stage") != self.stage or saved.get("world_size") != world:
                raise ValueError(
                    f"{path} was written with ZeRO stage {saved.get('zero_stage')} on "
                    f"{saved.get('world_size')} processes; this run has stage {self.stage} on {world}"
                )
            states.append({**saved["optimizer"], **derived})
        # the fp32 master weights are restored from the saved partitions (no precision loss)
        self.module.optimizer.load_state_dict(states, load_optimizer_states=True, load_from_fp32_weights=True)
        if self.stage < 3:
            self.module.optimizer.update_lp_params()  # ZeRO-1/2: the model's parameters from the fp32 masters


# ZeRO optimizer state_dict() entries that are derived from the config and the model's layout, not learned
_DERIVED_ZERO_KEYS = ("loss_scaler", "zero_stage", "param_slice_mappings", "ds_zero_partition_groups")


def _critic_deepspeed_config(accelerator) -> dict[str, Any]:
    """The policy's DeepSpeed config for the critic: same ZeRO stage, micro-batch, accumulation, precision and
    gradient clipping; no optimizer or scheduler block (the critic's torch optimizer is passed in, its learning
    rate set each step); "auto" bucket sizes (derived from the policy's hidden size) left to DeepSpeed."""
    import copy

    config = copy.deepcopy(accelerator.state.deepspeed_plugin.deepspeed_config)
    config.pop("optimizer", None)
    config.pop("scheduler", None)
    zero = config.setdefault("zero_optimization", {})
    for key in [k for k, v in zero.items() if v == "auto"]:
        del zero[key]
    unresolved = sorted(k for k, v in config.items() if v == "auto")
    if unresolved:
        raise ValueError(f"the DeepSpeed config still has 'auto' values {unresolved} when the critic is prepared")
    config["zero_allow_untested_optimizer"] = True
    return config


def build_critic(model: torch.nn.Module, accelerator, build_optimizer: Callable[[torch.nn.Module], Any]) -> Critic:
    """The critic in the run's engine (see the module docstring)."""
    if engine_of(accelerator) == "deepspeed":
        stage = zero_stage(accelerator)
        if stage not in (1, 2, 3):
            raise ValueError(f"PPOTrainer under DeepSpeed needs ZeRO stage 1, 2 or 3 for the critic, got {stage}")
        return DeepSpeedCritic(model, accelerator, build_optimizer)
    return TorchCritic(model, accelerator, build_optimizer)
