"""`trinity-trl chord` as a script: `python recipes/chord.py --config recipes/configs/chord_cpu.yaml [--option value ...]`.

The recipe itself is `trinity_trl.recipes.chord` (see its docstring for the options).
"""

import sys

from trinity_trl.cli import main

if __name__ == "__main__":
    main(["chord", *sys.argv[1:]])
