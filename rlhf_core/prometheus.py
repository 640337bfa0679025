"""A minimal Prometheus text-format endpoint (no extra dependency).

The learner and each worker call :meth:`Exporter.update` with their flat metrics dict
(``learner/version``, ``reward/mean``, ``tokens_per_s`` ...); names are mapped to conventional
Prometheus names (``rlhf_learner_version``, ``rlhf_reward_mean``, ``rlhf_worker_tokens_per_s``)
and served at ``http://host:port/metrics``. Off unless a port is configured
(``learner.prometheus_port`` / ``rollout.prometheus_port``; workers add their index).
"""

from __future__ import annotations

import logging
import math
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Mapping

log = logging.getLogger(__name__)

_BAD = re.compile(r"[^a-zA-Z0-9_]")


def metric_name(prefix: str, key: str) -> str:
    """``("rlhf_worker", "tokens_per_s")`` -> ``rlhf_worker_tokens_per_s``; ``loss/clip_frac`` -> ``..._loss_clip_frac``."""
    name = _BAD.sub("_", f"{prefix}_{key}").strip("_")
    return re.sub(r"_+", "_", name)


def _label_value(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Exporter:
    def __init__(self, prefix: str, labels: Mapping[str, str] | None = None) -> None:
        self.prefix = prefix
        self.labels = dict(labels or {})
        self._values: dict[str, float] = {}
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    def update(self, metrics: Mapping[str, Any]) -> None:
        with self._lock:
            for key, value in metrics.items():
                if isinstance(value, bool):
                    value = float(value)
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._values[metric_name(self.prefix, key)] = float(value)

    def render(self) -> str:
        labels = ",".join(f'{k}="{_label_value(v)}"' for k, v in sorted(self.labels.items()))
        suffix = f"{{{labels}}}" if labels else ""
        with self._lock:
            items = sorted(self._values.items())
        lines = []
        for name, value in items:
            lines.append(f"# TYPE {name} gauge")
            lines.append(f"{name}{suffix} {value!r}")
        return "\n".join(lines) + "\n"

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Start serving in a daemon thread; returns the bound port (0 picks a free one)."""
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404, "only /metrics is served")
                    return
                body = exporter.render().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:  # keep scrapes out of the logs
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        threading.Thread(target=self._server.serve_forever, name="prometheus", daemon=True).start()
        bound = self._server.server_address[1]
        log.info("Prometheus metrics at http://%s:%d/metrics", host, bound)
        return bound

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
