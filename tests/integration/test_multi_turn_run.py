"""A multi-turn run as a user starts it (`rlhf-run experiment=multi_turn`): the tiny model's
episodes go from the workers' environments through Redis to the learner, which trains on the
policy's tokens only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_run.summary import read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def test_a_multi_turn_run_trains_on_the_policys_tokens(tmp_path, model_cache):
    out = tmp_path / "out"
    cmd = [str(Path(sys.executable).parent / "rlhf-run"), "experiment=multi_turn", f"hydra.run.dir={out}",
           f"model.cache_dir={model_cache}", "run.progress=false", "learner.max_updates=3", "learner.batch_size=16",
           "learner.micro_batch_size=16", "rollout.num_workers=1", "rollout.slots=8"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=200,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = read_metrics(out)
    assert [r["learner/updates"] for r in rows] == [1, 2, 3]
    for r in rows:
        # 6 turns of one digit and 5 answers "|<digit>" of 2 tokens: 16 response tokens, 6 of them the policy's
        assert (r["reward/turns_mean"], r["reward/response_len_mean"], r["reward/policy_len_mean"]) == (6.0, 16.0, 6.0)
        assert r["learner/policy_token_frac"] == pytest.approx(6 / 16)
        assert r["learner/num_tokens"] == 16 * 6  # the loss counted policy tokens only
        assert 0.0 <= r["reward/env"] <= 1.0 and r["staleness/max"] <= 2
    last = [json.loads(line) for line in (out / "timeline.jsonl").read_text().splitlines()][-1]
    worker = next(c["stats"] for name, c in last["consumers"].items() if not name.startswith("learner"))
    # 3 batches of 16 episodes trained; every episode ended when its environment said so
    assert worker["episodes_stop"] >= 48 and worker["episodes_failed"] == worker["episodes_max_turns"] == 0
    assert worker["retokenisation_drift"] == 0 and worker["env_calls"] >= 7 * worker["episodes_stop"]
