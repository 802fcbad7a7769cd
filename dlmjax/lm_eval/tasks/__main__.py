"""python -m dlmjax.lm_eval.tasks DIR: write the task YAMLs (absolute data paths) for --include_path DIR."""

import sys

from dlmjax.lm_eval.tasks import TASKS, write_tasks

if len(sys.argv) != 2:
    sys.exit("usage: python -m dlmjax.lm_eval.tasks DIR   (writes lm-eval task YAMLs for --include_path DIR)")
print(f"wrote {', '.join(name for name, _, _ in TASKS.values())} to {write_tasks(sys.argv[1])}")
