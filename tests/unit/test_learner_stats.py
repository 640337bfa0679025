"""learner.stats: running moments and the metric accumulator."""

from __future__ import annotations

import pytest
import torch

from learner.stats import MetricSums, RunningMoments


def test_running_moments_merge_batches_exactly():
    data = torch.tensor([1.0, 2.0, 4.0, 8.0, 16.0, 3.0])
    rm = RunningMoments()
    rm.update(data[:2])
    rm.update(data[2:5])
    rm.update(data[5:])
    assert rm.count == 6
    assert rm.mean == pytest.approx(float(data.double().mean()), abs=1e-12)
    assert rm.var == pytest.approx(float(data.double().var()), abs=1e-12)  # unbiased
    clone = RunningMoments()
    clone.load_state_dict(rm.state_dict())
    assert clone.state_dict() == rm.state_dict()
    # normalise with the statistics: (x - mean) / (std + eps)
    # mean 34/6, one std above it normalises to 1
    x = torch.tensor([34 / 6, 34 / 6 + float(data.double().std())], dtype=torch.float64)
    torch.testing.assert_close(rm.normalize(x, 0.0), torch.tensor([0.0, 1.0], dtype=torch.float64))


def test_metric_sums_weighted_means_max_and_reduce():
    m = MetricSums()
    m.add("a", 1.0, 1.0)
    m.add("a", 4.0, 3.0)  # (1 + 12) / 4 = 3.25
    m.add_max("b", 2.0)
    m.add_max("b", 1.0)
    m.set("c", 7.0)
    assert m.result() == {"a": 3.25, "b": 2.0, "c": 7.0}
    # a second "rank" with a = 5 (weight 4) and b = 9: reduce sums and maxes
    m.reduce(lambda t: t.add_(torch.tensor([20.0, 4.0], dtype=torch.float64)),
             lambda t: t.copy_(torch.maximum(t, torch.tensor([9.0], dtype=torch.float64))))
    assert m.result() == {"a": (13.0 + 20.0) / 8.0, "b": 9.0, "c": 7.0}


def test_metric_sums_totals_add_up_over_records_and_ranks():
    m = MetricSums()
    m.add("a", 2.0, 1.0)
    m.add_total("n", 3.0)
    m.add_total("n", torch.tensor(4.0))  # 3 + 4 = 7 (a mean would say 3.5)
    assert m.result() == {"a": 2.0, "n": 7.0}
    # a second "rank" with a = 2 (weight 1) and n = 5: the totals are summed after the means' sums and weights
    m.reduce(lambda t: t.add_(torch.tensor([2.0, 1.0, 5.0], dtype=torch.float64)), lambda t: t)
    assert m.result() == {"a": 2.0, "n": 12.0}


@pytest.mark.parametrize("as_if_on_gpu", [False, True])
def test_metric_sums_take_tensors_and_read_device_ones_at_the_end(monkeypatch, as_if_on_gpu):
    # Values and weights may be 0-d tensors. On a GPU they wait (with everything recorded after
    # them, in order) until the result is asked for; here every tensor is treated as such a one
    # when as_if_on_gpu, so the waiting path runs on this CPU.
    import learner.stats

    if as_if_on_gpu:
        monkeypatch.setattr(learner.stats, "_on_device", lambda x: isinstance(x, torch.Tensor))
    m = MetricSums()
    m.set("c", 1.0)
    m.add("a", torch.tensor(2.0), torch.tensor(3))  # 2 * 3
    m.add("a", 4.0, torch.tensor(1, dtype=torch.int64))  # + 4 * 1 = 10, weight 4: 2.5
    m.add_max("b", torch.tensor(-1.0))
    m.add_max("b", torch.tensor(-3.0))  # max -1
    m.set("c", torch.tensor(5.0))
    m.set("c", 7.0)  # recorded last: wins over the tensor before it, waiting or not
    assert len(m._pending) == (6 if as_if_on_gpu else 0)
    assert m.result() == {"a": 2.5, "b": -1.0, "c": 7.0}
    m.add("a", torch.tensor(6.5), 4.0)  # recorded after a read: (10 + 26) / 8 = 4.5
    assert m.result()["a"] == 4.5
