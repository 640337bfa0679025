"""A run fed by agents only, as a user starts it: `rlhf-run gateway.enabled=true data.source=none`
starts the learner, a worker and the gateway; agents written with the `openai` client (async)
talk to it, post rewards, and the learner trains on their sessions until it has made its updates.
The gateway is SIGKILLed after the agents' first round: `rlhf-run` restarts it on its port and
the agents go on."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from rlhf_run.summary import read_metrics

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def wait_for_gateway(out: Path, proc: subprocess.Popen, timeout_s: float) -> dict:
    """gateway.json once the gateway wrote it, then its /health answering 200 (a worker serves it)."""
    deadline = time.monotonic() + timeout_s
    info: dict | None = None
    while True:
        assert proc.poll() is None, f"rlhf-run exited with {proc.returncode} before its gateway served"
        assert time.monotonic() < deadline, f"no healthy gateway within {timeout_s} s (gateway.json: {info})"
        if info is None and (out / "gateway.json").exists():
            info = json.loads((out / "gateway.json").read_text())
        if info is not None:
            try:
                if httpx.get(info["url"].removesuffix("/v1") + "/health", timeout=2).status_code == 200:
                    return info
            except httpx.TransportError:  # bound, not listening yet
                pass
        time.sleep(0.2)


async def agent(client, model: str, group: str) -> list[str]:
    """Two sessions of one group: one call with n=2, then each choice's session goes on by itself."""
    messages = [{"role": "user", "content": "count to 3"}]
    first = await client.chat.completions.create(model=model, messages=messages, n=2, max_tokens=4,
                                                 extra_headers={"X-Session-Id": group})
    sessions = []
    for choice in first.choices:
        sid = f"{group}/{choice.index}"
        turn = [*messages, choice.message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
        await client.chat.completions.create(model=model, messages=turn, max_tokens=4,
                                             extra_headers={"X-Session-Id": sid})
        sessions.append(sid)
    return sessions


async def feed(info: dict, proc: subprocess.Popen, deadline: float, after_first_round: Any) -> dict[str, int]:
    """Groups of agents until the run ends; their rewards: 1 for the first session, 0 for the other."""
    done = {"groups": 0, "appended": 0}
    async with openai.AsyncOpenAI(base_url=info["url"], api_key="none", max_retries=0, timeout=30) as client:
        g = 0
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                runs = await asyncio.gather(*(agent(client, info["model"], f"g{g + i}") for i in range(2)))
                for sessions in runs:
                    for reward, sid in enumerate(sessions):
                        r = await client.post(f"/rl/sessions/{sid}/reward", cast_to=httpx.Response,
                                              body={"reward": float(1 - reward)})
                        assert r.status_code == 200, r.text
                        done["appended"] += r.json()["status"] == "appended"
                    done["groups"] += 1
                if g == 0:
                    after_first_round()
            except (openai.APIConnectionError, openai.InternalServerError, httpx.TransportError):
                if proc.poll() is not None:  # the run finished while agents were talking to it
                    break
                await asyncio.sleep(0.5)  # after 2 updates the launcher stops everyone: wait for that
                if proc.poll() is None and time.monotonic() > deadline:
                    raise
            g += 2
            if done["appended"] >= 8:  # twice what 2 updates take: slow down, the learner has enough
                await asyncio.sleep(1.0)
    return done


def test_a_run_fed_by_agents_through_the_gateway_trains_and_its_gateway_killed_is_restarted(tmp_path, model_cache):
    from servers import free_port

    out = tmp_path / "out"
    cmd = [str(Path(sys.executable).parent / "rlhf-run"), "gateway.enabled=true", f"gateway.port={free_port()}",
           "data.source=none",
           f"hydra.run.dir={out}", f"model.cache_dir={model_cache}", "run.progress=false", "learner.batch_size=4",
           "algo.group_size=2", "learner.micro_batch_size=4", "learner.max_updates=2", "rollout.num_workers=1",
           "rollout.max_episode_tokens=64", "rollout.slots=8"]
    log = open(tmp_path / "run.log", "wb")
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))
    log.close()

    def tail() -> str:
        text = (tmp_path / "run.log").read_text(errors="replace")[-3000:]
        gw = out / "logs" / "gateway.log"
        return text + ("\n--- gateway.log\n" + gw.read_text(errors="replace")[-2000:] if gw.exists() else "")

    try:
        info = wait_for_gateway(out, proc, 120)
        assert info["model"] == "tiny" and info["url"].startswith("http://127.0.0.1:") and info["pid"] != proc.pid
        first_pid = info["pid"]
        done = asyncio.run(feed(info, proc, time.monotonic() + 150, lambda: os.kill(first_pid, signal.SIGKILL)))
        code = proc.wait(timeout=60)
    except BaseException:
        proc.kill()
        proc.wait()
        print(tail())
        raise
    assert code == 0, tail()
    run_log = (tmp_path / "run.log").read_text(errors="replace")
    assert "restarting gateway (restart 1)" in run_log, tail()
    assert json.loads((out / "gateway.json").read_text())["pid"] != first_pid  # its successor's, on the same url
    assert done["appended"] >= 4 and done["groups"] == done["appended"], done  # 2 updates of 2 groups each
    rows = read_metrics(out)
    assert [r["learner/updates"] for r in rows] == [1, 2], tail()
    for r in rows:
        # each update: 2 groups of 2 two-turn sessions rewarded 1 and 0, trained on the policy's tokens only
        assert (r["learner/num_groups"], r["learner/num_samples"], r["learner/partial_groups"]) == (2, 4, 0)
        assert (r["reward/mean"], r["reward/min"], r["reward/max"], r["reward/turns_mean"]) == (0.5, 0.0, 1.0, 2.0)
        assert 1 <= r["reward/policy_len_mean"] <= 8 and r["learner/num_tokens"] == 4 * r["reward/policy_len_mean"]
        assert 0 < r["learner/policy_token_frac"] < 1 and r["staleness/max"] <= 2
    summary = json.loads((out / "summary.json").read_text())
    # the gateway's own counts (its successor's, since the kill), in the summary and its printed line
    assert summary["gateway"]["calls"] > 0 and summary["gateway"]["sessions_rewarded"] > 0, summary["gateway"]
    assert "gateway (since it last started):" in run_log
    assert summary["buffer_counters"]["groups_appended"] >= done["appended"]  # a last answer may be cut off
    assert summary["buffer_counters"]["samples_dead_lettered"] == 0
    last = [json.loads(line) for line in (out / "timeline.jsonl").read_text().splitlines()][-1]
    worker = next(c["stats"] for name, c in last["consumers"].items() if not name.startswith("learner"))
    assert worker["gateway_done"] >= 8 and worker["tokens"] == worker["gateway_tokens"] > 0  # counted as generated
