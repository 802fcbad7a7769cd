"""Training metrics: one JSON line per logged step and a TensorBoard event file beside it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from dlmjax.io.files import write_atomic


class MetricsLog:
    """`metrics.jsonl` + `tb/` (TensorBoard scalars) under a run directory.

    On resume from step s, lines after s are dropped so the log matches the restored state (and a
    last line cut off by a kill mid-write, which belongs to a step after the checkpoint).
    `metrics.jsonl` is the record: `tb/` is rebuilt from its rows whenever a run (re)opens, since
    TensorBoard's writer queues events in the background and a killed run loses the last ones.
    """

    def __init__(self, run_dir: str | Path, resume_step: int = 0):
        from tensorboardX import SummaryWriter

        self.path = Path(run_dir) / "metrics.jsonl"
        self.rows: list[dict] = []
        if self.path.exists():
            self.rows = [row for row in _read_rows(self.path) if row["step"] <= resume_step]
            write_atomic(self.path, "".join(json.dumps(row) + "\n" for row in self.rows))
        self._jsonl = self.path.open("a")
        shutil.rmtree(Path(run_dir) / "tb", ignore_errors=True)
        self._tb = SummaryWriter(str(Path(run_dir) / "tb"))
        for row in self.rows:
            self._add_scalars(row)
        self._tb.flush()

    def has(self, step: int, prefix: str) -> bool:
        """Whether a row of `step` holds a metric named `prefix`... (e.g. "eval/")."""
        return any(row["step"] == step and any(k.startswith(prefix) for k in row) for row in self.rows)

    def write(self, step: int, metrics: dict) -> None:
        record = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        self.rows.append(record)
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        self._add_scalars(record)
        self._tb.flush()

    def _add_scalars(self, row: dict) -> None:
        for name, value in row.items():
            if name != "step":
                self._tb.add_scalar(name, value, row["step"])

    def close(self) -> None:
        self._jsonl.close()
        self._tb.close()


def _read_rows(path: Path) -> list[dict]:
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:  # a kill mid-write: a step after the checkpoint, written again
                break
            from dlmjax.validation import InputError

            raise InputError(f"{path} line {i + 1} is not JSON ({line[:60]!r}); delete that line to resume") from None
    return rows
