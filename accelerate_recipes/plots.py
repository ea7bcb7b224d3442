"""The pictures a run leaves in its output directory, as Ultralytics users expect them.

    # loss, lr, eval metrics, samples/s vs step
    plot_results(output / "metrics.jsonl", output / "results.png")
    save_confusion_matrix(counts, class_names, output)   # confusion_matrix.csv and .png

Main process only, after evaluation. matplotlib is imported inside the functions and draws with its
Agg canvas (no pyplot, no display, no global backend change). A picture never stops a run: without
matplotlib the functions print one line saying how to get them and return None; any other failure
prints a warning and returns None.
"""

import csv
import functools
import json
from pathlib import Path

_told_missing = False


def picture(draw):
    """Decorator for a function that writes a picture: it returns None instead of raising (see the
    module's doc)."""

    @functools.wraps(draw)
    def safe(*args, **kwargs):
        global _told_missing
        try:
            return draw(*args, **kwargs)
        except ImportError as err:
            if (err.name or "").split(".")[0] != "matplotlib":
                print(f"warning: {draw.__name__} drew nothing: {err}")
            elif not _told_missing:  # one line per run, not one per picture and epoch
                _told_missing = True
                print(
                    "matplotlib is not installed, so this run draws no pictures (results.png, ...); "
                    "get them with: pip install matplotlib"
                )
        except Exception as err:  # a picture is a convenience; never lose a run over one
            print(f"warning: {draw.__name__} drew nothing: {type(err).__name__}: {err}")
        return None

    return safe


def new_figure(width: float, height: float, layout: str | None = "constrained"):
    """A matplotlib Figure on an Agg canvas, independent of pyplot and of whatever backend the
    process uses.

    layout None: the caller places the axes (a constrained layout draws the figure twice when saving
    it)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), layout=layout)
    FigureCanvasAgg(figure)
    return figure


def read_metrics(metrics_jsonl: str | Path) -> list[dict]:
    """The rows of a metrics.jsonl; a line cut short (a run killed while writing) is skipped."""
    rows = []
    for line in Path(metrics_jsonl).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def _series(rows: list[dict], key: str) -> tuple[list, list]:
    points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return [s for s, _ in points], [v for _, v in points]


def _draw(ax, rows, keys, *, label_prefix: str, markers: bool):
    """Plot each key of `keys` found in `rows` against step; returns how many were drawn."""
    drawn = 0
    for key in keys:
        steps, values = _series(rows, key)
        if not steps:
            continue
        label = key.split("/", 1)[1].replace("_", " ")
        style = dict(marker="o", markersize=5) if markers or len(steps) <= 30 else {}
        ax.plot(steps, values, label=f"{label_prefix}{label}", linewidth=2 if drawn == 0 else 1.2, **style)
        drawn += 1
    return drawn


@picture
def plot_results(
    metrics_jsonl: str | Path,
    png: str | Path,
    title: str | None = None,
    eval_keys: tuple[str, ...] | None = None,
) -> Path | None:
    """results.png: train loss (and eval loss), learning rate, eval metrics and throughput against
    the optimizer step.

    Reads the metrics.jsonl that TrainingProgress writes: train/* losses and train/lr and
    perf/samples_per_second at log steps, eval/* at epoch ends (drawn as markers). Per-class values
    (eval/<metric>/<class>) and counts are left out. `eval_keys` (eval/<name>, ...): draw those in
    the evaluation panel instead of every score, when the scores do not share a scale.
    Returns the path.
    """
    rows = read_metrics(metrics_jsonl)
    keys = list(dict.fromkeys(k for r in rows for k in r))  # in the order they were first logged
    train_losses = [k for k in keys if k.startswith("train/") and k.endswith("loss")]
    # Counts logged beside the scores (eval/images) are whole numbers in every row: they would
    # flatten the scores.
    eval_metrics = [
        k
        for k in keys
        if k.startswith("eval/")
        and k.count("/") == 1
        and k != "eval/loss"
        and any(isinstance(r.get(k), float) for r in rows)
        and (eval_keys is None or k in eval_keys)
    ]

    # drawn every epoch: fixed margins, half the time of a computed layout
    figure = new_figure(11, 7.5, layout=None)
    (loss, lr), (metric, speed) = figure.subplots(2, 2, sharex=True)
    figure.subplots_adjust(left=0.07, right=0.98, bottom=0.08, top=0.91, wspace=0.18, hspace=0.22)
    panels = [
        (loss, "Loss", [(train_losses, "train ", False), (["eval/loss"], "eval ", True)]),
        (lr, "Learning rate", [(["train/lr"], "", False)]),
        (metric, "Evaluation", [(eval_metrics, "", True)]),
        (speed, "Training throughput (samples/s, all processes)", [(["perf/samples_per_second"], "", False)]),
    ]
    for ax, name, groups in panels:
        drawn = sum(
            _draw(ax, rows, group, label_prefix=prefix, markers=markers) for group, prefix, markers in groups
        )
        ax.set_title(name)
        ax.grid(alpha=0.3)
        if not drawn:
            ax.text(
                0.5, 0.5, "nothing logged yet", ha="center", va="center", transform=ax.transAxes, color="gray"
            )
        elif drawn > 1:
            ax.legend(fontsize=8)
    lr.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    speed.set_ylim(bottom=0)
    scores = [v for k in eval_metrics for v in _series(rows, k)[1]]
    # accuracy, F1, mAP: on their whole scale, not zoomed to noise
    if scores and all(0 <= v <= 1 for v in scores):
        metric.set_ylim(0, 1.02)
    from matplotlib.ticker import MaxNLocator

    # the axes share x: steps are whole numbers
    metric.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in (metric, speed):
        ax.set_xlabel("optimizer step")
    if len(eval_metrics) == 1:
        metric.set_ylabel(eval_metrics[0].split("/", 1)[1].replace("_", " "))
    if rows:
        figure.suptitle(title or f"{Path(png).parent.name}: {rows[-1]['step']} steps")
    png = Path(png)
    figure.savefig(png, dpi=100)
    return png


def normalize_rows(matrix) -> list[list[float]]:
    """Each row divided by its sum (a row with no samples stays 0)."""
    return [[v / s if s else 0.0 for v in row] for row, s in ((row, sum(row)) for row in matrix)]


@picture
def plot_confusion_matrix(
    matrix, class_names: list[str], png: str | Path, normalize: bool = True, title: str | None = None
) -> Path | None:
    """A confusion matrix picture: rows are the true classes, columns the predicted ones (as
    `matrix` holds them).

    normalize divides each row by its count, so the diagonal is each class's recall. Cells are
    annotated when there are at most 30 classes. Returns the path.
    """
    counts = [[int(v) for v in row] for row in (matrix.tolist() if hasattr(matrix, "tolist") else matrix)]
    n = len(counts)
    if n != len(class_names) or any(len(row) != n for row in counts):
        raise ValueError(f"a {n}-row confusion matrix for {len(class_names)} class names")
    values = normalize_rows(counts) if normalize else counts
    side = min(max(6.0, 0.45 * n + 3), 30.0)
    figure = new_figure(side + 1.5, side)
    ax = figure.subplots()
    image = ax.imshow(values, cmap="Blues", vmin=0, vmax=1 if normalize else None)
    figure.colorbar(image, ax=ax, shrink=0.8, label="fraction of the true class" if normalize else "count")
    font = 10 if n <= 12 else 7 if n <= 40 else 5
    ax.set_xticks(range(n), class_names, rotation=90, fontsize=font)
    ax.set_yticks(range(n), class_names, fontsize=font)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    if n <= 30:
        high = max(max(row) for row in values) or 1
        for i in range(n):
            for j in range(n):
                if counts[i][j]:
                    text = f"{values[i][j]:.2f}" if normalize else str(counts[i][j])
                    ax.text(
                        j,
                        i,
                        text,
                        ha="center",
                        va="center",
                        fontsize=font - 1,
                        color="white" if values[i][j] > 0.6 * high else "black",
                    )
    total = sum(map(sum, counts))
    ax.set_title(
        title or f"Confusion matrix{' (normalised per true class)' if normalize else ''}, {total} samples"
    )
    png = Path(png)
    figure.savefig(png, dpi=100)
    return png


def write_confusion_matrix_csv(matrix, class_names: list[str], path: str | Path) -> Path:
    """The counts as CSV: a header of predicted class names, then one row per true class (its name,
    then counts)."""
    path = Path(path)
    rows = matrix.tolist() if hasattr(matrix, "tolist") else matrix
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["true \\ predicted", *class_names])
        for name, row in zip(class_names, rows):
            writer.writerow([name, *(int(v) for v in row)])
    return path


def read_confusion_matrix_csv(path: str | Path) -> tuple[list[str], list[list[int]]]:
    """(class names, counts) back from write_confusion_matrix_csv's file."""
    with Path(path).open(newline="") as f:
        header, *rows = list(csv.reader(f))
    return header[1:], [[int(v) for v in row[1:]] for row in rows]


def save_confusion_matrix(
    matrix,
    class_names: list[str],
    output_dir: str | Path,
    name: str = "confusion_matrix",
    title: str | None = None,
    draw: bool = True,
) -> Path:
    """<name>.csv (the counts; written with or without matplotlib) and, when `draw`, <name>.png
    (normalised) in output_dir. Returns the CSV's path."""
    path = write_confusion_matrix_csv(matrix, class_names, Path(output_dir) / f"{name}.csv")
    if draw:
        plot_confusion_matrix(matrix, class_names, path.with_suffix(".png"), normalize=True, title=title)
    return path


__all__ = [
    "new_figure",
    "picture",
    "plot_confusion_matrix",
    "plot_results",
    "read_confusion_matrix_csv",
    "read_metrics",
    "save_confusion_matrix",
    "write_confusion_matrix_csv",
]
