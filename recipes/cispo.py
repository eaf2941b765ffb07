"""`trinity-trl cispo` as a script: `python recipes/cispo.py --config recipes/configs/cispo_cpu.yaml [--option value ...]`.

The recipe itself is `trinity_trl.recipes.cispo` (see its docstring for the options).
"""

import sys

from trinity_trl.cli import main

if __name__ == "__main__":
    main(["cispo", *sys.argv[1:]])
