"""Where an asynchronous run stands in its prompt stream (trinity_trl/asynchronous/progress.py)."""

from __future__ import annotations

from trinity_trl.asynchronous.progress import GroupLedger


def test_resume_is_the_first_group_neither_trained_nor_dropped():
    ledger = GroupLedger(start=5)
    assert ledger.resume() == 5
    ledger.record([5, 5, 6], [False, False, True])  # 5 trained, 6 dropped as too stale
    ledger.record([8], [False])  # a later group trained while 7 is still queued
    assert ledger.resume() == 7
    ledger.record([7, -1], [False, False])  # -1: a row's padding
    assert ledger.resume() == 9 and -1 not in ledger.trained


def test_a_group_with_one_trained_sample_counts_as_trained_not_dropped():
    ledger = GroupLedger()
    ledger.record([0, 0, 1, 1], [True, False, True, True])
    assert ledger.dropped_only == {1} and ledger.trained == {0}
