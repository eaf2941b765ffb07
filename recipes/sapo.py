"""`trinity-trl sapo` as a script: `python recipes/sapo.py --config recipes/configs/sapo_cpu.yaml [--option value ...]`.

The recipe itself is `trinity_trl.recipes.sapo` (see its docstring for the options).
"""

import sys

from trinity_trl.cli import main

if __name__ == "__main__":
    main(["sapo", *sys.argv[1:]])
