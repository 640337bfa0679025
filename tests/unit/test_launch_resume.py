"""`rlhf-run resume=<folder>`: the config a resumed run continues with, and what it refuses.
Nothing is started; the whole kill-and-resume path is in tests/integration/test_run.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from rlhf_core.config import Config, ConfigError
from rlhf_run.launch import LAUNCH_CONFIG, PIDS_FILE, resume_config
from rlhf_run.supervisor import save_launch_config, write_resolved_config


def saved_run(tmp_path, **learner) -> Config:
    cfg = Config()
    for key, value in learner.items():
        setattr(cfg.learner, key, value)
    save_launch_config(cfg, tmp_path)
    return cfg


def test_the_saved_config_comes_back_with_its_run_id(tmp_path):
    cfg = saved_run(tmp_path, lr=5e-4)
    assert cfg.buffer.run_id.startswith("run-")  # "auto" was replaced before saving
    resumed, out = resume_config(str(tmp_path))
    assert out == tmp_path.resolve()
    assert resumed.buffer.run_id == cfg.buffer.run_id and resumed.learner.lr == 5e-4
    assert resumed.buffer.url is None  # a private Redis: started again on the folder's data
    assert resumed.resume is None
    assert OmegaConf.to_yaml(OmegaConf.structured(resumed)) == OmegaConf.to_yaml(OmegaConf.structured(cfg))


def test_the_configs_a_run_keeps_are_readable_by_its_user_only(tmp_path):
    # Once: run_config.yaml was written world-readable, then chmod-ed (Ray) or not at all (local), and
    # launch_config.yaml and Hydra's copy (with the command line's overrides) stayed world-readable:
    # they hold weight_server.secret, gateway.api_keys and buffer.url's password when given
    (tmp_path / ".hydra").mkdir(mode=0o755)
    (tmp_path / "run_config.yaml").write_text("old")  # a resumed run's: rewritten, and its mode with it
    (tmp_path / "run_config.yaml").chmod(0o644)
    cfg = Config()
    cfg.weight_server.secret = "s3cret-hmac-key-of-the-run"
    save_launch_config(cfg, tmp_path)
    resolved = write_resolved_config(cfg, tmp_path)
    assert resolved == tmp_path / "run_config.yaml" and "s3cret" in resolved.read_text()
    for path, mode in ((tmp_path / LAUNCH_CONFIG, 0o600), (resolved, 0o600), (tmp_path / ".hydra", 0o700)):
        assert path.stat().st_mode & 0o777 == mode, path


def test_key_value_overrides_change_the_saved_config(tmp_path):
    saved_run(tmp_path, max_updates=40)
    resumed, _ = resume_config(str(tmp_path), ["resume=" + str(tmp_path), "learner.max_updates=90",
                                               "+run.progress=false", "hydra.run.dir=/elsewhere"])
    assert resumed.learner.max_updates == 90 and resumed.run.progress is False


# Hydra accepts `+learner.max_update=10` (it suggests the `+` for a misspelt key); the merge into the
# saved config then raised omegaconf's error with a traceback
@pytest.mark.parametrize("override, message", [("+learner.max_update=10", "learner.max_update"),
                                               ("learner.lr=abc", "learner.lr")])
def test_a_setting_that_is_not_one_or_of_the_wrong_type_is_refused_naming_it(tmp_path, override, message):
    saved_run(tmp_path)
    with pytest.raises(ConfigError, match=f"{message}.*--help"):
        resume_config(str(tmp_path), [override])


@pytest.mark.parametrize("override", ["learner=deepspeed", "~learner.lr", "buffer.run_id=other"])
def test_a_group_a_deletion_or_another_run_id_is_refused(tmp_path, override):
    saved_run(tmp_path)
    with pytest.raises(ConfigError, match="resume continues the run's saved config"):
        resume_config(str(tmp_path), [override])


def test_a_folder_that_is_not_a_run_is_refused_naming_the_file(tmp_path):
    with pytest.raises(ConfigError, match=f"{LAUNCH_CONFIG} does not exist.*output in"):
        resume_config(str(tmp_path / "typo"))


def test_a_run_whose_processes_still_live_is_refused(tmp_path):
    saved_run(tmp_path)
    (tmp_path / PIDS_FILE).write_text(json.dumps({"launcher": os.getpid()}))
    with pytest.raises(ConfigError, match=rf"still running: its launcher \(pid {os.getpid()}\) is alive"):
        resume_config(str(tmp_path))


def test_pids_of_ended_or_newer_processes_do_not_block_a_resume(tmp_path):
    saved_run(tmp_path)
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / PIDS_FILE).write_text(json.dumps({"learner": int(ended.stdout)}))
    os.utime(tmp_path / PIDS_FILE, (0, 0))  # written long before this process (and any pid reuse) started
    resume_config(str(tmp_path))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_started_with_die_with_parent_dies_with_its_parent(tmp_path):
    # parent: starts a sleeping grandchild with die_with_parent, prints its pid, then is SIGKILLed
    code = ("import subprocess, sys, time; from rlhf_core.cli import die_with_parent; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], preexec_fn=die_with_parent()); "
            "print(p.pid, flush=True); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    import psutil

    try:
        psutil.Process(child).wait(timeout=10)  # not our child: psutil polls; TimeoutExpired if it lives on
    except psutil.NoSuchProcess:
        pass  # already gone
