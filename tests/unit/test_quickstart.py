"""quickstart.sh's choice of where torch comes from (its `torch_index` function, run by bash)."""

from __future__ import annotations

import http.server
import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HAS_GPU = shutil.which("nvidia-smi") is not None or Path("/proc/driver/nvidia/version").exists()


def torch_index(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """Define quickstart.sh's functions (without running its command), then call torch_index."""
    script = ROOT / "quickstart.sh"
    body = script.read_text().split("\ncmd=${1:-}", 1)[0]  # everything before the command dispatch
    return subprocess.run(["bash", "-c", body + "\ntorch_index\n"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=60)


def test_torch_index_url_overrides_the_choice(tmp_path):
    assert torch_index(tmp_path, TORCH_INDEX_URL="https://mirror.example/cpu").stdout.strip() == "https://mirror.example/cpu"


def test_with_an_nvidia_gpu_torch_comes_from_pips_index(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    (fake / "nvidia-smi").chmod(0o755)
    done = torch_index(tmp_path, PATH=f"{fake}:{os.environ['PATH']}", CPU_TORCH_INDEX="http://127.0.0.1:9/none")
    assert done.returncode == 0 and done.stdout == ""


@pytest.mark.skipif(HAS_GPU, reason="this machine has an NVIDIA GPU")
def test_without_a_gpu_the_reachable_cpu_index_is_chosen_and_said(tmp_path):
    (tmp_path / "index" / "torch").mkdir(parents=True)
    (tmp_path / "index" / "torch" / "index.html").write_text("<html></html>")
    handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=str(tmp_path / "index"))  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        done = torch_index(tmp_path, CPU_TORCH_INDEX=url)
    finally:
        server.shutdown()
    assert done.stdout.strip() == url
    assert "no NVIDIA GPU: torch from PyTorch's CPU wheel index" in done.stderr


@pytest.mark.skipif(HAS_GPU, reason="this machine has an NVIDIA GPU")
def test_without_a_gpu_an_unreachable_cpu_index_falls_back_to_pip_and_says_so(tmp_path):
    done = torch_index(tmp_path, CPU_TORCH_INDEX="http://127.0.0.1:9/unreachable")
    assert done.returncode == 0 and done.stdout == ""
    assert "is unreachable: torch from pip's configured index" in done.stderr and "TORCH_INDEX_URL" in done.stderr
