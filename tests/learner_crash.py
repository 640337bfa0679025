"""``python -m learner_crash <hydra overrides>``: ``python -m learner`` that SIGKILLs itself at
one exact point of one update, for the crash/resume tests (tests/ must be on PYTHONPATH).

``RLHF_TEST_CRASH=<where>:<version>`` with ``where``:

* ``before_checkpoint``: version ``v`` is published (and the buffer told), its checkpoint is not
  written: the window between publish and checkpoint;
* ``after_checkpoint``: checkpoint ``v`` is complete on disk (``latest`` names it), its batches
  are not acked in the buffer yet: the window between checkpoint and commit.

The kill is a real SIGKILL of this process (no cleanup, no final checkpoint), placed by wrapping
``learner.checkpoint.save_checkpoint``, which the trainer looks up at every checkpoint.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import learner.checkpoint as checkpoint

CRASH_ENV = "RLHF_TEST_CRASH"
WHERE = ("before_checkpoint", "after_checkpoint")


def install(spec: str) -> None:
    where, _, version = spec.partition(":")
    if where not in WHERE or not version.isdigit():
        raise SystemExit(f"{CRASH_ENV}={spec!r}: expected <{'|'.join(WHERE)}>:<version>")
    target = f"v{int(version):08d}"  # the trainer names checkpoints after the version
    save = checkpoint.save_checkpoint

    def save_then_maybe_die(root_dir: Any, step_name: str, *args: Any, **kwargs: Any) -> Any:
        if step_name == target and where == "before_checkpoint":
            os.kill(os.getpid(), signal.SIGKILL)
        out = save(root_dir, step_name, *args, **kwargs)
        if step_name == target and where == "after_checkpoint":
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    checkpoint.save_checkpoint = save_then_maybe_die


if __name__ == "__main__":
    install(os.environ[CRASH_ENV])
    from learner.cli import main

    main()
