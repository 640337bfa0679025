"""The vllm engine's private folder (in /dev/shm: update files, LoRA versions, GBs of weights).
close() removes it, and vLLM's owner watch when the worker alone is killed; a worker SIGKILLed
together with vLLM's processes left it for good. The next engine to make its folder removes the
folders of dead owners. No vLLM needed: the folder is made before and apart from the engine."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from rollout_workers.vllm_engine import private_folder

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
REPO = Path(__file__).resolve().parents[2]

OWNER = """
import sys, time
from rollout_workers.vllm_engine import private_folder
folder, lock = private_folder(disk="disk" in sys.argv)
(folder / "update-1.safetensors").write_bytes(b"weights")
print(folder, flush=True)
time.sleep(600)
"""


def _owner(*args: str) -> tuple[subprocess.Popen, Path]:
    proc = subprocess.Popen([sys.executable, "-c", OWNER, *args], cwd=REPO, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    assert line, f"the owner exited ({proc.wait()}) before making its folder"
    return proc, Path(line)


def test_a_new_engine_folder_removes_the_folders_of_dead_owners_and_keeps_the_others():
    dead, dead_folder = _owner()
    live, live_folder = _owner()
    parent = dead_folder.parent
    unnamed = parent / "rlhf-vllm-k3j_2x9q"  # an engine's from before the owner record: mkdtemp's name
    foreign = parent / f"rlhf-vllm-{dead.pid}-0123456789ab"  # another user's (made here when root can)
    made = [dead_folder, live_folder, unnamed, foreign]
    try:
        dead.send_signal(signal.SIGKILL)  # the worker and its engine processes at once: no watch left
        dead.wait(10)
        assert (dead_folder / "update-1.safetensors").exists()  # nothing removed it
        unnamed.mkdir()
        if os.geteuid() == 0:
            foreign.mkdir()
            os.chown(foreign, 65534, 65534)
        folder, lock = private_folder()
        made.append(folder)
        lock.close()
        assert folder.parent == parent and folder.name.startswith(f"rlhf-vllm-{os.getpid()}-")
        assert not dead_folder.exists()
        assert (live_folder / "update-1.safetensors").exists() and unnamed.exists()
        assert foreign.exists() or os.geteuid() != 0
    finally:
        for proc in (dead, live):
            proc.kill()
            proc.wait(10)
        for path in made:
            shutil.rmtree(path, ignore_errors=True)


def test_the_folder_a_dead_engine_made_in_the_temp_dir_is_removed_too():
    # the folder of update files /dev/shm had no room for (disk, GBs of a real model's version)
    if not os.path.isdir("/dev/shm"):
        pytest.skip("without /dev/shm the engine's one folder is in the temp dir: the test above")
    dead, dead_folder = _owner("disk")
    made = [dead_folder]
    try:
        assert dead_folder.parent == Path(tempfile.gettempdir())
        dead.send_signal(signal.SIGKILL)
        dead.wait(10)
        folder, lock = private_folder()
        made.append(folder)
        lock.close()
        assert folder.parent == Path("/dev/shm") and not dead_folder.exists()
    finally:
        dead.kill()
        dead.wait(10)
        for path in made:
            shutil.rmtree(path, ignore_errors=True)
