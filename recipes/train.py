"""`trinity-trl train` as a script: `python recipes/train.py --config recipes/configs/train_cpu.yaml [--option value ...]`.

The recipe itself is `trinity_trl.recipes.train` (see its docstring for the options).
"""

import sys

from trinity_trl.cli import main

if __name__ == "__main__":
    main(["train", *sys.argv[1:]])
