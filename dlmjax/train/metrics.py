"""Training metrics: one JSON line per logged step and a TensorBoard event file beside it."""

from __future__ import annotations

import json
from pathlib import Path


class MetricsLog:
    """`metrics.jsonl` + `tb/` (TensorBoard scalars) under a run directory.

    On resume from step s, lines after s are dropped so the log matches the restored state.
    """

    def __init__(self, run_dir: str | Path, resume_step: int = 0):
        from tensorboardX import SummaryWriter

        self.path = Path(run_dir) / "metrics.jsonl"
        if self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= resume_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        self._jsonl = self.path.open("a")
        self._tb = SummaryWriter(str(Path(run_dir) / "tb"), purge_step=resume_step + 1 if resume_step else None)

    def write(self, step: int, metrics: dict) -> None:
        record = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        for name, value in record.items():
            if name != "step":
                self._tb.add_scalar(name, value, step)
        self._tb.flush()

    def close(self) -> None:
        self._jsonl.close()
        self._tb.close()
