"""Evaluation outputs: results.json, outputs.jsonl, a Markdown table and a Pareto plot."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shlex
import time
from pathlib import Path

from dlmjax.evaluation.runner import RunRecord
from dlmjax.io.files import atomic_file, write_atomic

log = logging.getLogger(__name__)


def markdown_table(records: list[RunRecord]) -> str:
    """One row per (task, decoder); speedup is the task's first decoder's wall time over this one's.
    NFE is per prompt, forwards for the whole task; batch TPF = committed tokens per row slot of
    those forwards (TPF less the slots idle rows held). Where a decoder verifies drafts, the mean
    accepted length per row. With `--compare-to`, two columns more: the prompts whose tokens equal
    the reference decoder's, and the positions that do. A task's skipped dataset rows are noted."""
    compared = records and records[0].compared_to is not None
    accepted = any(r.mean_accepted_length is not None for r in records)  # drafter, mrp-spec, psd with depth > 1
    extra = (" accepted length |" if accepted else "") + (
        f" same as `{records[0].compared_to}` | token agreement |" if compared else "")
    lines = [
        "| task | decoder | n | accuracy | NFE | TPF | useful TPF | forwards | batch TPF | tokens/s | speedup |" + extra,
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * (accepted + 2 * bool(compared)),
    ]
    baseline: dict[str, float] = {}
    for r in records:
        base = baseline.setdefault(r.task, r.wall_s)
        length = "" if not accepted else " - |" if r.mean_accepted_length is None else f" {r.mean_accepted_length:.2f} |"
        agreement = f" {100 * r.identical_rows:.1f}% | {100 * r.token_agreement:.2f}% |" if compared else ""
        lines.append(
            f"| {r.task} | `{r.decoder}` | {r.n} | {100 * r.accuracy:.1f}% | {r.nfe:.1f} | {r.tpf:.2f} | "
            f"{r.useful_tpf:.2f} | {r.forwards} | {r.batch_tpf:.2f} | {r.tokens_per_s:.0f} | "
            f"{base / max(r.wall_s, 1e-9):.2f}x |" + length + agreement
        )
    skipped = {r.task: r.skipped_rows for r in records if r.skipped_rows}
    notes = "".join(f"\n{task}: {n} dataset row{'s' if n > 1 else ''} skipped (results.json's skipped_rows says "
                    "which and why)\n" for task, n in skipped.items())
    return "\n".join(lines) + "\n" + notes


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (tpf, accuracy) points no other point beats on both, sorted by TPF."""
    front = [p for p in points if not any(q != p and q[0] >= p[0] and q[1] >= p[1] for q in points)]
    return sorted(set(front))


def pareto_plot(records: list[RunRecord], path: Path, title: str = "") -> Path:
    """Accuracy vs TPF, one panel per task, every decoder labelled, the Pareto front drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(r.task for r in records))
    decoders = list(dict.fromkeys(r.decoder for r in records))
    colors = plt.get_cmap("tab20" if len(decoders) > 10 else "tab10")
    markers = "osD^vP*Xh<>"
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 4.2), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        rows = [r for r in records if r.task == task]
        for r in rows:  # one colour and marker per decoder, the same in every panel
            i = decoders.index(r.decoder)
            ax.scatter(r.tpf, 100 * r.accuracy, s=36, color=colors(i % colors.N), marker=markers[i % len(markers)],
                       label=r.decoder, alpha=0.85)
        front = pareto_front([(r.tpf, 100 * r.accuracy) for r in rows])
        ax.plot([p[0] for p in front], [p[1] for p in front], "k--", lw=0.8, label="Pareto front")
        ax.set_xlabel("tokens per forward (TPF)")
        ax.set_ylabel("accuracy (%)")
        ax.set_title(task)
        ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    # beside the panels, however long the labels (a controller's path in a tspd label): the saved
    # image grows to hold it
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=7, frameon=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png", bbox_inches="tight")
    plt.close(fig)
    return path


def run_settings(argv: list[str] | None, **resolved) -> dict:
    """What a run was and where it ran, for results.json: the command, the settings it resolved to
    (`resolved`, e.g. the checkpoint directory and batch size), the numerics and kernel mode in
    force, the package versions and the devices."""
    from importlib.metadata import version

    import jax

    from dlmjax import __version__, arithmetic, kernels

    devices = jax.devices()
    return {
        "command": None if argv is None else "dlmjax " + shlex.join(argv),
        **resolved,
        "numerics": dataclasses.asdict(arithmetic.current()),
        "kernels": kernels.current(),
        "versions": {"dlmjax": __version__, "jax": jax.__version__, "jaxlib": version("jaxlib")},
        "devices": {"platform": devices[0].platform, "kind": devices[0].device_kind, "count": len(devices),
                    "processes": jax.process_count()},
    }


RESULT_FILES = ("results.json", "results.md", "pareto.png", "outputs.jsonl")


def keep_earlier_results(out_dir: str | Path) -> Path | None:
    """Move an earlier run's result files out of `out_dir`, into out_dir/earlier/<the time they
    were written, UTC>/, so that a new run into the same directory replaces nothing (and an earlier
    run's outputs.jsonl never sits beside this run's results as if it were theirs). That folder, or
    None where there was nothing to move."""
    out_dir = Path(out_dir)
    present = [out_dir / name for name in RESULT_FILES if (out_dir / name).is_file()]
    if not present:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(max(path.stat().st_mtime for path in present)))
    target, n = out_dir / "earlier" / stamp, 1
    while target.exists():
        target, n = out_dir / "earlier" / f"{stamp}-{n}", n + 1
    target.mkdir(parents=True)
    for path in present:
        os.replace(path, target / path.name)
    return target


def write_report(records: list[RunRecord], outputs: list[dict] | None, out_dir: str | Path, *,
                 skipped: dict[str, list[str]] | None = None, title: str = "", settings: dict | None = None,
                 keep_earlier: bool = True) -> str:
    """Write results.json, results.md, pareto.png (and outputs.jsonl when given), each file whole
    or not at all, after moving an earlier run's files aside (`keep_earlier_results`; not with
    `keep_earlier=False`, for results kept in git); return the table. `settings` (see
    `run_settings`) goes into results.json as its "settings"."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if keep_earlier and (moved := keep_earlier_results(out_dir)) is not None:
        log.warning("the earlier results in %s moved to %s", out_dir, moved)
    results = {"settings": settings or {}, "runs": [r.to_json() for r in records], "skipped_rows": skipped or {}}
    write_atomic(out_dir / "results.json", json.dumps(results, indent=2, default=str))
    table = markdown_table(records)
    write_atomic(out_dir / "results.md", (f"{title}\n\n" if title else "") + table)
    if outputs is not None:
        write_atomic(out_dir / "outputs.jsonl", "".join(json.dumps(row) + "\n" for row in outputs))
    pareto_plot(records, out_dir / "pareto.png", title)
    return table
