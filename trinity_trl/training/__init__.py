"""The machinery every trainer shares, apart from the trainer classes that use it.

A trainer in :mod:`trinity_trl.trainers` owns TRL's seams and little else; what happens inside them lives here,
one concern per module, each with its own tests under ``tests/training/``: :mod:`.advantages` (a generation
batch's advantages from the gathered rewards), :mod:`.loss` (token losses to the optimizer step's loss and its
divisor), :mod:`.scoring` (the extra log-prob passes a component asks for), :mod:`.metrics` (TRL's metric lists,
pooled across processes), :mod:`.checks` (input checks and numerical guards), :mod:`.generation` (the interface a
trainer offers to rollouts), :mod:`.engines` and :mod:`.critic_engine` (DDP, DeepSpeed ZeRO and FSDP, and PPO's
value model inside them), :mod:`.model_card` (what the card says about the algorithm) and :mod:`.trl_seams` (the
few places where TRL 1.16 leaves no clean seam). Nothing here imports a trainer class.
"""
