"""Decoding metrics per lm-eval task, the part lm-eval cannot measure.

Per task: the prompts decoded, mean NFE per prompt, TPF (committed tokens per row forward), batch
TPF (per row slot of every forward run), the forwards run, tokens/s (generated tokens up to EOS
over decode time; with the model's `warmup`, compilation is excluded) and the mean accepted length
of decoders that verify drafts (None for the others). The same definitions as `dlmjax eval`
(`dlmjax.evaluation.runner.RunRecord`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

_RUNS: list[dict] = []  # model info of every finished lm-eval run in this process (printed by `dlmjax lm-eval`)


@dataclass
class TaskMetrics:
    task: str
    prompts: int = 0
    nfe: int = 0  # summed over prompts
    committed: int = 0
    generated: int = 0
    forwards: int = 0
    slot_forwards: int = 0
    wall_s: float = 0.0
    accepted: list[float] = field(default_factory=list)

    def add(self, stream, rows) -> None:
        """Count one finished `Stream` and its rows."""
        self.prompts += len(rows)
        self.nfe += sum(row.nfe for row in rows)
        self.committed += stream.committed
        self.generated += stream.generated
        self.forwards += stream.forwards
        self.slot_forwards += stream.slot_forwards
        self.wall_s += stream.wall_s
        self.accepted += [row.mean_accepted_length for row in rows if row.mean_accepted_length is not None]

    def to_json(self) -> dict:
        return {
            "n": self.prompts,
            "nfe": self.nfe / max(self.prompts, 1),
            "tpf": self.committed / max(self.nfe, 1),
            "batch_tpf": self.committed / max(self.slot_forwards, 1),
            "forwards": self.forwards,
            "tokens_per_s": self.generated / max(self.wall_s, 1e-9),
            "wall_s": self.wall_s,
            "mean_accepted_length": sum(self.accepted) / len(self.accepted) if self.accepted else None,
        }


def record_run(info: dict) -> None:
    _RUNS.append(info)


def recorded_runs() -> list[dict]:
    return list(_RUNS)


def decoding_table(info: dict) -> str:
    """A Markdown table of one run's decoding metrics (`get_model_info()` or a results JSON's
    `config`); empty when no task generated text."""
    metrics = info.get("decoding_metrics") or {}
    if not metrics:
        return ""
    lines = [f"dlmjax decoding metrics ({info.get('decoder')}, {info.get('devices')})", "",
             "| task | n | NFE | TPF | batch TPF | forwards | tokens/s | accepted length |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for task, m in metrics.items():
        accepted = "-" if m["mean_accepted_length"] is None else f"{m['mean_accepted_length']:.2f}"
        lines.append(f"| {task} | {m['n']} | {m['nfe']:.1f} | {m['tpf']:.2f} | {m['batch_tpf']:.2f} | "
                     f"{m['forwards']} | {m['tokens_per_s']:.1f} | {accepted} |")
    return "\n".join(lines)
