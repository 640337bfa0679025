"""Groups without a prompt lease (rlhf-gateway's rewarded sessions) on a real Redis: a rewarded
sample is kept until its group is appended, and the append deletes what it was made of in the
same step, so a group is appended once, whoever tries again (a retry whose reply was lost,
another gateway that took the kept samples up)."""

from __future__ import annotations

import pytest

import factories as T
from buffer.gateway import CallChunk, GatewayCall, WorkerChannel
from buffer_clients import Clients
from rlhf_core.config import BufferConfig
from rlhf_core.records import Sample
from rlhf_core.wire import WireError

pytestmark = pytest.mark.integration


def _buffer(url: str, run_id: str, max_staleness: int = 8) -> Clients:
    """A run of batches of one group of 2."""
    b = Clients.connect(url, run_id, BufferConfig(lease_timeout_s=5.0))
    b.learner.init_run(batch_size=2, group_size=2, max_staleness=max_staleness, max_response_tokens=16, vocab_size=100)
    return b


@pytest.fixture
def buf(redis_url):
    b = _buffer(redis_url, "gw-groups")
    yield b
    b.close()


def _group(n: int = 2) -> list[Sample]:
    return [T.sample("gw:g", group_id="gw:g:0", index=i, group_size=n, worker_id="gateway", reward=float(i))
            for i in range(n)]


def test_a_kept_group_is_appended_once_and_its_kept_samples_go_with_the_append(buf):
    group = _group()
    for i, s in enumerate(group):
        buf.gateway.keep_rewarded(f"k{i}", s)
    kept = buf.gateway.rewarded_kept()
    assert sorted(kept) == ["k0", "k1"] and Sample.decode(kept["k1"]).reward == 1.0
    entry = buf.gateway.append_group("gateway", group, ["k0", "k1"])
    assert entry and buf.gateway.rewarded_kept() == {}
    # the same call again (its first reply lost), or another gateway with the same kept samples: nothing
    assert buf.gateway.append_group("gateway", group, ["k0", "k1"]) is None
    batch = buf.learner.read_batch("L", 0, 2, timeout_s=1.0)
    assert [s.reward for s in batch.samples] == [0.0, 1.0]
    assert buf.learner.read_batch("L", 0, 2, timeout_s=0.2) is None  # appended once
    assert buf.monitor.metrics()["counters"]["groups_external"] == 1


def test_a_group_one_of_whose_kept_samples_is_gone_is_not_appended_and_keeps_the_rest(buf):
    group = _group()
    buf.gateway.keep_rewarded("a", group[0])
    assert buf.gateway.append_group("gateway", group, ["a", "b"]) is None  # "b" was never kept (or appended already)
    assert list(buf.gateway.rewarded_kept()) == ["a"] and list(buf.gateway.rewarded_kept(["a", "b"])) == ["a"]
    assert buf.gateway.rewarded_kept([]) == {}
    buf.gateway.forget_rewarded("a")
    assert buf.gateway.rewarded_kept() == {}
    assert buf.gateway.append_group("gateway", group) != ""  # nothing kept: appended as before


def test_a_filtered_group_is_counted_not_appended_and_its_kept_samples_go(buf):
    group = _group()
    for i, s in enumerate(group):
        buf.gateway.keep_rewarded(f"f{i}", s)
    budget = buf.monitor.admission_budget()
    assert buf.gateway.append_group("gateway", group, ["f0", "f1"], filtered="zero_variance") == ""
    assert buf.gateway.rewarded_kept() == {}
    c = buf.monitor.metrics()["counters"]
    assert (c["groups_filtered"], c["samples_filtered"], c["groups_filtered_zero_variance"]) == (1, 2, 1)
    assert (c["groups_appended"], c["groups_external"]) == (0, 0)
    assert buf.monitor.admission_budget() == budget  # no batch slot taken
    assert buf.learner.read_batch("L", 0, 2, timeout_s=0.2) is None
    with pytest.raises(ValueError, match="filter reason"):
        buf.gateway.append_group("gateway", group, filtered="boring")


def test_kept_samples_survive_a_redis_restart(redis_server, redis_url):
    import signal

    b = _buffer(redis_url, "gw-durable")
    s = _group()[0]
    b.gateway.keep_rewarded("k", s)
    redis_server.restart(signal.SIGKILL)  # only the append-only file keeps it
    assert Sample.decode(b.gateway.rewarded_kept()["k"]).sample_id == s.sample_id
    b.close()



@pytest.fixture
def paced(redis_url):
    """A synchronous run (max_staleness 0): one prompt admitted at a time."""
    b = _buffer(redis_url, "gw-paced", max_staleness=0)
    b.producer.enqueue_prompts(T.prompts(4))
    yield b
    b.close()


@pytest.mark.parametrize("n", [2, 1], ids=["full-group", "session-without-group"])
def test_a_gateway_group_takes_a_prompts_place_in_pacing(paced, n):
    # budget = (max_staleness 0 + version 0 + 1) * batch 2 - admitted 0 = 2: one prompt's group
    assert paced.monitor.admission_budget() == 2
    assert paced.gateway.append_group("gateway", _group(n)) != ""
    # the learner's next batch is the gateway's group (batches are whole groups, whatever their
    # size), so no prompt may start until it is trained: 2 - group_size 2 = 0 (before, the run's
    # prompts took the budget the gateway's group used up)
    assert paced.monitor.admission_budget() == 0
    assert paced.worker.claim("w", 4) == []
    batch = paced.learner.read_batch("L", 0, 2, timeout_s=1.0)
    assert len(batch.samples) == n
    paced.learner.commit(batch)
    paced.learner.set_learner_version(1)
    # (0 + 1 + 1) * 2 - 2 = 2: the next batch's prompt
    assert paced.monitor.admission_budget() == 2
    assert len(paced.worker.claim("w", 4)) == 1


def test_a_gateway_group_dropped_as_stale_gives_its_place_back(paced):
    assert paced.gateway.append_group("gateway", _group(1)) != ""  # its sample is of version 0
    paced.learner.set_learner_version(2)
    # admitted 2: (0 + 2 + 1) * 2 - 2 = 4
    assert paced.monitor.admission_budget() == 4
    assert paced.learner.read_batch("L", 2, 2, timeout_s=0.2) is None  # lag 2 > max_staleness 0: dropped
    counters = paced.monitor.metrics()["counters"]
    assert counters["groups_dropped_stale"] == 1 and counters["budget_returned"] == 2
    # given back: (0 + 2 + 1) * 2 - 0 = 6
    assert paced.monitor.admission_budget() == 6


@pytest.mark.parametrize("reply_to", ["gw bad", "", "__released__"])
def test_a_call_whose_reply_to_names_no_channel_is_refused_as_it_is_decoded(buf, reply_to):
    # accepted, it made WorkerChannel.send raise for the whole round, other gateways' chunks included
    bad = GatewayCall(call_id="c1", reply_to=reply_to, prompt_ids=[1, 2], max_tokens=4)
    good = GatewayCall(call_id="c2", reply_to="gw-good", prompt_ids=[1, 2], max_tokens=4)
    buf.redis.lpush(buf.keys.gw_calls, bad.encode(), good.encode())
    channel = WorkerChannel(buf.redis, buf.keys)
    raw_bad, raw_good = channel.wait_take(2, block_s=1.0)
    with pytest.raises(WireError, match="field 'reply_to'.*not usable"):
        GatewayCall.decode(raw_bad)
    call = GatewayCall.decode(raw_good)
    listener = buf.redis.pubsub()
    listener.subscribe(buf.keys.gw_out(call.reply_to))
    assert listener.get_message(timeout=1.0)["type"] == "subscribe"
    chunk = CallChunk(call.call_id, [], final=True, error="done", worker_id="w")
    assert channel.send([(call.reply_to, chunk)], [(call.call_id, call.reply_to)]) == []
    assert CallChunk.decode(listener.get_message(timeout=1.0)["data"]).call_id == "c2"
    listener.close()


def test_the_runs_gateway_record_is_one_gateways_until_it_drops_it_or_lets_it_lapse(buf):
    from buffer.gateway import LIVE_TTL_S, drop_run, hold_run

    r, k = buf.redis, buf.keys
    assert hold_run(r, k, "gw-a") is None and hold_run(r, k, "gw-a") is None  # taken, then refreshed
    holder, left = hold_run(r, k, "gw-b")
    assert holder == "gw-a" and 0 < left <= LIVE_TTL_S
    drop_run(r, k, "gw-b")  # not its record: it stays
    assert hold_run(r, k, "gw-b")[0] == "gw-a"
    r.delete(k.gw_live)  # gw-a stopped refreshing it (it died): its record lapsed
    assert hold_run(r, k, "gw-b") is None and hold_run(r, k, "gw-a")[0] == "gw-b"
    drop_run(r, k, "gw-b")  # stopped
    assert r.exists(k.gw_live) == 0 and hold_run(r, k, "gw-a") is None
