"""The math verifier in a process of its own, where a time limit can stop it.

``math-verify`` parses LaTeX and compares with SymPy; a pathological answer can keep it busy for
minutes, and its own time limit (``signal.alarm``) works only on a main thread, which the
worker's scoring threads are not. So the comparisons run in a child process (``python -m
rollout_workers.math_verifier <verifier>``), one answer at a time over a pipe (JSON lines: no
pickle), and each answer has ``timeout_s``:

1. in the child, an interval timer (``SIGALRM`` on its main thread) interrupts a comparison still
   running after ``timeout_s``: the answer is a ``timeout`` and the child goes on;
2. a comparison that a signal cannot interrupt (C code holding the interpreter, such as a
   regular expression backtracking) is stopped by the worker: no reply within ``timeout_s`` +
   :data:`GRACE_S` and it kills the child (SIGKILL) and starts another for the next answer.

The child dies with the thread that started it (``PR_SET_PDEATHSIG``) and ends when its stdin
closes, so a worker that dies leaves none behind. ``verifier`` is the dotted path of a function
``(gold: str, answer: str) -> bool | None`` (None: either cannot be parsed); the default is
:func:`math_verify_equal`. :class:`VerifierPool` keeps one child per scoring thread in use.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import queue
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_VERIFIER = "rollout_workers.math_verifier.math_verify_equal"
#: how much longer than ``timeout_s`` the worker waits for a reply before it kills the child
GRACE_S = 2.0
#: how long a new child may take to import the verifier (SymPy and math-verify: about a second)
START_S = 120.0
_READY = "ready"


def math_verify_equal(gold: str, answer: str) -> bool | None:
    """math-verify's verdict on ``answer`` against ``gold`` (both LaTeX or plain text, wrapped in
    ``$...$`` unless they have math delimiters or a ``\\boxed``); None when either does not parse,
    or the gold is mathematics and the answer only text (math-verify would keep the raw string
    and compare it unequal). Its own time limits are off: the caller's timer is in charge."""
    from math_verify import parse, verify
    from sympy import Basic, MatrixBase

    parsed_gold, parsed = parse(_math(gold), parsing_timeout=None), parse(_math(answer), parsing_timeout=None)
    is_math = lambda found: any(isinstance(x, (Basic, MatrixBase)) for x in found)  # noqa: E731
    if not parsed_gold or not parsed or (is_math(parsed_gold) and not is_math(parsed)):
        return None
    return bool(verify(parsed_gold, parsed, timeout_seconds=None))


def _math(text: str) -> str:
    return text if ("$" in text or "\\boxed" in text or "\\(" in text or "\\[" in text) else f"${text}$"


def _import(path: str) -> Callable[[str, str], bool | None]:
    module, _, name = path.rpartition(".")
    fn = getattr(importlib.import_module(module), name)
    if not callable(fn):
        raise TypeError(f"{path} is not a function")
    return fn


class _Timeout(Exception):
    pass


def _on_alarm(signum: int, frame: Any) -> None:
    raise _Timeout


def serve(verifier: str) -> None:
    """The child's loop: one JSON request per line on stdin, one JSON reply per line on stdout."""
    try:  # die with the worker's thread that started us, even if it is killed
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns that its own time limit is off
    out = sys.stdout
    try:
        fn = _import(verifier)
        if importlib.util.find_spec("math_verify") is not None:
            math_verify_equal("1", "1")  # warm its imports (SymPy, the LaTeX parser) before saying ready
    except Exception as exc:  # noqa: BLE001 - said to the worker, which stops with it
        out.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
        out.flush()
        return
    signal.signal(signal.SIGALRM, _on_alarm)
    out.write(_READY + "\n")
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        reply: dict[str, Any]
        signal.setitimer(signal.ITIMER_REAL, float(req["timeout_s"]))
        try:
            verdict = fn(req["gold"], req["answer"])
            reply = {"result": "unparsed" if verdict is None else "correct" if verdict else "wrong"}
        except _Timeout:
            reply = {"result": "timeout"}
        except Exception as exc:  # noqa: BLE001 - a verifier bug fails one answer, not the child
            reply = {"result": "verifier_error", "detail": f"{type(exc).__name__}: {exc}"[:300]}
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        out.write(json.dumps(reply) + "\n")
        out.flush()


class VerifierProcess:
    """One child and the pipe to it; :meth:`ask` one answer at a time (one thread at a time)."""

    def __init__(self, verifier: str, timeout_s: float) -> None:
        self.verifier, self.timeout_s = verifier, float(timeout_s)
        self.proc: subprocess.Popen | None = None
        self._buf = b""
        self.restarts = 0

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # the worker's imports
        self.proc = subprocess.Popen([sys.executable, "-m", "rollout_workers.math_verifier", self.verifier],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self._buf = b""
        first = self._line(time.monotonic() + START_S)
        if first != _READY:
            self.close()
            said = json.loads(first).get("error") if first and first.startswith("{") else first or "no answer"
            raise RuntimeError(f"the math verifier process did not start ({said})")

    def ask(self, gold: str, answer: str) -> tuple[str, str]:
        """``(result, detail)``: result is correct, wrong, unparsed, timeout or verifier_error."""
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps({"gold": gold, "answer": answer, "timeout_s": self.timeout_s}) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:
            self.close()
            return "verifier_error", "the verifier process died"
        line = self._line(time.monotonic() + self.timeout_s + GRACE_S)
        if line is None:  # hung where its own timer could not stop it, or died: a fresh child for the next answer
            died = self.proc.poll() is not None
            self.close()
            self.restarts += 1
            return ("verifier_error", "the verifier process died") if died else ("timeout", "killed")
        reply = json.loads(line)
        return reply["result"], reply.get("detail", "")

    def _line(self, deadline: float) -> str | None:
        """The child's next line, or None when none comes by ``deadline`` (or it closed its stdout)."""
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            data = os.read(fd, 65536)
            if not data:
                return None
            self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            for stream in (self.proc.stdin, self.proc.stdout):
                if stream is not None:
                    stream.close()
            self.proc = None


class VerifierPool:
    """Children to compare answers in: a call takes an idle one (or starts one), gives it back after."""

    def __init__(self, verifier: str, timeout_s: float) -> None:
        self.verifier, self.timeout_s = verifier, timeout_s
        self._idle: queue.SimpleQueue[VerifierProcess] = queue.SimpleQueue()
        self._all: list[VerifierProcess] = []

    def warm(self) -> None:
        """Start one child now (the worker's start-up, not its first batch, pays for the imports)."""
        child = self._take()
        self._idle.put(child)

    def _take(self) -> VerifierProcess:
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            child = VerifierProcess(self.verifier, self.timeout_s)
            child.start()
            self._all.append(child)
            return child

    def verify_all(self, pairs: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
        """``(result, detail)`` for each ``(gold, answer)``, in order."""
        if not pairs:
            return []
        child = self._take()
        try:
            return [child.ask(gold, answer) for gold, answer in pairs]
        finally:
            self._idle.put(child)

    def close(self) -> None:
        for child in self._all:
            child.close()


if __name__ == "__main__":
    serve(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_VERIFIER)
