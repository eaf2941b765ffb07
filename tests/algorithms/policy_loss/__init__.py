"""Tests of ``trinity_trl.algorithms.policy_loss``: one module per loss family, plus the shared behaviour."""
