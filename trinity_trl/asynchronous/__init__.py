"""What happens inside the asynchronous trainers' seams (`trinity_trl.trainers.async_trinity`), the machinery they
compose on top of TRL's ``AsyncGRPOTrainer``: `worker` (a rollout worker that generates with transformers from its
own copy of the policy, and its weight transfer), `batch` (a packed micro-batch as the per-sample layout our losses
read) and `async_grpo_seams` (the few places where TRL's asynchronous trainer leaves no public seam, each with its
reason).
Nothing here imports a trainer class; tests: ``tests/asynchronous/``. User guide: ``docs/asynchronous.md``.
"""
