"""One optimizer step with gradient accumulation under the engine the launcher set up; record the gradients.

Launched by `tests/engines/test_accumulation.py` with `accelerate launch --config_file recipes/accelerate/<engine>.yaml
--num_processes 2 --mixed_precision no accumulation_run.py OUT` (the shipped configs, on CPU processes with gloo).
Each rank trains a small MLP on its own 4 micro-batches (rank r, micro-batch i: seed 1000 + 10 r + i) and, just
before the optimizer step, writes the full gradient of every parameter as the engine holds it then:

* `ddp` (Accelerate's MULTI_CPU: DDP) and `fsdp` (FSDP2, `fully_shard`): `Accelerator(gradient_accumulation_steps=4)`,
  `accelerator.accumulate` and `accelerator.backward`, as transformers' Trainer drives them; float64.
* a DeepSpeed launch (`zero2.yaml`) plays 12 cases: ZeRO-2 and ZeRO-3, `offload_optimizer` none or cpu, and three
  ways of accumulating, each engine built by `deepspeed.initialize` (one launch: DeepSpeed's start-up is the slow part):
  - `ga4`: `gradient_accumulation_steps: 4`, each micro-batch through Accelerate's `DeepSpeedEngineWrapper.backward`
    with Accelerate's `sync_gradients` (the boundary set on the 4th; engine.backward divides the loss by 4; engine.step
    at the boundary), as `Accelerator.backward` does under transformers' Trainer;
  - `ga4_engine_counter`: `gradient_accumulation_steps: 4`, engine.backward and engine.step on every micro-batch, the
    engine counting its micro-steps to find the boundary (DeepSpeed's own training loop, as other frameworks drive it);
  - `ga1_boundaries`: `gradient_accumulation_steps: 1` and 4 backward passes per step, the boundary set by
    `set_gradient_accumulation_boundary` on the last one only (the loss divided by 4 beforehand, `scale_wrt_gas=False`),
    as `trinity_trl.training.critic_engine.DeepSpeedCritic` drives PPO's critic.
  With CPU offload the optimizer is torch's AdamW (`zero_force_ds_cpu_optimizer: false`): DeepSpeed's own CPU Adam is
  a C++ extension compiled at first use (minutes), and the accumulation under test is the ZeRO optimizer's, before
  any Adam runs. float32 (DeepSpeed's ZeRO optimizers hold float32 master gradients).

Rank 0 also computes, with plain single-process PyTorch in float64 from the same initial weights, each of the 8
micro-batches' gradients (of the loss divided by the 4 accumulation steps, as the engines scale it), and writes
`OUT/<case>.pt`: `engine` (what the launch set up), `dtype`, `grads` (the engine's, float64) and `reference`
(`{name: tensor [ranks, micro-batches, *shape]}`). The test sums and compares them.

Every case runs twice: as described, and with micro-batch `DROPPED` left out of the step on every rank (its loss
multiplied by 0, so its gradient is missing from the sum while the engine's micro-steps run as usual: a deliberately
broken accumulation, `<case>_dropped.pt`), to show that the comparison fails then.

Usage: accumulation_run.py OUT_DIR [--no_cpu_fsdp]
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)

import torch  # noqa: E402
from cpu_fsdp import enable_fsdp_on_cpu  # noqa: E402

ACCUMULATION = 4
WIDTHS = (24, 37, 33, 5)  # odd sizes: ZeRO partitions and buckets split parameters mid-tensor
ROWS = 6
DROPPED = 2
MODES = ("ga4", "ga4_engine_counter", "ga1_boundaries")


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(WIDTHS, WIDTHS[1:]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


def fresh_model(dtype: torch.dtype) -> MLP:
    torch.manual_seed(0)  # the same initial weights on every rank and in the reference
    return MLP().to(dtype)


def micro_batch(rank: int, index: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + 10 * rank + index)
    x = torch.randn(ROWS, WIDTHS[0], generator=generator, dtype=torch.float64)
    y = torch.randn(ROWS, WIDTHS[-1], generator=generator, dtype=torch.float64)
    return x.to(dtype), y.to(dtype)


def loss_of(model, batch) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def reference(world: int) -> dict[str, torch.Tensor]:
    """Each micro-batch's gradient of ``loss / ACCUMULATION``, plain PyTorch, float64:
    ``{name: [world, 4, *shape]}``."""
    model = fresh_model(torch.float64)
    out: dict[str, list] = {name: [] for name, _ in model.named_parameters()}
    for rank in range(world):
        per_rank: dict[str, list] = {name: [] for name in out}
        for index in range(ACCUMULATION):
            model.zero_grad()
            (loss_of(model, micro_batch(rank, index, torch.float64)) / ACCUMULATION).backward()
            for name, parameter in model.named_parameters():
                per_rank[name].append(parameter.grad.detach().clone())
        for name in out:
            out[name].append(torch.stack(per_rank[name]))
    return {name: torch.stack(values) for name, values in out.items()}


def accelerate_step(drop: int | None) -> tuple[dict, dict[str, torch.Tensor]]:
    """DDP / FSDP2 through Accelerate; the gradients before the optimizer step, gathered in full."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION)
    model = fresh_model(torch.float64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    rank = accelerator.process_index
    for index in range(ACCUMULATION):
        with accelerator.accumulate(model):
            loss = loss_of(model, micro_batch(rank, index, torch.float64))
            accelerator.backward(loss * (0.0 if index == drop else 1.0))
            if index == ACCUMULATION - 1:
                assert accelerator.sync_gradients, "the 4th micro-batch must be the accumulation boundary"
                grads = {name: _full(p.grad) for name, p in accelerator.unwrap_model(model).named_parameters()}
            optimizer.step()
            optimizer.zero_grad()
    state = accelerator.state
    engine = {
        "distributed_type": str(state.distributed_type).split(".")[-1],
        "fsdp_version": getattr(getattr(state, "fsdp_plugin", None), "fsdp_version", None),
        "zero_stage": None,
        "world_size": accelerator.num_processes,
    }
    return engine, grads


def _full(grad) -> torch.Tensor:
    if hasattr(grad, "full_tensor"):  # FSDP2: a DTensor shard
        grad = grad.full_tensor()
    return grad.detach().double().clone()


def deepspeed_step(stage: int, offload: bool, mode: str, drop: int | None) -> tuple[dict, dict[str, torch.Tensor]]:
    """One ZeRO engine of the launch's stage, with or without CPU offload of the optimizer, accumulating as ``mode``
    says; the full gradients just before the ZeRO optimizer's step."""
    import deepspeed
    from accelerate.utils.deepspeed import DeepSpeedEngineWrapper
    from deepspeed.utils import safe_get_full_grad

    ga = 1 if mode == "ga1_boundaries" else ACCUMULATION
    world = torch.distributed.get_world_size()
    zero = {"stage": stage, "reduce_bucket_size": 200, "allgather_bucket_size": 200}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=200)
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": ROWS,
        "gradient_accumulation_steps": ga,
        "train_batch_size": ROWS * ga * world,
        "gradient_clipping": 0.0,
        "zero_optimization": zero,
        "zero_force_ds_cpu_optimizer": False,
        "zero_allow_untested_optimizer": True,
    }
    model = fresh_model(torch.float32)
    names = {id(p): name for name, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    captured: dict[str, torch.Tensor] = {}
    zero_step = engine.optimizer.step

    def capturing_step(*args, **kwargs):  # what the optimizer is about to apply
        for parameter in engine.module.parameters():
            captured[names[id(parameter)]] = safe_get_full_grad(parameter).detach().double().clone()
        return zero_step(*args, **kwargs)

    engine.optimizer.step = capturing_step
    rank = torch.distributed.get_rank()
    wrapper = DeepSpeedEngineWrapper(engine)
    for index in range(ACCUMULATION):
        batch = micro_batch(rank, index, torch.float32)
        loss = loss_of(engine, batch) * (0.0 if index == drop else 1.0)
        if mode == "ga4":  # as Accelerator.backward: the boundary is Accelerate's sync_gradients
            wrapper.backward(loss, sync_gradients=index == ACCUMULATION - 1)  # engine.backward divides by 4
        elif mode == "ga4_engine_counter":  # DeepSpeed's own loop: the engine counts its micro-steps
            engine.backward(loss)
            engine.step()
        else:
            engine.set_gradient_accumulation_boundary(index == ACCUMULATION - 1)
            engine.backward(loss / ACCUMULATION, scale_wrt_gas=False)
            if index == ACCUMULATION - 1:
                engine.step()
    if not captured:
        raise RuntimeError(f"ZeRO-{stage} ({mode}) never stepped its optimizer")
    engine.destroy()
    return {
        "distributed_type": "DEEPSPEED",
        "zero_stage": stage,
        "offload_optimizer": offload,
        "mode": mode,
        "world_size": world,
    }, captured


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--no_cpu_fsdp", action="store_true")
    options = parser.parse_args()
    os.makedirs(options.out, exist_ok=True)
    results = {}
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        for stage in (2, 3):  # one launch (DeepSpeed's start-up is the slow part), an engine per case
            for offload in (False, True):
                for mode in MODES:
                    name = f"zero{stage}_{'offload_' if offload else ''}{mode}"
                    results[name] = deepspeed_step(stage, offload, mode, None)
                    results[f"{name}_dropped"] = deepspeed_step(stage, offload, mode, DROPPED)
        dtype = torch.float32
    else:
        if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and not options.no_cpu_fsdp:
            enable_fsdp_on_cpu()
        engine, grads = accelerate_step(None)
        name = "fsdp" if engine["distributed_type"] == "FSDP" else "ddp"
        results[name] = (engine, grads)
        results[f"{name}_dropped"] = accelerate_step(DROPPED)
        dtype = torch.float64
    world = torch.distributed.get_world_size()
    if torch.distributed.get_rank() == 0:
        expected = reference(world)
        for name, (engine, grads) in results.items():
            dropped = DROPPED if name.endswith("_dropped") else None
            torch.save(
                {"engine": engine, "dtype": str(dtype), "grads": grads, "reference": expected, "dropped": dropped},
                os.path.join(options.out, f"{name}.pt"),
            )
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
