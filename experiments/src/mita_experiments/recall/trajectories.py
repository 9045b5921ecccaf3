"""The routing diagnostics' trajectories of recall runs (``data.diagnostics=True``) as one CSV
and one PNG: every validation row of each run's metrics.csv, per layer and head.

    python -m mita_experiments.recall.trajectories --out docs/figures/recall_diag \\
        mita=runs/n256-mita fix=runs/n256-fix
"""

from __future__ import annotations

import argparse
import csv
import datetime
import io
import math
from pathlib import Path

from ..trainer import METRICS
from ..utils.files import atomic_write_text
from ..utils.machine import machine_info
from .diagnostics import METRICS as DIAGNOSTICS

FIELDS = ["run", "step", "accuracy", "metric", "layer", "head", "value", "date", "machine"]


def initial(run: str | Path) -> dict[str, str]:
    """A validation row (as in metrics.csv) at step 0: the run's model rebuilt at its initialisation
    (seeded as the trainer seeds it) and evaluated with the diagnostics."""
    import functools

    from .. import trainer
    from ..trainer.data import reseed
    from . import diagnostics, task

    manifest = trainer.read_manifest(run)
    config, attention = manifest["config"], manifest["identity"]["attention"]
    data = task.task_data({**config["data"], "num_train": 1})
    reseed(int(config["train"]["seed"]))
    model = task.build_model(config, data.meta, attention)
    names = diagnostics.model_metric_names(model)
    score = functools.partial(task.scores, diagnostics=True)
    res = trainer.evaluate(model, data.splits["val"], score, 64, metrics=("accuracy", *names))
    return {"step": "0", "split": "val", **{k: str(v) for k, v in res.items()}}


def collect(runs: dict[str, Path], from_init: bool = False) -> list[dict[str, object]]:
    """Long rows (run, step, accuracy, metric, layer, head, value) of the validation rows of ``runs``
    (label -> run folder), with ``from_init`` a step-0 row first (:func:`initial`); a run without
    diagnostics columns is a ValueError naming it."""
    rows: list[dict[str, object]] = []
    for label, run in runs.items():
        path = Path(run) / METRICS
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: is {run} a run folder?")
        with open(path, newline="") as f:
            table = [r for r in csv.DictReader(f) if r["split"] == "val"]
        if from_init:
            table.insert(0, initial(run))
        columns = [c for c in (table[0] if table else {}) if c.split("_l")[0] in DIAGNOSTICS]
        if not columns:
            raise ValueError(f"{path} has no diagnostics columns: train with --set data.diagnostics=True")
        for r in table:
            for col in columns:
                name, where = col.rsplit("_l", 1)
                layer, head = where.split("h")
                rows.append(
                    {
                        "run": label,
                        "step": int(r["step"]),
                        "accuracy": float(r["accuracy"]),
                        "metric": name,
                        "layer": int(layer),
                        "head": int(head),
                        "value": float(r[col]),
                    }
                )
    return rows


def write(rows: list[dict[str, object]], out: str | Path) -> list[Path]:
    """``out``.csv (the rows, with the date and the CPU) and ``out``.png: per layer (rows of panels),
    validation accuracy and each diagnostic against the step, one line per run (mean over heads,
    the heads' range shaded)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    stamp = {"date": datetime.date.today().isoformat(), "machine": machine_info()["cpu_model"]}
    text = io.StringIO()
    writer = csv.DictWriter(text, FIELDS, lineterminator="\n")
    writer.writeheader()
    writer.writerows({**r, **stamp} for r in rows)
    csv_path = out.with_suffix(".csv")
    atomic_write_text(csv_path, text.getvalue())
    runs = list(dict.fromkeys(str(r["run"]) for r in rows))
    layers = sorted({int(r["layer"]) for r in rows})
    panels = ["accuracy", *DIAGNOSTICS]
    fig, axes = plt.subplots(len(layers), len(panels), figsize=(3.2 * len(panels), 2.8 * len(layers)), squeeze=False)
    for i, layer in enumerate(layers):
        for j, panel in enumerate(panels):
            ax = axes[i][j]
            for run in runs:
                mine = [r for r in rows if r["run"] == run and r["layer"] == layer]
                if panel == "accuracy":
                    pts = sorted({(r["step"], r["accuracy"]) for r in mine})
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], label=run)
                    continue
                by_step: dict[int, list[float]] = {}
                for r in mine:
                    if r["metric"] == panel and math.isfinite(float(r["value"])):
                        by_step.setdefault(int(r["step"]), []).append(float(r["value"]))
                steps = sorted(by_step)
                (line,) = ax.plot(steps, [sum(by_step[s]) / len(by_step[s]) for s in steps], label=run)
                ax.fill_between(
                    steps,
                    [min(by_step[s]) for s in steps],
                    [max(by_step[s]) for s in steps],
                    alpha=0.15,
                    color=line.get_color(),
                )
            ax.set_title(f"layer {layer}: {panel}", fontsize=9)
            ax.grid(alpha=0.3)
            if i == len(layers) - 1:
                ax.set_xlabel("step")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    png = out.with_suffix(".png")
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return [csv_path, png]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="path stem of the CSV and PNG (e.g. docs/figures/recall_diag)")
    p.add_argument("runs", nargs="+", metavar="LABEL=RUN_DIR", help="runs trained with data.diagnostics=True")
    p.add_argument("--from-init", action="store_true", help="add each run's initialisation as step 0 (one evaluation)")
    args = p.parse_args(argv)
    runs = {}
    for item in args.runs:
        label, sep, run = item.partition("=")
        if not sep or not label or not run:
            p.error(f"a run reads LABEL=RUN_DIR, got {item!r}")
        runs[label] = Path(run)
    for path in write(collect(runs, args.from_init), args.out):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
