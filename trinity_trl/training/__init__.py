"""The machinery every trainer shares, apart from the trainer classes that use it.

A trainer in `trinity_trl.trainers` owns TRL's seams and little else; what happens inside them lives here,
one concern per module, each with its own tests under ``tests/training/``: `advantages` (a generation
batch's advantages from the gathered rewards), `loss` (token losses to the optimizer step's loss and its
divisor), `scoring` (the extra log-prob passes a component asks for), `metrics` (TRL's metric lists,
pooled across processes), `checks` (input checks and numerical guards), `generation` (the interface a
trainer offers to rollouts), `engines` and `critic_engine` (DDP, DeepSpeed ZeRO and FSDP, and PPO's
value model inside them), `model_card` (what the card says about the algorithm) and `trl_seams` (the
few places where TRL 1.16 leaves no clean seam). Nothing here imports a trainer class.
"""
