"""What happens inside a trainer's seams: the machinery the trainer classes compose, not the trainers themselves.

``training/`` versus ``trainers/``: `trinity_trl.trainers` holds the classes a user constructs, whose methods are the
ones TRL calls by name; each such method hands its work to a module here and takes the result back. Nothing here
imports a trainer class, and each module is tested on its own under ``tests/training/``: `advantages` (a generation
batch's advantages from the gathered rewards), `loss` (token losses to the optimizer step's loss and its
divisor), `scoring` (the extra log-prob passes a component asks for), `metrics` (TRL's metric lists,
pooled across processes), `checks` (input checks, numerical guards and the Hub checks), `trl_generation` (the
interface a trainer offers to rollouts), `engines` and `critic_engine` (DDP, DeepSpeed ZeRO and FSDP, the engine
check, and PPO's value model inside them), `model_card` (what the card says about the algorithm) and `grpo_seams` (the
few places where TRL 1.16 leaves no clean seam).
"""
