"""A fair benchmark of losses: every loss × seed trained under one protocol, as Ray jobs.

The protocol is the thesis's fair-comparison rule (section 3.5): the same backbone, embedding
size, sampler, augmentation, optimiser family, epochs and fixed validation split for every
loss; each run's checkpoint is chosen on the validation classes, and only the test classes are
reported. Each loss keeps its own hyper-parameters (the papers' defaults, or
`per_loss_options`).

    python -m training benchmark --losses all --seeds 3 --out runs/loss-benchmark

Every run is a Ray task (one per loss × seed), so a cluster (`RAY_ADDRESS`) runs them side by
side. Runs publish atomically under `OUT/runs/<loss>-seed<N>/`; re-running the same command
skips finished runs and resumes interrupted ones. The table goes to `OUT/table.md`, every
figure to `OUT/results.json`, and a bar chart to `OUT/recall.png`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.artifacts.layout import write_json_atomic
from core.cli import init_ray
from core.config import ConfigError, option, resolve_config, to_jsonable
from training.losses import available_losses, get_loss_class
from training.runs.config import TrainConfig
from training.runs.train import RESULTS_FILE
from training.runs.trainable import build_loss_for

log = logging.getLogger(__name__)

# What a benchmark sets per run, so the protocol may not.
PER_RUN_FIELDS = {"out", "loss", "loss_options", "seed", "resume", "progress", "metrics_export_port", "plots"}
# Protocol defaults that differ from a single training run's: proxies need a faster rate than a
# from-scratch backbone (the authors use 100× the backbone's; 10× is stable here).
PROTOCOL_DEFAULTS: dict[str, Any] = {"proxy_lr": 1e-2}


@dataclass
class BenchmarkConfig:
    """`training benchmark`: its own options, and the training options every run shares (the
    protocol: any of `training train`'s but those it sets per run, PER_RUN_FIELDS)."""

    out: str = option("runs/loss-benchmark", help="benchmark directory; re-run to resume")
    losses: list[str] = option(default_factory=lambda: ["all"], help="registry names, or 'all' (the papers' losses)")
    seeds: int = option(3, help="runs per loss, seeds 0..N-1")
    per_loss_options: dict[str, Any] = option(
        default_factory=dict, help='JSON {"loss": {"option": value}} for options of one loss (defaults: the papers\')'
    )
    parallel: int | None = option(None, help="training jobs at once (default: as Ray's CPUs allow, 2 per job)")
    protocol: dict[str, Any] = option(
        default_factory=dict, cli=False, help="TrainConfig options shared by all runs (flat in files and flags)"
    )

    def __post_init__(self) -> None:
        if self.seeds <= 0:
            raise ValueError(f"seeds must be positive, got {self.seeds}")
        if self.parallel is not None and self.parallel <= 0:
            raise ValueError(f"parallel must be positive, got {self.parallel}")
        self.losses = resolve_losses(self.losses)
        unknown = sorted(set(self.per_loss_options) - set(self.losses))
        if unknown:
            raise ValueError(f"per_loss_options names losses not in the benchmark: {', '.join(unknown)}")
        clash = sorted(set(self.protocol) & PER_RUN_FIELDS)
        if clash:
            raise ValueError(f"the benchmark sets {', '.join(clash)} per run; leave them out of the protocol")
        for loss in self.losses:  # every run's configuration and loss is checked before anything trains
            cfg = self.train_config(loss, 0)
            build_loss_for(
                cfg, num_classes=2, embedding_dim=cfg.embedding_dim or 8
            )  # a width; the check is the options

    def check_inputs(self) -> None:
        """The files the protocol names (catalog, data root, weights), once: every run shares them."""
        self.train_config(self.losses[0], 0).check_inputs()

    def train_config(self, loss: str, seed: int) -> TrainConfig:
        options = {**PROTOCOL_DEFAULTS, **self.protocol}
        return TrainConfig(
            **options,
            out=str(Path(self.out) / "runs" / f"{loss}-seed{seed}"),
            loss=loss,
            loss_options=dict(self.per_loss_options.get(loss, {})),
            seed=seed,
            progress=False,
            plots=False,
        )

    @classmethod
    def from_values(cls, values: dict[str, Any], spelled: dict[str, str] | None = None) -> BenchmarkConfig:
        """Benchmark options and protocol options from one flat mapping (file + flags); `spelled`:
        the options given as flags, which the checks' errors name so (`core.config.flag_spellings`)."""
        own = {f.name for f in dataclasses.fields(cls)} - {"protocol"}
        protocol = {k: v for k, v in values.items() if k not in own}
        checked = to_jsonable(resolve_config(TrainConfig, protocol, spelled=spelled))  # names and types, as for train
        return resolve_config(
            cls,
            {k: v for k, v in values.items() if k in own},
            {"protocol": {k: checked[k] for k in protocol}},
            spelled=spelled,
        )


def resolve_losses(names: list[str]) -> list[str]:
    """'all' means every loss of the papers in the registry (the pml_* library twins excluded)."""
    if names == ["all"]:
        return [n for n in available_losses() if not n.startswith("pml_")]
    for name in names:
        get_loss_class(name)  # unknown names fail here, listing the known ones
    if len(set(names)) != len(names):
        raise ConfigError(f"a loss is listed twice: {names}")
    return list(names)


def _train_job(options: dict[str, Any]) -> dict[str, Any]:
    from training.runs.train import run_training

    out = run_training(TrainConfig(**options))
    return json.loads((out / RESULTS_FILE).read_text())


def run_benchmark(cfg: BenchmarkConfig) -> Path:
    """Train what is missing, then write the table, JSON and chart; returns the output folder."""
    import ray

    cfg.check_inputs()  # before any run starts, not inside each one
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "config.json", to_jsonable(cfg))
    jobs = [(loss, seed) for loss in cfg.losses for seed in range(cfg.seeds)]
    done: dict[tuple[str, int], dict] = {}
    failed: dict[tuple[str, int], str] = {}
    pending = []
    for loss, seed in jobs:
        run_cfg = cfg.train_config(loss, seed)
        results = Path(run_cfg.out) / RESULTS_FILE
        if results.is_file():
            done[(loss, seed)] = json.loads(results.read_text())
            continue
        work = Path(run_cfg.out).resolve().with_name(f".{Path(run_cfg.out).name}.work")
        resume = (work / "config.json").is_file()  # interrupted earlier: continue from its checkpoint
        pending.append(((loss, seed), to_jsonable(dataclasses.replace(run_cfg, resume=resume))))
    log.info("%d runs finished earlier, %d to train", len(done), len(pending))
    if pending:
        init_ray()
        workers = cfg.protocol.get("num_workers", 1)
        parallel = cfg.parallel or max(1, int(ray.cluster_resources().get("CPU", 1)) // (2 * workers))
        # The task itself only waits on its TorchTrainer, whose workers hold the CPUs.
        remote = ray.remote(num_cpus=0, max_retries=0)(_train_job)
        in_flight: dict = {}
        while pending or in_flight:
            while pending and len(in_flight) < parallel:
                key, options = pending.pop(0)
                in_flight[remote.remote(options)] = key
            ready, _ = ray.wait(list(in_flight), num_returns=1)
            key = in_flight.pop(ready[0])
            try:
                done[key] = ray.get(ready[0])
            except Exception as exc:  # noqa: BLE001 - one diverging loss must not sink the table
                failed[key] = str(exc).strip().splitlines()[-1][:300]
                log.error("%s seed %d failed: %s", *key, failed[key])
                continue
            log.info("finished %s seed %d: test R@1 %.4f", *key, done[key]["trained"]["recall_at_k"]["1"])
    table = summarize(cfg, done)
    table["failed"] = {f"{k[0]}-seed{k[1]}": v for k, v in failed.items()}
    write_json_atomic(out / "results.json", {"config": to_jsonable(cfg), **table})
    (out / "table.md").write_text(markdown_table(table))
    plot_summary(table, out / "recall.png")
    return out


def _mean_std(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.mean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0}


def summarize(cfg: BenchmarkConfig, done: dict[tuple[str, int], dict]) -> dict[str, Any]:
    """Mean ± std over seeds of test Recall@K and MAP@R per loss, the untrained network first."""
    ks = [str(k) for k in cfg.train_config(cfg.losses[0], 0).ks]
    rows: dict[str, dict] = {}

    def row(results: list[dict], which: str) -> dict:
        figures = {f"R@{k}": _mean_std([r[which]["recall_at_k"][k] for r in results]) for k in ks}
        if all("map_at_r" in r[which] for r in results):
            figures["MAP@R"] = _mean_std([r[which]["map_at_r"] for r in results])
        return figures

    everything = list(done.values())
    rows["untrained"] = row(everything, "untrained")
    for loss in cfg.losses:
        results = [done[(loss, s)] for s in range(cfg.seeds) if (loss, s) in done]
        if not results:  # every seed failed: listed under "failed", no row
            continue
        rows[loss] = {
            **row(results, "trained"),
            "train_seconds": _mean_std([r["train_seconds"] for r in results]),
            "best_epochs": [r["best_epoch"] for r in results],
            "seeds_finished": len(results),
        }
    return {"seeds": cfg.seeds, "ks": ks, "rows": rows, "runs": {f"{k[0]}-seed{k[1]}": v for k, v in done.items()}}


def markdown_table(table: dict[str, Any]) -> str:
    """The summary as Markdown, losses by test Recall@1 (best first)."""
    columns = [f"R@{k}" for k in table["ks"]] + ["MAP@R"]
    header = f"| loss ({table['seeds']} seeds, mean ± std) | " + " | ".join(columns) + " | train s/run |\n"
    header += "|---" * (len(columns) + 2) + "|\n"
    order = sorted((n for n in table["rows"] if n != "untrained"), key=lambda n: -table["rows"][n]["R@1"]["mean"])
    lines = []
    for name in ["untrained", *order]:
        figures = table["rows"][name]
        cells = [
            f"{100 * figures[c]['mean']:.2f} ± {100 * figures[c]['std']:.2f}" if c in figures else "–" for c in columns
        ]
        seconds = f"{figures['train_seconds']['mean']:.0f}" if "train_seconds" in figures else "–"
        partial = "" if figures.get("seeds_finished", table["seeds"]) == table["seeds"] else " (some seeds failed)"
        lines.append(f"| {name}{partial} | " + " | ".join(cells) + f" | {seconds} |\n")
    failures = "".join(f"\nFailed: {run}: {why}\n" for run, why in table.get("failed", {}).items())
    return header + "".join(lines) + failures


def plot_summary(table: dict[str, Any], path: Path) -> Path:
    from training.runs.plots import plot_bars

    names = [n for n in table["rows"] if n != "untrained"]
    names.sort(key=lambda n: -table["rows"][n]["R@1"]["mean"])
    series = {
        metric: [(table["rows"][n][metric]["mean"], table["rows"][n][metric]["std"]) for n in names]
        for metric in ("R@1", "MAP@R")
        if all(metric in table["rows"][n] for n in names)
    }
    untrained = table["rows"]["untrained"]["R@1"]["mean"]
    return plot_bars(
        names, series, path, f"Test classes, {table['seeds']} seeds", reference=("untrained R@1", untrained)
    )
