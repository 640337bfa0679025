"""The Prometheus endpoint serves the metrics it was given, with conventional names."""

from __future__ import annotations

import math
import urllib.request

from rlhf_core.prometheus import Exporter, metric_name


def test_names_are_conventional():
    assert metric_name("rlhf_learner", "loss/clip_frac") == "rlhf_learner_loss_clip_frac"
    assert metric_name("rlhf_worker", "tokens-per.s") == "rlhf_worker_tokens_per_s"


def test_render_skips_non_numbers_and_nan():
    ex = Exporter("rlhf_learner", {"run": 'a"b'})
    ex.update({"learner/version": 3, "reward/mean": 0.25, "note": "text", "bad": math.nan, "flag": True})
    text = ex.render()
    assert 'rlhf_learner_learner_version{run="a\\"b"} 3.0' in text
    assert 'rlhf_learner_reward_mean{run="a\\"b"} 0.25' in text
    assert "rlhf_learner_flag" in text and "note" not in text and "bad" not in text


def test_http_endpoint_serves_metrics():
    ex = Exporter("rlhf_worker", {"worker": "w0"})
    ex.update({"tokens_per_s": 120.5})
    port = ex.serve(0)
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert 'rlhf_worker_tokens_per_s{worker="w0"} 120.5' in body
        ex.update({"tokens_per_s": 99.0})
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert 'rlhf_worker_tokens_per_s{worker="w0"} 99.0' in body
    finally:
        ex.close()
