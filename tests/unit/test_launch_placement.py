"""Placement on a multi-GPU machine: the environment and command each child of `rlhf-run` gets.
Nothing is started: the roles are the supervisor's, each one's process the local backend's."""

from __future__ import annotations

import sys

import pytest

from rlhf_core.cli import WORKER_ID_ENV
from rlhf_core.config import Config, ConfigError, validate
from rlhf_run.local_backend import LocalBackend
from rlhf_run.supervisor import Supervisor


class Planned(LocalBackend):
    """Each role's process planned, not started."""

    def start(self, role):
        role.handle = self.child(role)

    def write_pids(self, roles):
        pass


def plan(tmp_path, **settings):
    cfg = Config()
    cfg.rollout.num_workers = 3
    for key, value in settings.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    validate(cfg)
    supervisor = Supervisor(cfg, tmp_path, Planned(cfg, tmp_path))
    supervisor.start_roles()
    return {r.name: r.handle for r in supervisor.roles}


def test_without_devices_every_child_inherits_the_visible_gpus(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    children = plan(tmp_path)
    assert sorted(children) == ["learner", "worker-0", "worker-1", "worker-2"]
    assert {c.env["CUDA_VISIBLE_DEVICES"] for c in children.values()} == {"4,5"}
    assert children["learner"].cmd[:3] == [sys.executable, "-m", "learner"]


def test_devices_pin_the_learner_and_spread_the_workers(tmp_path):
    # learner on GPU 0; workers 0 and 2 on GPU 1, worker 1 on GPU 0 beside the learner
    children = plan(tmp_path, learner__devices=[0], rollout__devices=[1, 0])
    assert children["learner"].env["CUDA_VISIBLE_DEVICES"] == "0"
    assert [children[f"worker-{i}"].env["CUDA_VISIBLE_DEVICES"] for i in range(3)] == ["1", "0", "1"]
    assert [children[f"worker-{i}"].env[WORKER_ID_ENV] for i in range(3)] == ["worker-0", "worker-1", "worker-2"]
    assert children["learner"].cmd[:3] == [sys.executable, "-m", "learner"]  # one GPU: no torchrun


def test_a_learner_on_several_gpus_runs_under_torchrun(tmp_path):
    children = plan(tmp_path, learner__engine="deepspeed", learner__devices=[2, 3], rollout__devices=[0, 1])
    learner = children["learner"]
    assert learner.env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert learner.cmd[:5] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    assert learner.cmd[5:7] == ["-m", "learner"] and "--config-name" in learner.cmd


@pytest.mark.parametrize("settings, match", [
    (dict(learner__devices=[0, 1]), "learner.engine=deepspeed"),
    (dict(rollout__devices=[]), "rollout.devices"),
    (dict(learner__devices=[-1]), "learner.devices"),
    (dict(rollout__gpu_memory_fraction=1.5), "gpu_memory_fraction"),
])
def test_bad_placements_are_refused(tmp_path, settings, match):
    with pytest.raises(ConfigError, match=match):
        plan(tmp_path, **settings)


def test_the_gateway_line_names_the_model_id_clients_send(tmp_path, caplog):
    # Once: it said "model 'see GET /v1/models'" unless gateway.model_name was set
    with caplog.at_level("INFO", logger="rlhf_run.local_backend"):
        plan(tmp_path, gateway__enabled=True, model__path="/models/Qwen2.5-0.5B-Instruct")
    assert "gateway: http://127.0.0.1:8000/v1 (model 'Qwen2.5-0.5B-Instruct';" in caplog.text
