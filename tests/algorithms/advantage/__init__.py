"""Tests of ``trinity_trl.algorithms.advantage``: one module per family, plus the shared behaviour."""
