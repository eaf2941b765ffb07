"""Tests of ``trinity_trl.algorithms``, laid out like the package: the tests of ``algorithms/x/y.py`` are in
``x/test_y.py``. A package, so test module names may repeat those of ``tests/trainers``."""
