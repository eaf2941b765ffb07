"""Where an asynchronous run stands in its prompt stream: which groups it trained, which it dropped as too stale.

The worker numbers the groups it generates by their position in the prompt stream (TRL's ``group_id``). A group is
**trained** once the loss ran on one of its samples (or took its samples in a step with nothing to train: they are
used up, not to be generated again), and **dropped** when its samples were too stale to train: TRL's queue dataset
dropped them, or the loss left them out. A checkpoint records the first group that is neither (`GroupLedger.resume`):
a resumed run's worker starts there, so no group is trained twice or skipped, and a dropped group is counted, not
generated again. Groups are generated in order, so what lies before that position was trained or dropped; a group
split across the checkpoint (some samples trained, the rest still queued) counts as trained.
"""

from __future__ import annotations

from collections.abc import Iterable


class GroupLedger:
    """The groups a run trained and dropped, from stream position ``start`` (a resumed run's first group) on.

    Args:
        start: the stream position the worker started at.
    """

    def __init__(self, start: int = 0):
        self.start = start
        self.trained: set[int] = set()
        self.dropped: set[int] = set()

    def record(self, groups: Iterable[int], stale: Iterable[bool]) -> None:
        """Each of ``groups`` trained (``stale`` false) or dropped as too stale (true); negative ids (padding) are
        skipped."""
        for group, too_stale in zip(groups, stale):
            if group >= 0:
                (self.dropped if too_stale else self.trained).add(int(group))

    @property
    def dropped_only(self) -> set[int]:
        """The groups dropped whole (none of their samples trained)."""
        return self.dropped - self.trained

    def resume(self) -> int:
        """The first stream position at or after ``start`` that the run neither trained nor dropped."""
        position = self.start
        while position in self.trained or position in self.dropped:
            position += 1
        return position
