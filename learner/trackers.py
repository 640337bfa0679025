"""Experiment trackers fed by the learner's rank 0: TensorBoard, Weights & Biases, MLflow.

``run.loggers=[tensorboard,wandb,mlflow]`` (extra ``tracking``). Every update's numeric
metrics go to each tracker at step = learner version, with the update's staleness histogram;
every ``run.log_samples_every`` updates, a table of sample responses of the batch just trained
and the workers' throughput from the buffer snapshot. Each tracker's run id goes into the
learner's checkpoint (:meth:`Trackers.state`), so a learner restored from it (a crash restart,
``rlhf-run resume=...``) logs into the same run. Imports are lazy: a tracker costs nothing
unless named.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from buffer.connection import redact
from rlhf_core.config import SECRET_FIELDS, Config
from rlhf_core.errors import UserError
from rlhf_core.metric_names import STALENESS_HIST

log = logging.getLogger(__name__)

SAMPLE_COLUMNS = ["prompt", "response", "reward", "staleness", "worker"]
_MLFLOW_BAD = re.compile(r"[^A-Za-z0-9_\-. /]")


def scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The numeric entries (bools as 0/1; lists, strings and non-finite numbers left out)."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, (bool, int, float)) and float(value) == float(value) and abs(float(value)) != float("inf"):
            out[key] = float(value)
    return out


class TensorBoardTracker:
    def __init__(self, cfg: Config, output_dir: Path, run_id: str | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(output_dir / "tensorboard"))  # a resumed run appends to the folder

    def log(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def histogram(self, key: str, counts: list[int], step: int) -> None:
        import numpy as np

        values = np.repeat(np.arange(len(counts)), counts)
        if values.size:
            self.writer.add_histogram(key, values, step, bins=np.arange(len(counts) + 1) - 0.5)

    def table(self, key: str, rows: list[list[Any]], step: int) -> None:
        lines = ["| " + " | ".join(SAMPLE_COLUMNS) + " |", "|" + "---|" * len(SAMPLE_COLUMNS)]
        lines += ["| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in row) + " |" for row in rows]
        self.writer.add_text(key, "\n".join(lines), step)

    def run_id(self) -> str | None:
        return None

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, cfg: Config, output_dir: Path, run_id: str | None) -> None:
        import wandb

        self.wandb = wandb
        settings: dict[str, Any] = {"mode": cfg.run.wandb_mode} if cfg.run.wandb_mode else {}
        self.run = wandb.init(project=cfg.run.tracker_project, entity=cfg.run.wandb_entity, name=cfg.buffer.run_id,
                              id=run_id, resume="allow", dir=str(output_dir), config=_flat_config(cfg), **settings)

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def histogram(self, key: str, counts: list[int], step: int) -> None:
        edges = [lag - 0.5 for lag in range(len(counts) + 1)]
        self.run.log({key: self.wandb.Histogram(np_histogram=(np.asarray(counts), np.asarray(edges)))}, step=step)

    def table(self, key: str, rows: list[list[Any]], step: int) -> None:
        self.run.log({key: self.wandb.Table(columns=list(SAMPLE_COLUMNS), data=rows)}, step=step)

    def run_id(self) -> str | None:
        return self.run.id

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    def __init__(self, cfg: Config, output_dir: Path, run_id: str | None) -> None:
        import mlflow

        self.mlflow = mlflow
        uri = cfg.run.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or (output_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):
            # MLflow 3 asks file stores to opt in; a run's own folder needs no database server
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        mlflow.set_tracking_uri(uri)
        if run_id is None:
            mlflow.set_experiment(cfg.run.tracker_project)
        self.run = mlflow.start_run(run_id=run_id, run_name=None if run_id else cfg.buffer.run_id)
        if run_id is None:
            mlflow.log_params({k: str(v)[:500] for k, v in _flat_config(cfg).items()})

    def log(self, values: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics({_MLFLOW_BAD.sub("_", k): v for k, v in values.items()}, step=step)

    def histogram(self, key: str, counts: list[int], step: int) -> None:
        # one metric per lag: MLflow has no histogram type
        self.log({f"{key}/lag_{lag}": float(n) for lag, n in enumerate(counts)}, step)

    def table(self, key: str, rows: list[list[Any]], step: int) -> None:
        data = {col: [row[i] for row in rows] for i, col in enumerate(SAMPLE_COLUMNS)}
        self.mlflow.log_table(data=data, artifact_file=f"{key}/step_{step:08d}.json")

    def run_id(self) -> str | None:
        return self.run.info.run_id

    def close(self) -> None:
        self.mlflow.end_run()


#: one per run.loggers name (rlhf_core.choices.Logger; validate() checks each is installed before anything starts)
TRACKERS = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker}
#: what to check when a tracker does not start
START_HINTS = {
    "tensorboard": "check that <run.output_dir>/tensorboard is writable",
    "wandb": "log in (`wandb login`, or WANDB_API_KEY) or set run.wandb_mode=offline",
    "mlflow": "check run.mlflow_tracking_uri (else MLFLOW_TRACKING_URI); a resumed run needs the store that holds "
              "its run",
}


class TrackerStartError(UserError):
    """A tracker named in run.loggers did not start (no login, unreachable server): a restart would repeat it."""


def _flat_config(cfg: Config) -> dict[str, Any]:
    """The resolved config as dotted keys, for a tracker: secrets as "***", URLs without their
    password (under Ray the run makes a weight-server secret and a Redis password of its own)."""
    from omegaconf import OmegaConf

    def walk(node: Any, prefix: str) -> dict[str, Any]:
        if isinstance(node, dict):
            out: dict[str, Any] = {}
            for k, v in node.items():
                out.update(walk(v, f"{prefix}{k}."))
            return out
        key = prefix[:-1]
        if key in SECRET_FIELDS and node:
            return {key: "***"}
        return {key: redact(node) if isinstance(node, str) and "://" in node else node}

    return walk(OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True), "")


class Trackers:
    """The trackers named in ``run.loggers``; ``state`` (from a checkpoint) resumes their runs."""

    def __init__(self, cfg: Config, output_dir: Path, state: Mapping[str, str] | None = None) -> None:
        self.every = cfg.run.log_samples_every
        self.rows = cfg.run.log_samples
        self.trackers: dict[str, Any] = {}
        for name in cfg.run.loggers:
            resume = (state or {}).get(name)
            try:
                self.trackers[name] = TRACKERS[name](cfg, output_dir, resume)
            except Exception as exc:
                self.close()
                what = f"resuming run {resume}" if resume else "starting"
                raise TrackerStartError(f"run.loggers: {name} failed {what}: {type(exc).__name__}: {exc}. "
                                        f"{START_HINTS[name]}, or drop {name} from run.loggers") from exc
            log.info("%s tracker %s%s", name, "resumed run " if resume else "", self.trackers[name].run_id() or output_dir)

    def log_update(self, metrics: Mapping[str, Any], step: int) -> None:
        values = scalars(metrics)
        hist = metrics.get(STALENESS_HIST) or []
        for tracker in self.trackers.values():
            tracker.log(values, step)
            tracker.histogram("staleness/trained", list(hist), step)

    def due(self, step: int) -> bool:
        """Time for the sample table and the workers' throughput."""
        return self.every > 0 and step % self.every == 0

    def log_details(self, rows: list[list[Any]], workers: Mapping[str, Mapping[str, Any]], step: int) -> None:
        """``rows``: sample responses (SAMPLE_COLUMNS); ``workers``: the buffer snapshot's per-worker stats."""
        per_worker = {f"workers/{name}/{key}": value for name, stats in workers.items()
                      for key, value in scalars(stats).items() if key.endswith("_per_s")}
        for tracker in self.trackers.values():
            if rows:
                tracker.table("samples", rows[: self.rows], step)
            if per_worker:
                tracker.log(per_worker, step)

    def state(self) -> dict[str, str]:
        """The trackers' run ids, for the checkpoint."""
        return {name: rid for name, t in self.trackers.items() if (rid := t.run_id())}

    def close(self) -> None:
        for name, tracker in self.trackers.items():
            try:
                tracker.close()
            except Exception:  # noqa: BLE001  # closing one must not keep the others (or the checkpoint) from closing
                log.warning("closing the %s tracker failed", name, exc_info=True)
