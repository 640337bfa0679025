"""Helpers for the Hydra entry points: one decorator, so each entry point is a few lines.

    @hydra_entry()
    def main(cfg): return run_worker(cfg)

A :class:`~rlhf_core.errors.UserError` is printed as one clear line (exit 2, or 75 for a server
that stayed unreachable), not a traceback.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlhf_core.config import register_configs
from rlhf_core.errors import DISK_FULL, UserError, disk_full, disk_writes

CONFIG_PATH = "pkg://conf"
#: set by rlhf-run for each worker child it starts (the worker id in logs, metrics and leases)
WORKER_ID_ENV = "RLHF_WORKER_ID"
VERSION_BASE = "1.3"


def die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen``: the kernel sends ``sig`` to the child when the
    process that started it dies, even by SIGKILL (Linux's ``PR_SET_PDEATHSIG``); None elsewhere.
    Start children from the main thread: the signal is tied to the thread that forked them."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, not in the forked child
    parent = os.getpid()

    def preexec() -> None:
        prctl(1, sig)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the line above took effect
            os.kill(os.getpid(), sig)

    return preexec


def quiet_libraries(hub_offline: bool = True) -> None:
    """Offline, quiet libraries, through the environment (nothing heavy imported here).
    ``hub_offline``: the Hub's local cache only, unless the user set ``HF_HUB_OFFLINE`` (rlhf-run passes False)."""
    if hub_offline:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not os.path.exists("/dev/nvidia0"):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed would otherwise probe for CUDA


#: the collector's thresholds before :func:`collect_less_while_starting` raised them
_GC_THRESHOLDS: tuple[int, ...] | None = None


def collect_less_while_starting(young: int = 50_000) -> None:
    """Let the garbage collector run rarely while a service imports its libraries and builds its
    model: importing torch and transformers triggers full collections that scan every object made
    so far, and the start keeps nearly all of them. :func:`freeze_startup_heap` sets the thresholds back."""
    global _GC_THRESHOLDS
    import gc

    if _GC_THRESHOLDS is None:
        _GC_THRESHOLDS = gc.get_threshold()
    gc.set_threshold(young, *_GC_THRESHOLDS[1:])


def freeze_startup_heap() -> None:
    """Collect the garbage of a service's start, then move every object still alive (some 400,000
    after torch and transformers) to the permanent generation, which full collections skip. Call
    it once from the entry point, when the service is built and before it serves."""
    global _GC_THRESHOLDS
    import gc

    gc.collect()
    gc.freeze()
    if _GC_THRESHOLDS is not None:
        gc.set_threshold(*_GC_THRESHOLDS)
        _GC_THRESHOLDS = None


def raise_open_files_limit() -> None:
    """Raise this process's soft limit of open files to its hard limit (its children inherit it):
    every ZeroMQ peer and Redis connection holds descriptors."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)  # Linux refuses infinity here
    if soft == resource.RLIM_INFINITY or soft >= want:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError) as exc:  # a hard limit above the kernel's nr_open
        logging.getLogger(__name__).debug("open files limit stays at %d (%s)", soft, exc)


def say_once_when_full(handler: logging.FileHandler) -> logging.FileHandler:
    """A log file the disk cannot hold: say it once, in one line, instead of ``logging``'s traceback
    per record, and let the records go (the file is opened again once there is room)."""
    plain = handler.handleError
    said: list[bool] = []

    def handle_error(record: logging.LogRecord) -> None:
        exc = sys.exc_info()[1]
        if not isinstance(exc, OSError) or exc.errno not in DISK_FULL:
            return plain(record)
        stream, handler.stream = handler.stream, None  # its unwritten lines go: a close would fail on them
        try:
            if stream is not None:
                stream.close()
        except OSError:
            pass
        if not said:
            said.append(True)
            try:
                print(f"warning: {disk_full(handler.baseFilename, exc)} (said once: its lines are lost meanwhile)",
                      file=sys.stderr, flush=True)
            except OSError:
                pass

    handler.handleError = handle_error  # type: ignore[method-assign]  # this handler's own, on purpose
    return handler


def _output_folder(cfg: DictConfig) -> str:
    """The run's output folder (``run.output_dir``, which ``rlhf-run`` gives its children), else
    this process's Hydra output folder."""
    from hydra.core.hydra_config import HydraConfig

    return OmegaConf.select(cfg, "run.output_dir", default=None) or HydraConfig.get().runtime.output_dir


def hydra_entry(config_name: str = "config", hub_offline: bool = True
                ) -> Callable[[Callable[[DictConfig], int | None]], Callable[[], None]]:
    """Turn ``fn(cfg) -> exit code`` into a console-script ``main()`` backed by Hydra
    (``hub_offline``: see :func:`quiet_libraries`)."""
    import hydra

    def decorate(fn: Callable[[DictConfig], int | None]) -> Callable[[], None]:
        @hydra.main(version_base=VERSION_BASE, config_path=CONFIG_PATH, config_name=config_name)
        def _app(cfg: DictConfig) -> None:
            for handler in logging.getLogger().handlers:  # Hydra's log file in the output folder
                if isinstance(handler, logging.FileHandler):
                    say_once_when_full(handler)
            try:
                with disk_writes(_output_folder(cfg)):  # a full disk where no caller named the file
                    code = fn(cfg)
            except UserError as exc:
                logging.getLogger(fn.__module__).error("%s", exc)
                try:
                    print(f"error: {exc}", file=sys.stderr)
                except OSError:  # stderr is a log file on the disk that is full: the exit code still says it
                    pass
                sys.exit(exc.exit_code)
            if code:
                sys.exit(code)

        @functools.wraps(fn)
        def main() -> None:
            register_configs()
            quiet_libraries(hub_offline)
            raise_open_files_limit()
            _app()

        main.config_name = config_name  # type: ignore[attr-defined]  # read by the config tests
        return main

    return decorate


def write_json(path: Path, obj: Any, indent: int | None = None) -> None:
    """Write ``obj`` as JSON atomically (a reader polling the file never sees half of it); a full
    disk raises :class:`~rlhf_core.errors.DiskFull` naming ``path``."""
    import json

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(obj, indent=indent) + "\n")
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.errno in DISK_FULL:
            raise disk_full(path, exc) from exc
        raise
    os.replace(tmp, path)


def append_line(path: Path, line: str) -> None:
    """Append ``line`` and a newline to ``path``, opened for this line alone (a full disk raises
    :class:`~rlhf_core.errors.DiskFull` here, not at a later close)."""
    with disk_writes(path), open(path, "a") as f:
        f.write(line + "\n")
