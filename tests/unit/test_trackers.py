"""Experiment trackers, offline: TensorBoard event files read back, MLflow on a file store,
wandb in offline mode; each resumes its run from the id the checkpoint keeps."""

from __future__ import annotations

import importlib.util

import pytest

from learner.trackers import TRACKERS, Trackers, TrackerStartError, scalars
from rlhf_core.choices import Logger
from rlhf_core.config import Config, ConfigError, validate

METRICS = {"loss/policy": 0.5, "reward/mean": 0.25, "learner/version": 3, "staleness/hist": [2, 5, 1],
           "learner/prox_pass": True, "note": "text", "bad": float("nan")}
ROWS = [["3:", "4567", 0.5, 1, "worker-0"], ["7:", "89|0", 1.0, 0, "worker-1"]]
WORKERS = {"worker-0": {"samples_per_s": 120.0, "tokens_per_s": 700.0, "tokens": 5}}


def cfg_with(tmp_path, *loggers: str) -> Config:
    cfg = Config()
    cfg.buffer.run_id = "track-test"
    cfg.run.loggers = list(loggers)
    cfg.run.wandb_mode = "offline"
    cfg.run.mlflow_tracking_uri = (tmp_path / "mlruns").as_uri()
    cfg.run.log_samples_every = 2
    return cfg


def log_then_restart(cfg: Config, tmp_path, step: int) -> dict[str, str]:
    """Log an update and the details, close, then restart from the state a checkpoint keeps and log
    ``{"reward/mean": 0.5}`` at ``step``; returns that state."""
    first = Trackers(cfg, tmp_path)
    first.log_update(METRICS, 1)
    first.log_details(ROWS, WORKERS, 2)
    state = first.state()
    first.close()
    again = Trackers(cfg, tmp_path, state)  # what a restart from the checkpoint does
    assert again.state() == state
    again.log_update({"reward/mean": 0.5}, step)
    again.close()
    return state


def test_every_logger_name_has_a_tracker():
    assert set(TRACKERS) == set(Logger)


def test_scalars_keep_finite_numbers_and_bools():
    assert scalars(METRICS) == {"loss/policy": 0.5, "reward/mean": 0.25, "learner/version": 3.0, "learner/prox_pass": 1.0}


def test_missing_loggers_are_refused_before_anything_starts(monkeypatch):
    # (an unknown name in run.loggers or run.wandb_mode is refused at composition: tests/unit/test_config.py)
    cfg = Config()
    cfg.run.loggers = ["wandb"]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"wandb is not installed: pip install -e '.\[tracking\]'"):
        validate(cfg)


def test_a_tracker_that_cannot_start_says_what_to_check(tmp_path):
    cfg = cfg_with(tmp_path, "tensorboard", "mlflow")
    with pytest.raises(TrackerStartError, match=r"run.loggers: mlflow failed resuming run 0+: .*"
                                                r"check run.mlflow_tracking_uri .*or drop mlflow from run.loggers"):
        Trackers(cfg, tmp_path, {"mlflow": "0" * 32})  # a checkpoint's run id that this store does not hold


def test_tensorboard_gets_scalars_the_staleness_histogram_and_the_sample_table(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trackers = Trackers(cfg_with(tmp_path, "tensorboard"), tmp_path)
    for step in (1, 2):
        trackers.log_update(METRICS, step)
    assert trackers.due(2) and not trackers.due(3)
    trackers.log_details(ROWS, WORKERS, 2)
    assert trackers.state() == {}  # TensorBoard has no run id: a resumed run appends to the folder
    trackers.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    assert [e.value for e in events.Scalars("reward/mean")] == [0.25, 0.25]
    assert [e.step for e in events.Scalars("workers/worker-0/samples_per_s")] == [2]
    hist = events.Histograms("staleness/trained")[-1].histogram_value
    assert hist.num == 8 and hist.sum == 0 * 2 + 1 * 5 + 2 * 1  # 8 samples at lags 0,1,2: 2+5+1; lag sum 7
    text = events.Tensors("samples/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| prompt | response | reward | staleness | worker |" in text and "89\\|0" in text


def test_mlflow_logs_to_a_file_store_and_a_restored_learner_continues_the_same_run(tmp_path):
    from mlflow.tracking import MlflowClient

    cfg = cfg_with(tmp_path, "mlflow")
    state = log_then_restart(cfg, tmp_path, step=2)
    client = MlflowClient(cfg.run.mlflow_tracking_uri)
    history = client.get_metric_history(state["mlflow"], "reward/mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.25), (2, 0.5)]
    assert [m.value for m in client.get_metric_history(state["mlflow"], "staleness/trained/lag_1")] == [5.0]
    [run] = client.search_runs([client.get_experiment_by_name("rlhf-service").experiment_id])
    assert run.info.run_name == "track-test" and run.data.params["learner.lr"] == str(cfg.learner.lr)
    artifacts = [a.path for a in client.list_artifacts(state["mlflow"], "samples")]
    assert artifacts == ["samples/step_00000002.json"]


def test_a_trackers_config_holds_no_secret(tmp_path):
    # Once: the whole resolved config went to the tracker's server, with the weight server's secret
    # (under Ray, one the run makes) and the Redis URL's password
    from mlflow.tracking import MlflowClient

    cfg = cfg_with(tmp_path, "mlflow")
    cfg.buffer.url = "redis://rlhf:hunter2-password@10.0.0.5:6379/0"
    cfg.weight_server.secret = "s3cret-hmac-key-of-the-run"
    cfg.gateway.api_keys = ["k-0123456789abcdef"]
    Trackers(cfg, tmp_path).close()
    client = MlflowClient(cfg.run.mlflow_tracking_uri)
    [run] = client.search_runs([client.get_experiment_by_name("rlhf-service").experiment_id])
    params = run.data.params
    assert params["buffer.url"] == "redis://rlhf:***@10.0.0.5:6379/0"
    assert params["weight_server.secret"] == "***" and params["gateway.api_keys"] == "***"
    assert params["weight_server.curve_client_secret"] == "None"  # unset: shown as unset
    assert not any(word in value for value in params.values() for word in ("hunter2", "s3cret", "k-0123"))


def test_wandb_offline_keeps_its_run_id_across_a_restart(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    state = log_then_restart(cfg_with(tmp_path, "wandb"), tmp_path, step=3)
    runs = sorted(p.name for p in (tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(f"-{state['wandb']}" in name for name in runs), runs  # the second: "<id>-1"
    assert all(any(p.glob("*.wandb")) for p in (tmp_path / "wandb").glob("offline-run-*"))
