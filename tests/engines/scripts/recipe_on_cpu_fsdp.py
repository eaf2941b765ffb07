"""``python recipes/<recipe>.py ...`` with FSDP on CPU processes: `enable_fsdp_on_cpu` (cpu_fsdp.py, which Accelerate
1.15 needs there), then the recipe file runs as ``__main__``, exactly as the script form does.

Usage (under ``accelerate launch --config_file recipes/accelerate/fsdp.yaml``): recipe_on_cpu_fsdp.py RECIPE_FILE
[recipe options ...]
"""

import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cpu_fsdp import enable_fsdp_on_cpu  # noqa: E402

if __name__ == "__main__":
    enable_fsdp_on_cpu()
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
