"""Whole runs with the verifiable rewards: reward=math on the shipped arithmetic problems,
reward=code_tests in the sandbox, and a code run refused in one line before anything starts
where the sandbox cannot work."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from rlhf_core.data import ARITHMETIC
from rlhf_run.summary import read_metrics
from test_run import base_overrides, child_env, run_cmd, script

pytestmark = [pytest.mark.integration]


def reasons(out) -> dict[str, int]:
    """The worker's counted reward reasons, from its last log line (``worker ... done: {...}``)."""
    done = [line for line in (out / "logs" / "worker-0.log").read_text().splitlines() if " done: {" in line]
    assert done, "the worker never logged its last line"
    found = re.search(r"'reward_reasons': (\{[^}]*\})", done[-1])
    assert found, done[-1][-500:]
    return json.loads(found.group(1).replace("'", '"'))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_math_run_on_the_shipped_problems_scores_every_answer_with_its_reason(tmp_path, model_cache):
    pytest.importorskip("math_verify", reason="reward=math needs math-verify: pip install 'rlhf-service[math]'")
    out = tmp_path / "out"
    proc = run_cmd([script("rlhf-run"), f"hydra.run.dir={out}", *base_overrides(model_cache), "rollout.num_workers=1",
                    "learner.max_updates=4", "reward=math", "data=jsonl", f"data.path={ARITHMETIC}",
                    "rollout.max_prompt_tokens=128"], tmp_path, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["samples_trained"] == 64
    assert all("reward/math" in r for r in read_metrics(out))
    counted = reasons(out)
    assert set(counted) <= {f"math/{r}" for r in ("correct", "wrong", "no_answer", "unparsed", "timeout")}
    assert sum(counted.values()) >= 64 - summary["rewards"]["empty_responses"]  # every scored answer has its reason
    assert summary["rewards"]["reasons"]  # summary.json counts them too (from the last heartbeats)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_code_run_executes_every_response_in_the_sandbox(tmp_path, model_cache):
    from sandbox_helpers import working_sandbox

    working_sandbox()
    tasks = tmp_path / "tasks.jsonl"  # the default task's prompts, with the count as the program's expected output
    tasks.write_text("".join(json.dumps({"prompt": f"{d}:", "tests": [{"input": "", "output": "".join(
        str((d + k) % 10) for k in range(1, 7))}]}) + "\n" for d in range(10)))
    out = tmp_path / "out"
    proc = run_cmd([script("rlhf-run"), f"hydra.run.dir={out}", *base_overrides(model_cache), "rollout.num_workers=1",
                    "learner.max_updates=3", "reward=code_tests", "data=jsonl", f"data.path={tasks}",
                    "sandbox.wall_s=10"], tmp_path, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["steps"] == 3
    counted = reasons(out)
    assert counted and sum(counted.values()) >= 48 * 0.5  # nearly every response ran (empty ones score 0 unrun)
    assert set(counted) <= {f"code_tests/{r}" for r in ("passed", "wrong_output", "failed", "timeout", "memory",
                                                         "output_limit", "crashed", "no_code")}
    config = (out / "run_config.yaml").read_text()
    assert "backend: bwrap" in config  # the run's sandbox settings reached the reward


@pytest.mark.timeout(120)
def test_a_code_run_where_bwrap_is_missing_stops_before_anything_starts(tmp_path, model_cache):
    empty = tmp_path / "bin"
    empty.mkdir()
    out = tmp_path / "out"
    proc = subprocess.run([script("rlhf-run"), f"hydra.run.dir={out}", *base_overrides(model_cache), "reward=code_tests"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=90, env=child_env(PATH=str(empty)))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    said = [line for line in proc.stderr.splitlines() if "bubblewrap" in line]
    assert len(said) == 1 and "apt-get install -y bubblewrap" in said[0], proc.stderr[-2000:]
    assert not (out / "children.json").exists()
    assert shutil.which("bwrap", path=str(empty)) is None
