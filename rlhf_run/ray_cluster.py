"""Reaching the Ray cluster of a ``launcher=ray`` run (:mod:`rlhf_run.ray_backend`), and the
driver's handle on the actors of the run's Redis and weight server.

:func:`connect` joins ``ray.address`` (probed first, and Ray's own connect settings bounded, so a
missing cluster, or a server there that is no Ray cluster, is an error within about
``ray.connect_timeout_s``) or starts a local Ray instance (loopback only).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from rlhf_core.config import Config, ConfigError
from rlhf_run import ray_plan as plan
from rlhf_run.supervisor import first_line

log = logging.getLogger(__name__)


def connect(cfg: Config) -> tuple[Any, str]:
    """Ray up: ``ray.address`` answered within ``ray.connect_timeout_s``, or a local instance. Returns
    the ``ray`` module and this node's id."""
    address = cfg.ray.address
    if address is None:
        # a local instance serves this machine only: Ray then uses loopback instead of the
        # machine's network address (read when ray is imported)
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    try:
        import ray
    except ImportError:
        raise ConfigError("launcher=ray needs Ray, which is not installed: pip install -e '.[ray]' "
                          "(./quickstart.sh installs it), or use launcher=local") from None
    sigterm = signal.getsignal(signal.SIGTERM)  # ray.init puts its own (sys.exit) there
    try:
        if address is None:
            want = sum(d.resources.get("CPU", 0.0) for d in plan.demands(cfg))
            cpus = cfg.ray.num_cpus or max(os.cpu_count() or 1, math.ceil(want))
            if not float(cpus).is_integer():  # Ray refuses it with a ValueError
                raise ConfigError(f"ray.num_cpus={cpus:g}: a local Ray instance has a whole number of CPUs; give one")
            # "local": a new instance even where RAY_ADDRESS or a `ray start` on this machine would be joined
            ray.init(address="local", num_cpus=int(cpus), include_dashboard=False, log_to_driver=False,
                     object_store_memory=cfg.ray.object_store_mb * 2**20)
            log.info("started a local Ray instance (%g logical CPUs)", cpus)
        else:
            join(ray, address, cfg.ray.connect_timeout_s)
            log.info("connected to the Ray cluster at %s", address)
    finally:
        signal.signal(signal.SIGTERM, sigterm)  # the run's: it stops the roles and writes the summary
    return ray, ray.get_runtime_context().get_node_id()


def join(ray: Any, address: str, timeout: float) -> None:
    """``ray.init`` at ``ray.address``, or a ConfigError within about ``timeout`` s (plus a second)
    that names the address and says what to do."""
    found = resolve(address)
    probe(found, timeout, address)
    try:
        with gcs_connect_within(timeout):
            ray.init(address=address, log_to_driver=False)
    except ConnectionError as exc:  # it accepts connections, yet no Ray GCS answered there
        name = f"{address} ({found})" if found != address else address
        raise ConfigError(f"ray.address={name}: something accepts connections there but no Ray cluster answered "
                          f"within ~{timeout:g} s (ray.connect_timeout_s; {first_line(exc)}). Pass the address "
                          "`ray start --head` prints (HOST:6379 by default), start a cluster there with `ray start "
                          "--head --port=6379`, or leave ray.address unset for a local Ray instance") from None


def resolve(address: str) -> str:
    """``ray.address`` as HOST:PORT: ``auto`` is RAY_ADDRESS, else the cluster that `ray start` last
    recorded on this node (never, as Ray's own ``auto`` may, any Ray instance that runs here)."""
    if address != "auto":
        return address
    from ray._private.utils import read_ray_address  # Ray's own lookup: <RAY_TMPDIR or /tmp>/ray/ray_current_cluster

    found = os.environ.get("RAY_ADDRESS") or read_ray_address()
    if not found:
        raise ConfigError("ray.address=auto: no Ray cluster was started on this node (RAY_ADDRESS is unset and no "
                          "`ray start` is recorded). Start one with `ray start --head --port=6379` (or join one with "
                          "`ray start --address=HEAD_IP:6379`), pass ray.address=HOST:PORT, or leave ray.address "
                          "unset for a local Ray instance")
    return found


@contextmanager
def gcs_connect_within(timeout: float) -> Iterator[None]:
    """Make ``ray.init`` give up on an address that accepts connections but is no Ray GCS after about
    ``timeout`` s, with Ray's own settings (one connect attempt, each of its waits a third of
    ``timeout``). An operator's own RAY_* setting of these wins."""
    step = str(max(1, round(timeout / 3)))
    settings = {"RAY_gcs_server_port_wait_time_s": "1", "RAY_gcs_rpc_server_connect_timeout_s": step,
                "RAY_py_gcs_connect_timeout_s": step}
    ours = [k for k in settings if k not in os.environ]
    os.environ.update({k: settings[k] for k in ours})
    from ray._raylet import Config  # type: ignore[attr-defined]  # in Ray's compiled module, not in its stubs

    Config.initialize("")  # Ray read its settings from the environment when imported: read them again
    try:
        yield
    finally:
        for k in ours:  # a local Ray instance started later in this process waits as long as Ray likes
            os.environ.pop(k, None)


def probe(address: str, timeout: float, setting: str | None = None) -> None:
    """A clear error, within ``timeout`` seconds, when nothing listens at ``address`` (``setting``:
    the ``ray.address`` it came from, when that was ``auto``)."""
    name = f"{setting} ({address})" if setting not in (None, address) else address
    host, _, port = address.rpartition(":")
    if address.startswith("ray://"):
        raise ConfigError(f"ray.address={name}: Ray Client addresses are not supported; run rlhf-run on a node of "
                          "the cluster (the head node) with ray.address=HEAD_IP:6379")
    if not host or not port.isdigit():
        raise ConfigError(f"ray.address={name} must be HOST:PORT of the cluster's head (what `ray start --head` "
                          "prints), or auto")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as exc:
        raise ConfigError(f"ray.address={name}: no Ray cluster answers there ({exc}; waited at most {timeout:g} s, "
                          "ray.connect_timeout_s). Start one on the head node with `ray start --head --port=6379` and "
                          "pass the address it prints, or leave ray.address unset for a local Ray instance") from None


@dataclass
class ActorHandle:
    """The weight server's or Redis's actor, shaped like what the one-machine launcher holds
    (``stop()``, and ``metrics()`` / ``url``, ``pid``, ``workdir``, ``restart_command()``)."""

    ray: Any
    actor: Any
    info: dict[str, Any]
    workdir: Path | None = None
    _metrics_failed: bool = False

    @property
    def pid(self) -> int:
        return int(self.info.get("redis_pid", self.info["pid"]))

    def restart_command(self) -> str:
        """Redis's, for the hint the launcher logs: its password stays where the run keeps it."""
        password = urlsplit(self.info["url"]).password
        command = self.info["restart_command"]
        return command.replace(password, "PASSWORD (buffer.url in run_config.yaml)") if password else command

    def metrics(self) -> dict[str, Any]:
        try:
            return self.ray.get(self.actor.metrics.remote(), timeout=5)
        except Exception as exc:  # the live line goes on without the weight server's numbers
            if not self._metrics_failed:
                log.warning("the weight server's metrics are unavailable: %s", first_line(exc))
            self._metrics_failed = True
            return {}

    def stop(self) -> None:
        try:
            self.ray.get(self.actor.stop.remote(), timeout=15)
        except Exception as exc:
            log.debug("stopping an actor: %s", exc)
        self.ray.kill(self.actor)
