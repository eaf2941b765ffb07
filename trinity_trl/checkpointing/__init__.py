"""Checkpoints a run can trust: written completely or never resumed from, and read without running code.

`checkpoints` marks a checkpoint folder complete only after every file of it is on disk, resumes from the
last complete one (``resume_from_checkpoint=True`` skips a torn folder with a warning), stores our trainer
state and generation buffer beside TRL's files, and loads tensors with ``weights_only`` reads. Tests:
``tests/checkpointing/``.
"""
