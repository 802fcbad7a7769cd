"""Evaluate decoders on tasks; same as `dlmjax eval` (see `dlmjax eval --help`).

    python eval/run.py --model toy-sdar --task toy-arith --decoder static --decoder psd --limit 64
"""

import sys

from dlmjax.cli import main

if __name__ == "__main__":
    sys.exit(main(["eval", *sys.argv[1:]]))
