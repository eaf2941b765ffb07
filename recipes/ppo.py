"""`trinity-trl ppo` as a script: `python recipes/ppo.py --config recipes/configs/ppo_cpu.yaml [--option value ...]`.

The recipe itself is `trinity_trl.recipes.ppo` (see its docstring for the options).
"""

import sys

from trinity_trl.cli import main

if __name__ == "__main__":
    main(["ppo", *sys.argv[1:]])
