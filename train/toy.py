"""Train a toy backbone (toy-sdar, toy-ar) from a YAML config; rerun the same command to resume.

    python train/toy.py configs/toy-sdar.yaml --out runs/toy-sdar [section.key=value ...]

Same as `dlmjax train`.
"""

import sys

from dlmjax.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
