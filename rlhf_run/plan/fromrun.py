"""A profile fitted from a finished run's folder (``rlhf-plan profile --from-run DIR``), where no
calibration can run: more coarsely than :mod:`rlhf_run.plan.measure`, the learner's costs from
``metrics.jsonl``, generation and weight pulls from the workers' last heartbeats in
``timeline.jsonl``, lengths as a two-point distribution (the cap, and the mean of the rest). All
are wall-clock times measured while the processes shared the machine, so they include its
contention: the profile's ``contention`` is 1 and its ``notes`` say so.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from rlhf_run.plan.profile import Generation, Learner, Lengths, Machine, Profile, ProfileError, Sync, Worker, identity_of
from rlhf_run.progress import TIMELINE_FILE, every_worker, read_jsonl, read_timeline


def _config(folder: Path) -> Any:
    from omegaconf import DictConfig, OmegaConf

    from rlhf_core.config import Config, register_configs, to_object

    register_configs()
    path = folder / "run_config.yaml"
    if not path.exists():
        raise ProfileError(f"{folder} has no run_config.yaml: is it the output folder of an rlhf-run run?")
    doc = OmegaConf.load(path)
    if not isinstance(doc, DictConfig):
        raise ProfileError(f"{path} is not a map of config sections: is it the run_config.yaml rlhf-run wrote?")
    doc.pop("defaults", None)
    cfg = to_object(OmegaConf.merge(OmegaConf.structured(Config), doc))
    return cfg


def profile_from_run(folder: str | Path, warmup: int = 20) -> Profile:
    from rlhf_core import metric_names as M
    from rlhf_run.plan.measure import fit

    folder = Path(folder)
    if not (folder / M.METRICS_FILE).exists():
        raise ProfileError(f"{folder} has no {M.METRICS_FILE}: give the output folder of a run that trained")
    cfg = _config(folder)
    rows = read_jsonl(folder / M.METRICS_FILE)
    if len(rows) < warmup + 10:
        raise ProfileError(f"{folder} has {len(rows)} updates; at least {warmup + 10} are needed to fit the costs")
    rows = rows[warmup:]
    timeline = read_timeline(folder / TIMELINE_FILE)
    batch = float(statistics.median(r.get(M.NUM_SAMPLES, cfg.learner.batch_size) for r in rows))
    cap = int(cfg.rollout.max_new_tokens)
    prompts = [float(r.get(M.PROMPT_LEN_MEAN, cfg.rollout.max_prompt_tokens)) for r in rows]
    responses = [float(r.get("reward/response_len_mean", cap)) for r in rows]
    # prompt + response tokens of each batch (M.NUM_TOKENS counts the loss mask's: no prompt)
    tokens = [float(r.get(M.NUM_SAMPLES, batch)) * (p + n) for r, p, n in zip(rows, prompts, responses)]
    compute = [float(r.get(M.TIME_COMPUTE_S, 0.0)) for r in rows]
    coef = fit([[1.0, t] for t in tokens], compute)
    gaps = [b[M.TIME] - a[M.TIME] - b.get(M.TIME_WAIT_S, 0.0) - b.get(M.TIME_READ_S, 0.0) - b.get(M.TIME_COMPUTE_S, 0.0)
            for a, b in zip(rows, rows[1:])]
    # decoding a batch, per sample (0 for a run from before the learner reported it: then it is in per_update)
    read_per_sample = statistics.median(float(r.get(M.TIME_READ_S, 0.0)) / max(1.0, float(r.get(M.NUM_SAMPLES, batch)))
                                        for r in rows)
    every = max(1, cfg.learner.checkpoint_every)  # a run from before validate refused 0 checkpointed every update
    # the learner writes update u's row, then checkpoints (u % every == 0): its cost is in the gap after row u
    plain = [g for r, g in zip(rows, gaps) if r.get(M.UPDATES, 0) % every]
    ckpt = [g for r, g in zip(rows, gaps) if not r.get(M.UPDATES, 0) % every]
    per_update = max(0.0, statistics.median(plain)) if plain else 0.0
    checkpoint = max(0.0, statistics.median(ckpt) - per_update) if ckpt else 0.0
    send = statistics.median(float(r.get(M.TIME_PUBLISH_S, 0.0)) for r in rows)

    mean_len = statistics.fmean(responses)
    trunc = statistics.fmean(float(r.get("reward/truncated_frac", 1.0)) for r in rows)
    rest = (mean_len - trunc * cap) / (1.0 - trunc) if trunc < 1.0 else cap
    rest = min(cap, max(1, round(rest)))
    lengths = Lengths([rest, cap], [1.0 - trunc, trunc]) if rest != cap else Lengths([cap], [1.0])
    prompt = max(1, round(statistics.fmean(prompts)))

    last = timeline[-1] if timeline else {}
    workers = every_worker(last)  # the retired ones too: their sums are kept
    # a worker's time not spent waiting for budget or pulling weights: its engine steps and their loop
    busy = sum(float(w.get("uptime_s", 0.0)) - float(w.get("t_wait", 0.0)) - float(w.get("t_weights", 0.0)) for w in workers)
    gen_tokens = sum(float(w.get("tokens", 0.0)) for w in workers)
    pulls = sum(float(w.get("weight_updates", 0.0)) for w in workers)
    pull_s = sum(float(w.get("t_weights", 0.0)) for w in workers) / pulls if pulls else 0.0
    if gen_tokens <= 0:
        raise ProfileError(f"{folder}/timeline.jsonl has no worker statistics (tokens generated): the run's workers "
                           "never reported; calibrate instead (`rlhf-plan profile`)")
    # rows per step: the slots, or what pacing lets run, whichever is smaller
    ahead = cfg.algo.max_staleness if cfg.buffer.lookahead is None else min(cfg.algo.max_staleness, cfg.buffer.lookahead)
    rows_per_step = max(1.0, min(cfg.rollout.slots, (ahead + 1) * batch / max(1, cfg.rollout.num_workers)))
    step_s = busy / max(1.0, gen_tokens / rows_per_step)
    sync_bytes = float((last.get("stats", {}).get("weight_server") or {}).get("bytes") or 0.0)
    return Profile(
        kind="gpu" if identity_of(cfg)["device"] == "cuda" else "cpu",
        identity=identity_of(cfg),
        source={"how": "run", "folder": str(folder), "updates": len(rows) + warmup, "overrides": []},
        machine=Machine(cores=2.0, contention=1.0, background=0.0, launcher_per_s=0.0),
        generation=Generation(decode_base=step_s, decode_per_row=0.0, decode_per_ctx_token=0.0, prefill_base=step_s,
                              prefill_per_row=0.0, prefill_per_token=0.0, prompt_tokens=Lengths([prompt], [1.0]),
                              response_tokens=lengths, max_new_tokens=cap),
        worker=Worker(per_iteration=0.0, claim_call=0.0, per_prompt=0.0, emit_call=0.0, per_sample_emit=0.0,
                      score_batch=0.0, score_sample=0.0),
        learner=Learner(update_base=coef[0], update_per_micro=0.0, update_per_sample=0.0, update_per_token=coef[1],
                        per_update=per_update, read_base=0.0, read_per_sample=read_per_sample, checkpoint_s=checkpoint),
        sync=Sync(bytes=sync_bytes, transport="shm" if cfg.weight_server.shm == "auto" else "tcp", snapshot_base=0.0,
                  snapshot_per_byte=0.0, send_base=send, send_per_byte=0.0, pull_base=pull_s, pull_per_byte=0.0),
        notes=["fitted from a run's records: wall-clock costs under that run's own sharing of the machine "
               "(contention 1); the worker loop's glue is inside the per-step cost; coarser than a calibration"]
        + ([] if all(M.PROMPT_LEN_MEAN in r for r in rows) else
           [f"the run recorded no {M.PROMPT_LEN_MEAN}: prompts taken as rollout.max_prompt_tokens long, an upper bound"]),
    )
