"""`trinity-trl step_grpo` as a script: `python recipes/step_grpo.py --config recipes/configs/step_grpo_cpu.yaml [--option value ...]`.

The recipe itself is `trinity_trl.recipes.step_grpo` (see its docstring for the options).
"""

import sys

from trinity_trl.cli import main

if __name__ == "__main__":
    main(["step_grpo", *sys.argv[1:]])
