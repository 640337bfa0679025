"""reward=code_tests and the PythonTool environment running real programs in the sandbox: the
share of tests passed, executions bounded by sandbox.pool_size, and a run that refuses at start,
in one line, where the sandbox cannot work (sandbox=none: a warning instead)."""

from __future__ import annotations

import logging
import threading

import pytest

from rlhf_core.config import ConfigError
from rlhf_core.config.sandbox import SandboxConfig
from rlhf_core.records import Prompt
from rlhf_core.tool_calls import ToolCall
from rollout_workers.code_reward import CodeTests
from rollout_workers.environment import AssistantTurn
from rollout_workers.envs.python_tool import PythonTool
from rollout_workers.sandbox import Sandbox, SandboxStatus
from rollout_workers.user_code import check_reward_targets, import_env_target
from sandbox_helpers import LIMITS, working_sandbox
from worker_helpers import compose

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

ADD = "a, b = map(int, input().split())\nprint(a + b)"


@pytest.fixture(scope="module")
def reward():
    working_sandbox()
    return CodeTests(sandbox=LIMITS)


def fenced(program: str) -> str:
    return f"Here it is:\n```python\n{program}\n```\n"


def test_the_reward_is_the_share_of_stdin_stdout_tests_passed(reward):
    tests = [{"input": "1 2\n", "output": "3"}, {"input": "5 5\n", "output": "10\n"}, {"input": "2 2\n", "output": "5"}]
    wrong = "print(0)"
    out = reward([fenced(ADD), fenced(wrong), "no code at all, just words", fenced("import sys\nsys.exit(1)")],
                 tests=[tests] * 4)
    # ADD passes 2 of 3 (2 + 2 is not 5); print(0) none; the words run as a program and fail (a SyntaxError)
    assert out == [pytest.approx(2 / 3), 0.0, 0.0, 0.0]


def test_assert_tests_fail_a_program_that_exits_before_them(reward):
    program = "def add(a, b):\n    return a + b"
    tests = ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(2, 2) == 5"]
    cheat = "import os\nos._exit(0)"  # exits 0 before any assert runs
    out = reward([fenced(program), fenced(cheat)], tests=[tests, tests])
    assert out == [pytest.approx(2 / 3), 0.0]


def test_rows_without_tests_fail_their_completion_and_fenced_mode_scores_prose_zero():
    strict = CodeTests(sandbox=LIMITS, extract="fenced")
    out = strict(["just prose", fenced(ADD), fenced(ADD)], tests=[[{"input": "1 1", "output": "2"}], None, "{bad json"])
    assert out[0] == 0.0
    assert isinstance(out[1], ValueError) and "no tests in column 'tests'" in str(out[1])
    assert out[2] == 0.0  # text that is not JSON is one assert statement: '{bad json' fails to compile
    assert strict.counters() == {"no_code": 1, "failed": 1}


def test_executions_run_at_most_pool_size_at_a_time():
    sandbox = Sandbox(SandboxConfig.of({**LIMITS, "pool_size": 2}))
    running, most, lock = [0], [0], threading.Lock()
    inner = sandbox.run

    def counted(program: str, stdin: str = ""):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            return inner(program, stdin)
        finally:
            with lock:
                running[0] -= 1

    sandbox.run = counted  # type: ignore[method-assign]
    results = sandbox.run_all([(f"import time\ntime.sleep(0.2)\nprint({i})", "") for i in range(6)])
    assert [r.stdout.strip() for r in results] == [str(i) for i in range(6)]  # in order
    assert most[0] <= 2


def test_the_python_tool_environment_runs_code_and_rewards_the_last_program():
    working_sandbox()
    env = PythonTool(sandbox=LIMITS, max_observation_chars=50)
    env.reset(Prompt("p", "add two numbers from stdin", None, {"tests": '[{"input": "2 3", "output": "5"}]'}))
    step = env.step(AssistantTurn(fenced("print('x' * 100)"), "", [], "stop", 0))
    assert not step.done and step.observation.startswith("ok: exited 0\nstdout:\n" + "x" * 50)
    assert "(51 more characters)" in step.observation  # cut at max_observation_chars
    step = env.step(AssistantTurn("", "", [], "stop", 1, tool_calls=[ToolCall("run_python", {"code": ADD}), ToolCall("rm", {})]))
    assert [m["role"] for m in step.observation] == ["tool", "tool"]
    assert step.observation[0]["content"].startswith("failed: exited 1")  # no stdin here: input() fails
    assert "there is no tool 'rm'" in step.observation[1]["content"]
    final = env.step(AssistantTurn("My program above is the answer.", "", [], "stop", 2))
    assert final.done and final.reward == 1.0  # the last program it ran (ADD) passes the row's test


def test_a_run_refuses_at_start_where_bwrap_is_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    cfg = compose(["reward=code_tests", "sandbox.wall_s=7"])  # a config of its own: nothing cached
    with pytest.raises(ConfigError) as err:
        check_reward_targets(cfg.reward)
    assert "apt-get install -y bubblewrap" in str(err.value) and "\n" not in str(err.value)


def test_a_run_refuses_at_start_where_user_namespaces_are_off(tmp_path, monkeypatch):
    fake = tmp_path / "bwrap"  # what bwrap says where the kernel refuses unprivileged user namespaces
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to creating new namespace, likely because the kernel "
                    "does not allow non-privileged user namespaces.' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    cfg = compose(["reward=code_tests", "sandbox.wall_s=8"])
    with pytest.raises(ConfigError) as err:
        check_reward_targets(cfg.reward)
    assert "enable unprivileged user namespaces" in str(err.value) and "\n" not in str(err.value)
    rollout = compose(["rollout.env._target_=rollout_workers.envs.python_tool.PythonTool", "+rollout.env.sandbox=${sandbox}",
                       "sandbox.wall_s=8"]).rollout
    with pytest.raises(ConfigError, match="enable unprivileged user namespaces"):
        import_env_target(rollout)  # the environment's check, as rlhf-run and each worker make it


def test_sandbox_none_warns_at_start_and_runs_unisolated(caplog):
    cfg = compose(["reward=code_tests", "sandbox=none", "sandbox.wall_s=9"])
    with caplog.at_level(logging.WARNING, logger="rollout_workers.sandbox"):
        check_reward_targets(cfg.reward)
    assert "WITHOUT isolation" in caplog.text
    unsandboxed = Sandbox(SandboxConfig.of({"backend": "none", "wall_s": 9.0}))
    seen = unsandboxed.run("import os\nprint(os.path.exists('/proc/1/environ'))")
    assert seen.status == SandboxStatus.ok and seen.stdout.strip() == "True"  # it sees the host's processes
