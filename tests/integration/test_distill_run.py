"""``rlhf-run experiment=distill``: the student's reverse KL to a teacher falls, reported per update
in metrics.jsonl with the teacher pass's time; without the teacher the run stops before anything
starts, in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.integration]


def rlhf_run(cwd: Path, out: Path, model_cache: Path, *settings: str, timeout: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run([str(Path(sys.executable).parent / "rlhf-run"), f"hydra.run.dir={out}",
                           f"model.cache_dir={model_cache}", "run.progress=false", "experiment=distill", *settings],
                          cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_students_reverse_kl_to_its_teacher_falls(tmp_path, model_cache, tiny_model_cfg):
    from transformers import AutoModelForCausalLM

    from rlhf_core.models import load_tokenizer, model_dir, save_model_dir

    # a teacher the student is far from: the tiny model with the digits' rows of its output head
    # moved towards its mean final hidden state, so that it puts about 73% of its mass on the ten
    # digits where the random student puts 10%; in ./teacher, where experiment=distill looks
    teacher = AutoModelForCausalLM.from_pretrained(model_dir(tiny_model_cfg))
    tok = load_tokenizer(tiny_model_cfg)
    digits = [tok.convert_tokens_to_ids(str(d)) for d in range(10)]
    with torch.no_grad():
        ids = torch.randint(4, len(tok), (16, 12), generator=torch.Generator().manual_seed(0))
        mean = teacher.model(input_ids=ids).last_hidden_state.mean((0, 1))
        teacher.lm_head.weight[digits] += 2.0 * mean / mean.norm()
    save_model_dir(teacher, tok, tmp_path / "teacher")
    out = tmp_path / "out"
    proc = rlhf_run(tmp_path, out, model_cache, "learner.max_updates=60", "learner.checkpoint_every=60", timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "reward/mean" in r]
    assert len(rows) == 60 and all(r["distill/time_teacher_s"] > 0 for r in rows)
    kl = [r["distill/reverse_kl"] for r in rows]
    first, last = sum(kl[:10]) / 10, sum(kl[-10:]) / 10
    assert first > 0.5 and last < 0.5 * first, (first, last)
    assert all(r["distill/reverse_kl_k3"] >= 0 for r in rows)


@pytest.mark.timeout(180)
def test_experiment_distill_without_its_teacher_stops_before_anything_starts(tmp_path, model_cache):
    out = tmp_path / "out"
    proc = rlhf_run(tmp_path, out, model_cache, timeout=150)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: distill.teacher.path=./teacher: no such folder (and it is not a Hugging Face Hub id of the "
                      "form org/name); point it at a folder written by save_pretrained"], proc.stderr[-2000:]
    assert not (out / "metrics.jsonl").exists() and not (out / "logs" / "learner.log").exists()
