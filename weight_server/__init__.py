"""The weight server: versioned parameters over ZeroMQ, verified by content hash.

    server = WeightServer(cfg).start()                          # or serve_forever() (the CLI)
    pub = WeightPublisher(server.address, cfg)                  # learner
    pub.publish(version, model, dtype=torch.bfloat16)
    sub = WeightSubscriber(server.address, server.pub_address, cfg, worker_id="w0")   # worker
    if (sub.poll_announcement() or -1) > (sub.version or -1):
        sub.pull(into=model)

Knows ZeroMQ and nothing of Redis. The publisher and subscriber are imported lazily so the
server process does not pay for importing torch.
"""

from __future__ import annotations

from typing import Any

from weight_server.errors import (
    StaleVersionError,
    TensorMismatchError,
    WeightAuthError,
    WeightIntegrityError,
    WeightServerError,
    WeightServerUnavailable,
)

__all__ = [
    "WeightServer", "WeightPublisher", "WeightSubscriber", "PublishStats", "generate_keys",
    "WeightAuthError", "StaleVersionError", "WeightServerError", "WeightServerUnavailable",
    "WeightIntegrityError", "TensorMismatchError",
]

_LAZY = {
    "WeightServer": "weight_server.server",
    "WeightPublisher": "weight_server.publisher",
    "PublishStats": "weight_server.publisher",
    "WeightSubscriber": "weight_server.subscriber",
    "generate_keys": "weight_server.auth",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'weight_server' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
