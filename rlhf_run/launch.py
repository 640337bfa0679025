"""`rlhf-run`: a whole run, on one machine (``launcher=local``, the default,
:mod:`rlhf_run.local_backend`) or on a Ray cluster (``launcher=ray``, :mod:`rlhf_run.ray_backend`),
supervised alike (:mod:`rlhf_run.supervisor`). This module is the command: it picks the backend,
resumes runs (``rlhf-run resume=<output folder>``, :func:`resume_config`) and sums up sweeps.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from rlhf_core.cli import hydra_entry
from rlhf_core.config import Config, ConfigError, to_object, validate
from rlhf_run.local_backend import LocalBackend
from rlhf_run.supervisor import LAUNCH_CONFIG, PIDS_FILE, Supervisor

log = logging.getLogger(__name__)


def hydra_output_dir() -> Path:
    try:
        from hydra.core.hydra_config import HydraConfig

        return Path(HydraConfig.get().runtime.output_dir)
    except Exception:  # called outside a Hydra app (tests call run_launcher directly)
        return Path(tempfile.mkdtemp(prefix="rlhf-run-"))


def resume_config(resume: str, overrides: Sequence[str] = ()) -> tuple[Config, Path]:
    """The config and output folder of the run ``rlhf-run resume=<folder>`` continues: the folder's
    saved config, changed only by the ``key=value`` overrides given with ``resume=``
    (``learner.max_updates=2000`` to train on)."""
    out = resume_folder(resume)
    saved = out / LAUNCH_CONFIG
    changes = []
    for item in overrides:
        key = item.lstrip("+").split("=", 1)[0]
        if key == "resume" or key.startswith("hydra."):
            continue
        if item.startswith("~") or "." not in key or key == "buffer.run_id":
            raise ConfigError(f"resume continues the run's saved config, which {item!r} cannot change: only settings "
                              "such as learner.max_updates=2000 can, not a config group, a deletion or the run id")
        changes.append(item.lstrip("+"))
    base = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(saved))
    try:
        node = OmegaConf.merge(base, OmegaConf.from_dotlist(changes))
    except (ConfigKeyError, ValidationError) as exc:  # Hydra lets `+learner.max_update=...` through
        raise ConfigError(f"resume: {exc.full_key}: {str(exc).splitlines()[0]}; `rlhf-run --help` lists every setting") from None
    cfg = to_object(node)
    cfg.resume = None
    _refuse_if_running(out)
    return cfg, out


def resume_folder(resume: str) -> Path:
    """The output folder of the run ``resume=`` names; a ConfigError when it is not one."""
    out = Path(resume).expanduser().resolve()
    if not (out / LAUNCH_CONFIG).is_file():
        raise ConfigError(f"resume={resume}: {out / LAUNCH_CONFIG} does not exist, so this is not the output folder of "
                          "an rlhf-run run; give the folder the run printed at its start ('output in ...')")
    return out


def check_output_folder(folder: str, key: str) -> None:
    """A ConfigError when ``folder`` (the setting ``key``) cannot be made or written to."""
    path = Path(folder).expanduser().absolute()
    there = next(p for p in (path, *path.parents) if p.exists())  # the part of it that exists
    try:
        if not there.is_dir():
            raise NotADirectoryError(f"{there} is not a folder")
        os.rmdir(tempfile.mkdtemp(dir=there))
    except OSError as exc:
        why = exc.args[0] if isinstance(exc, NotADirectoryError) else f"{exc.strerror} ({there})"
        raise ConfigError(f"cannot write the output folder {path}: {why}; start it in a folder you can write to, or "
                          f"give {key}=/a/folder/you/can/write") from None


def _refuse_if_running(out: Path) -> None:
    """Refuse to resume a run whose launcher, children or Redis still run (two learners on one
    run, two redis-servers on one append-only file)."""
    import json

    import psutil

    path = out / PIDS_FILE
    if not path.is_file():
        return
    started_before = path.stat().st_mtime + 1.0  # a pid reused by a newer process is not the run's
    for name, pid in json.loads(path.read_text()).items():
        try:
            proc = psutil.Process(int(pid))
            alive = proc.create_time() <= started_before and proc.status() != psutil.STATUS_ZOMBIE
        except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
            continue
        if alive:
            raise ConfigError(f"the run in {out} is still running: its {name} (pid {pid}) is alive. Stop the run "
                              f"first (Ctrl-C in its terminal, or kill {pid}), then resume it")


def run_launcher(cfg: Config, output_dir: str | Path | None = None) -> int:
    validate(cfg)
    if cfg.buffer.url is not None:  # a Redis of the user's: every child would retry it, then fail, one by one
        from buffer.connection import connect

        connect(cfg.buffer.url, cfg.buffer).close()
    if cfg.rollout.num_workers == 0 and cfg.buffer.url is None:
        log.warning("rollout.num_workers=0 with a private Redis: only workers you start yourself can join "
                    "(they need buffer.url, printed below)")
    out = Path(output_dir) if output_dir else hydra_output_dir()
    if cfg.launcher == "ray":  # the roles as Ray actors; Ray is imported only then
        from rlhf_run.ray_backend import RayBackend

        return Supervisor(cfg, out, RayBackend(cfg, out)).run()
    return Supervisor(cfg, out, LocalBackend(cfg, out)).run()


@hydra_entry(hub_offline=False)  # it may fetch a Hub id once; its children never do
def main(cfg) -> int:
    obj = to_object(cfg)
    if not isinstance(obj, Config):
        raise ConfigError("rlhf-run needs the `config` primary config")
    if obj.resume:
        from hydra.core.hydra_config import HydraConfig

        obj, out = resume_config(obj.resume, HydraConfig.get().overrides.task)
        print(f"resuming run {obj.buffer.run_id} in {out}", flush=True)
        return run_launcher(obj, out)
    return run_launcher(obj)


if __name__ == "__main__":
    main()


from hydra.experimental.callback import Callback  # noqa: E402


class StartChecks(Callback):
    """Hydra callback (``hydra.callbacks`` in ``conf/config.yaml``): before Hydra makes the output
    folder, refuse in one line (exit 2) a ``resume=`` folder that is not a run's and an output
    folder that cannot be made."""

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        with _exit_on_config_error():
            if config.get("resume"):
                resume_folder(config.resume)
            check_output_folder(config.hydra.run.dir, "hydra.run.dir")

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        with _exit_on_config_error():
            check_output_folder(config.hydra.sweep.dir, "hydra.sweep.dir")


@contextmanager
def _exit_on_config_error() -> Iterator[None]:
    """Hydra turns a callback's exception into a warning: say the error in one line and exit instead."""
    try:
        yield
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)


SWEEP_KEYS = ("run_id", "max_staleness", "steps", "reward_start", "reward_end", "wall_s")
SWEEP_THROUGHPUT = ("trained_samples_per_s", "generated_tokens_per_s")


class SweepSummary(Callback):
    """Hydra callback: at the end of a multirun, a comparison table of the jobs' ``summary.json``,
    also written to ``sweep_summary.json`` in the sweep folder."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        import json

        from rlhf_run.summary import SUMMARY_FILE

        sweep_dir = Path(config.hydra.sweep.dir)
        rows = []
        for path in sorted(sweep_dir.glob(f"*/{SUMMARY_FILE}")):
            s = json.loads(path.read_text())
            rows.append({"job": path.parent.name, **{k: s.get(k) for k in SWEEP_KEYS},
                         **{k: s.get("throughput", {}).get(k) for k in SWEEP_THROUGHPUT}})
        (sweep_dir / "sweep_summary.json").write_text(json.dumps(rows, indent=2) + "\n")
        print(format_table(rows), flush=True)


def format_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no job wrote a summary"
    cols = list(rows[0])
    cell = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    widths = [max(len(c), *(len(cell(r[c])) for r in rows)) for c in cols]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(cell(r[c]).ljust(w) for c, w in zip(cols, widths)) for r in rows]
    return "sweep comparison:\n" + "\n".join(lines)
