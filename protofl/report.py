"""Run results: per-round records, summaries, results.json / metrics.csv / PNG, the progress and
summary lines of the log, comparison tables.

No flwr imports: the server strategy feeds a :class:`RunRecorder` (which feeds the run's trackers,
:mod:`protofl.tracking`), the comparison runner reads the files back. The results.json schema is
documented in docs/user-guide/evaluation.md.
"""

from __future__ import annotations

import contextlib
import csv
import datetime
import json
import math
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np

from protofl.task.storage import atomic_write
from protofl.tracking import Tracking

SCHEMA_VERSION = 1
# Keys every round record carries (None where a quantity was not measured that round).
ROUND_KEYS = (
    "round",
    "global_accuracy",
    "personalized_accuracy",
    "personalized_std",
    "train_loss",
    "bytes_up",
    "bytes_down",
    "seconds",
)
# the two accuracies a run reports each round: their short names and line styles in plots
REPEATED_METRICS = {"global_accuracy": "GM", "personalized_accuracy": "PM"}
CURVE_STYLES = {"global_accuracy": "-", "personalized_accuracy": "--"}
SUMMARY_KEYS = (
    "global_accuracy",
    "personalized_accuracy",
    # PM of each predictor a method logs side by side (nearest global prototype, nearest anchor, head)
    "personalized_accuracy_prototype",
    "personalized_accuracy_anchor",
    "personalized_accuracy_head",
    "pm_l",
    "pm_v",
)


def personalized_stats(correct: Sequence[int], totals: Sequence[int]) -> dict[str, float]:
    """Across-client accuracy statistics.

    ``accuracy`` is sample-weighted (sum correct / sum tested), ``mean`` and ``std`` are the
    unweighted mean and population std of per-client accuracies, ``min`` the lowest of them,
    ``worst10`` the mean of the lowest 10 % of clients (at least one client).
    """
    correct_arr = np.asarray(correct, dtype=float)
    totals_arr = np.asarray(totals, dtype=float)
    if len(totals_arr) == 0 or totals_arr.sum() == 0:
        raise ValueError("no evaluated samples")
    per_client = correct_arr / np.maximum(totals_arr, 1.0)
    k = max(1, math.ceil(0.1 * len(per_client)))
    return {
        "accuracy": float(correct_arr.sum() / totals_arr.sum()),
        "mean": float(per_client.mean()),
        "std": float(per_client.std()),
        "min": float(per_client.min()),
        "worst10": float(np.sort(per_client)[:k].mean()),
    }


def class_weighted_accuracy(
    correct_per_class: Sequence[float], tested_per_class: Sequence[float], class_weights: Sequence[float]
) -> float:
    """sum_c w_c a_c / sum_c w_c T_c: accuracy on a test set whose classes are reweighted.

    FedNH's per-client accuracy on the balanced global test set: PM(L) takes w = the client's
    training label distribution, PM(V) w = 1 for the classes the client holds.
    """
    weights = np.asarray(class_weights, dtype=float)
    tested = float(weights @ np.asarray(tested_per_class, dtype=float))
    if tested <= 0:
        raise ValueError("no test samples in the weighted classes")
    return float(weights @ np.asarray(correct_per_class, dtype=float)) / tested


def summarize(rounds: Iterable[dict[str, Any]], key: str) -> dict[str, Any] | None:
    """Final, best (and its round) and mean of the last 10 measured values of ``key``."""
    points = [(r["round"], r[key]) for r in rounds if r.get(key) is not None]
    if not points:
        return None
    values = [v for _, v in points]
    best = int(np.argmax(values))
    return {
        "final": values[-1],
        "final_round": points[-1][0],
        "best": values[best],
        "best_round": points[best][0],
        "last10_mean": float(np.mean(values[-10:])),
    }


RUN_FILES = ("results.json", "metrics.csv", "accuracy.png")


# The round-record fields that are clocks, and the checkpoint's size (it holds them): all two runs of
# the same code and config may differ in (the fixtures, resume and the compose demo compare the rest).
TIMING_FIELDS = frozenset({"seconds", "fit_seconds", "server_seconds", "checkpoint_seconds", "checkpoint_bytes"})


def rounds_without_timing(results: Mapping[str, Any]) -> list[dict[str, Any]]:
    """results.json's round records without :data:`TIMING_FIELDS`."""
    return [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in results["rounds"]]


class RunRecorder:
    """Collects per-round fields and writes the run's files to ``directory``; sends the rounds,
    the run config and the files to the run's trackers (``tracking``), when it has any."""

    def __init__(self, directory: Path, run_config: dict[str, Any], tracking: Tracking | None = None) -> None:
        self.directory = Path(directory)
        self.run_config = run_config
        self.rounds: dict[int, dict[str, Any]] = {}
        self.extra: dict[str, Any] = {}
        self.started = datetime.datetime.now().isoformat(timespec="seconds")
        self.tracking = tracking

    def update(self, server_round: int, **fields: Any) -> dict[str, Any]:
        record = self.rounds.setdefault(
            server_round, {key: None for key in ROUND_KEYS} | {"round": server_round}
        )
        # JSON has no NaN/inf: a quantity that is not finite was not measured
        record.update({k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in fields.items()})
        return record

    def restore(self, results: Mapping[str, Any], resumed_after: int) -> None:
        """Continue the run whose results (as far as its checkpoint) are ``results``."""
        self.rounds = {int(r["round"]): dict(r) for r in results["rounds"] if r["round"] <= resumed_after}
        self.started = results["started"]
        derived = {"schema_version", "run_config", "started", "summary", "rounds", "stopped", "total_seconds"}
        self.extra = {k: v for k, v in results.items() if k not in derived}
        self.extra["resumed_after"] = [*self.extra.get("resumed_after", []), resumed_after]

    def start_tracking(self) -> None:
        """Open the trackers, once the run's records are restored when it resumes: a resumed run
        continues its tracked runs (their identities are results.json's ``tracking``)."""
        if self.tracking is not None:
            resumed = self.extra.get("resumed_after") or [None]
            self.extra["tracking"] = self.tracking.start(
                self.directory.name, self.run_config, self.extra.get("tracking") or {}, resumed[-1])

    def track(self, server_round: int) -> None:
        """After ``server_round``: send the trackers the rounds before it, which are complete (a
        round's clients score its model in the next round's fit message at the latest)."""
        if self.tracking is not None:
            self.tracking.log(self.rounds, before=server_round)

    def finish_tracking(self, failed: bool = False, crashed: bool = False) -> None:
        """After the last :meth:`write`: send the trackers the last rounds and the run's files, and
        close them; ``failed``: the run stopped early; ``crashed``: in the middle of its last round,
        which is not sent (a resumed run sends it whole)."""
        if self.tracking is not None:
            self.tracking.finish(self.rounds, [self.directory / name for name in RUN_FILES], failed or crashed,
                                 last_round_complete=not crashed)

    def results(self) -> dict[str, Any]:
        rounds = [self.rounds[r] for r in sorted(self.rounds)]
        return {
            "schema_version": SCHEMA_VERSION,
            "run_config": self.run_config,
            "started": self.started,
            **self.extra,
            "summary": {key: summarize(rounds, key) for key in SUMMARY_KEYS},
            "rounds": rounds,
        }

    def write(self, plot: bool = False) -> dict[str, Any]:
        """Write results.json and metrics.csv (and the accuracy PNG when ``plot``)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        results = self.results()
        atomic_write(self.directory / "results.json", json.dumps(results, indent=2).encode())
        write_csv(results["rounds"], self.directory / "metrics.csv")
        if plot:
            plot_curves({self.run_config.get("method", "run"): results}, self.directory / "accuracy.png")
        return results


def progress_line(record: Mapping[str, Any]) -> str:
    """One round's log line: GM, PM, PM(L)/PM(V), training loss, traffic, time."""
    parts = []
    if record.get("global_accuracy") is not None:
        parts.append(f"GM {record['global_accuracy']:.4f}")
    if record.get("personalized_accuracy") is not None:
        parts.append(f"PM {record['personalized_accuracy']:.4f} (std {record['personalized_std']:.4f})")
    if record.get("pm_l") is not None:
        parts.append(f"PM(L) {record['pm_l']:.4f} PM(V) {record['pm_v']:.4f}")
    if record.get("train_loss") is not None:
        parts.append(f"train loss {record['train_loss']:.4f}")
    up, down = (record.get("bytes_up") or 0) / 1e6, (record.get("bytes_down") or 0) / 1e6
    parts.append(f"up {up:.2f} MB, down {down:.2f} MB")
    parts.append(f"{record.get('seconds') or 0:.1f} s")
    return " | ".join(parts)


def summary_text(results: Mapping[str, Any], directory: Path) -> str:
    """The run's summary: final, best and last-10 of each measured accuracy, and where the files are."""
    lines = [
        f"{key}: final {s['final']:.4f} | best {s['best']:.4f} (round {s['best_round']}) "
        f"| last-10 mean {s['last10_mean']:.4f}"
        for key, s in results["summary"].items()
        if s
    ]
    if results.get("stopped"):
        lines.append(f"stopped early: {results['stopped']}")
    lines.append(f"results written to {directory}")
    return "\n".join(lines)


def write_csv(rounds: list[dict[str, Any]], path: Path) -> None:
    columns = list(ROUND_KEYS) + sorted({k for r in rounds for k in r} - set(ROUND_KEYS))
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        for record in rounds:
            writer.writerow({k: ("" if record.get(k) is None else record.get(k)) for k in columns})


@contextlib.contextmanager
def _accuracy_plot(path: Path, ylabel: str) -> Iterator[Any]:
    """Axes for accuracy per round, labelled and saved to ``path`` (PNG) when the block ends."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(7, 4.5))
    try:
        yield ax
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.set_xlabel("round")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)


def plot_curves(runs: dict[str, dict[str, Any]], path: Path) -> None:
    """Accuracy per round: GM solid, PM dashed, one colour per run."""
    with _accuracy_plot(path, "accuracy") as ax:
        for i, (label, results) in enumerate(runs.items()):
            for key, style in CURVE_STYLES.items():
                points = [(r["round"], r[key]) for r in results["rounds"] if r.get(key) is not None]
                if points:
                    xs, ys = zip(*points)
                    ax.plot(xs, ys, style, color=f"C{i % 10}", label=f"{label} {REPEATED_METRICS[key]}")


def _fmt(value: Any, digits: int = 4) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def comparison_table(runs: dict[str, dict[str, Any]]) -> str:
    """Markdown table: GM and PM final / best / last-10 mean, PM std, PM(L) and PM(V) (final and
    last-10, when measured), traffic, time, and the server rule's share of it (its own training and
    the next round's broadcasts included)."""
    measured = [key for key in ("pm_l", "pm_v") if any(r["summary"].get(key) for r in runs.values())]
    columns = ["method"]
    for name in ("GM", "PM"):
        columns += [f"{name} final", f"{name} best (round)", f"{name} last-10"]
    columns.append("PM std (final)")
    for key in measured:
        name = "PM(L)" if key == "pm_l" else "PM(V)"
        columns += [f"{name} final", f"{name} last-10"]
    columns += ["MB up+down / round", "s / round", "server s / round"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for label, results in runs.items():
        rounds, summary = results["rounds"], results["summary"]
        cells = [label]
        for key in ("global_accuracy", "personalized_accuracy"):
            s = summary.get(key)
            if s is None:
                cells += ["–", "–", "–"]
            else:
                cells += [_fmt(s["final"]), f"{_fmt(s['best'])} ({s['best_round']})", _fmt(s["last10_mean"])]
        final_std = [r["personalized_std"] for r in rounds if r.get("personalized_std") is not None]
        cells.append(_fmt(final_std[-1] if final_std else None))
        for key in measured:
            s = summary.get(key)
            cells += [_fmt(s["final"]), _fmt(s["last10_mean"])] if s else ["–", "–"]
        traffic = [(r["bytes_up"] or 0) + (r["bytes_down"] or 0) for r in rounds]
        cells.append(_fmt(np.mean(traffic) / 1e6 if traffic else None, 3))
        for key in ("seconds", "server_seconds"):
            seconds = [r[key] for r in rounds if r.get(key) is not None]
            cells.append(_fmt(float(np.mean(seconds)) if seconds else None, 2 if key == "seconds" else 3))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------
# Repeats: the same run with several training seeds
# ---------------------------------------------------------------------------------------

STATISTICS = {"final": "final", "best": "best", "last10_mean": "last-10"}


def seed_values(runs: Mapping[int, Mapping[str, Any]], metric: str, statistic: str) -> dict[int, float]:
    """seed -> ``summary[metric][statistic]`` of each run that measured ``metric``."""
    return {seed: float(r["summary"][metric][statistic]) for seed, r in runs.items() if r["summary"].get(metric)}


def mean_and_std(values: Iterable[float]) -> tuple[float, float, int] | None:
    """(mean, sample standard deviation (ddof 1; 0 for one value), count), None for no values."""
    array = np.asarray(list(values), dtype=np.float64)
    if array.size == 0:
        return None
    return float(array.mean()), float(array.std(ddof=1)) if array.size > 1 else 0.0, int(array.size)


def paired_difference(
    values: Mapping[int, float], baseline: Mapping[int, float], confidence: float = 0.95
) -> tuple[float, float | None, float | None, int] | None:
    """Mean of ``values[s] - baseline[s]`` over the seeds both have, with its Student-t confidence
    interval: (mean, low, high, number of pairs); no interval for a single pair, None for none."""
    from scipy import stats

    seeds = sorted(set(values) & set(baseline))
    if not seeds:
        return None
    differences = np.array([values[s] - baseline[s] for s in seeds], dtype=np.float64)
    mean = float(differences.mean())
    if len(seeds) < 2:
        return mean, None, None, 1
    half = float(stats.t.ppf(0.5 + confidence / 2, len(seeds) - 1) * differences.std(ddof=1) / math.sqrt(len(seeds)))
    return mean, mean - half, mean + half, len(seeds)


def repeats_table(groups: Mapping[str, Mapping[int, Mapping[str, Any]]]) -> str:
    """Markdown: per run label, GM and PM final / best / last-10 as mean ± std over its seeds."""
    columns = ["method", "seeds"] + [f"{m} {s}" for m in REPEATED_METRICS.values() for s in STATISTICS.values()]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for label, runs in groups.items():
        cells = [label, " ".join(str(s) for s in sorted(runs))]
        for metric in REPEATED_METRICS:
            for statistic in STATISTICS:
                summary = mean_and_std(seed_values(runs, metric, statistic).values())
                cells.append("–" if summary is None else f"{summary[0]:.4f} ± {summary[1]:.4f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def differences_table(groups: Mapping[str, Mapping[int, Mapping[str, Any]]], baseline: str) -> str:
    """Markdown: each label's paired difference to ``baseline`` (same seeds), in accuracy points,
    with the 95 % confidence interval."""
    columns = ["method", "pairs"] + [f"Δ{m} {s}" for m in REPEATED_METRICS.values() for s in STATISTICS.values()]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for label, runs in groups.items():
        if label == baseline:
            continue
        cells, pairs = [label], 0
        for metric in REPEATED_METRICS:
            for statistic in STATISTICS:
                difference = paired_difference(
                    seed_values(runs, metric, statistic), seed_values(groups[baseline], metric, statistic)
                )
                if difference is None:
                    cells.append("–")
                    continue
                mean, low, high, pairs = difference
                interval = "" if low is None else f" [{100 * low:+.2f}, {100 * high:+.2f}]"
                cells.append(f"{100 * mean:+.2f}{interval}")
        lines.append("| " + " | ".join([cells[0], str(pairs), *cells[1:]]) + " |")
    return "\n".join(lines) + "\n"


def plot_bands(groups: Mapping[str, Mapping[int, Mapping[str, Any]]], path: Path) -> None:
    """Accuracy per round, mean over seeds with a ± std band: GM solid, PM dashed."""
    with _accuracy_plot(path, "accuracy (mean ± std over seeds)") as ax:
        for i, (label, runs) in enumerate(groups.items()):
            for key, style in CURVE_STYLES.items():
                per_round: dict[int, list[float]] = {}
                for results in runs.values():
                    for r in results["rounds"]:
                        if r.get(key) is not None:
                            per_round.setdefault(r["round"], []).append(r[key])
                if not per_round:
                    continue
                xs = sorted(per_round)
                mean = np.array([np.mean(per_round[x]) for x in xs])
                std = np.array([np.std(per_round[x], ddof=1) if len(per_round[x]) > 1 else 0.0 for x in xs])
                ax.plot(xs, mean, style, color=f"C{i % 10}", label=f"{label} {REPEATED_METRICS[key]}")
                ax.fill_between(xs, mean - std, mean + std, color=f"C{i % 10}", alpha=0.15, linewidth=0)
