"""Every bad-input kind lands in the dead-letter stream (reason, producer, raw bytes); consumers keep running."""

from __future__ import annotations

import math

import numpy as np
import pytest

import factories as T
from buffer import keys as K
from buffer_clients import Clients
from rlhf_core.config import BufferConfig
from rlhf_core.records import Sample

pytestmark = pytest.mark.integration

VOCAB, MAX_RESPONSE = 100, 16


@pytest.fixture
def buf(redis_url):
    b = Clients.connect(redis_url, "dead", BufferConfig(lease_timeout_s=5.0, dead_letter_maxlen=100))
    b.learner.init_run(batch_size=8, group_size=8, max_staleness=8, max_response_tokens=MAX_RESPONSE, vocab_size=VOCAB)
    yield b
    b.close()


def _bad_samples(pid: str) -> dict[str, Sample]:
    """One sample per semantic defect, each otherwise valid."""
    return {
        "reward is not finite": T.sample(pid, index=1, reward=math.nan),
        "more than the configured max of 16": T.sample(pid, index=2, response_tokens=MAX_RESPONSE + 1),
        "outside the vocabulary": T.sample(pid, index=3, response_ids=np.array([5, VOCAB, 7, 1, 2, 3, 4, 5], dtype=np.int32)),
        "log-prob > 0": T.sample(pid, index=3, behaviour_logprobs=np.full(8, 0.5, dtype=np.float32)),
    }


def test_worker_side_invalid_samples_are_dead_lettered_and_the_group_completes(buf):
    buf.producer.enqueue_prompts(T.prompts(1))
    (lease,) = buf.worker.claim("w7", 1)
    bad = _bad_samples("p0")
    good = T.sample("p0", index=0)
    assert buf.worker.complete(lease, [good, *bad.values()]) == "appended"
    dead = buf.monitor.dead_letters()
    assert len(dead) == 4
    for (expected, sample), rec in zip(bad.items(), dead):
        assert rec["kind"] == "sample" and expected in rec["reason"] and rec["producer"] == "w7"
        assert rec["raw"] == sample.encode() and rec["source"] == lease.lease_id
    batch = buf.learner.read_batch("L", 0, 8, timeout_s=1.0)
    assert batch.group_sizes == [1] and batch.samples[0].sample_id == good.sample_id
    c = buf.monitor.metrics()["counters"]
    assert (c["samples_dead_lettered"], c["dead_letters"], c["samples_appended"]) == (4, 4, 1)


def test_a_group_with_no_valid_sample_returns_its_budget(buf):
    buf.producer.enqueue_prompts(T.prompts(2))
    leases = buf.worker.claim("w", 2)
    budget = buf.monitor.admission_budget()
    assert buf.worker.complete(leases[0], [T.sample("p0", reward=math.inf)]) == "empty"
    assert buf.monitor.admission_budget() == budget + 8
    assert buf.monitor.metrics()["counters"]["groups_appended"] == 0


def test_learner_side_every_bad_kind_is_dead_lettered_and_reading_goes_on(buf):
    """Records written by another program straight into the stream: the learner must not trust it."""
    good = T.sample("p9", index=0)
    garbage = b"\xc1\x00not msgpack"
    wrong_kind = T.prompts(1)[0].encode()
    bad = {"malformed msgpack": garbage, "expected a record of kind sample": wrong_kind}
    bad.update({reason: s.encode() for reason, s in _bad_samples("p9").items()})
    fields = {K.F_GROUP: "g-p9", K.F_PROMPT_ID: "p9", K.F_VERSION: 0, K.F_COUNT: 1 + len(bad), K.F_PRODUCER: "rogue", K.F_TIME: 0}
    for i, raw in enumerate([good.encode(), *bad.values()]):
        fields[f"{K.SAMPLE_FIELD_PREFIX}{i}"] = raw
    buf.redis.xadd(buf.keys.samples, fields)
    buf.redis.xadd(buf.keys.samples, {"junk": "entry"})  # not even our entry layout
    _produce_one(buf, "p1")

    b1 = buf.learner.read_batch("L", 0, 8, timeout_s=1.0)
    b2 = buf.learner.read_batch("L", 0, 8, timeout_s=1.0)
    assert [g.group_id for g in b1.groups + b2.groups] == ["g-p9", "g-p1"]  # the junk entry was dropped
    assert b1.group_sizes == [1] and b1.samples[0].sample_id == good.sample_id
    assert buf.learner.commit(b1) == 1 and buf.learner.commit(b2) == 1
    dead = buf.monitor.dead_letters()
    assert [d["kind"] for d in dead] == ["entry"] + ["sample"] * 6
    assert "malformed sample-stream entry" in dead[0]["reason"]
    for (expected, raw), rec in zip(bad.items(), dead[1:]):
        assert expected in rec["reason"] and rec["raw"] == raw and rec["producer"] == "rogue"
    c = buf.monitor.metrics()["counters"]
    assert (c["samples_dead_lettered"], c["entries_dead_lettered"], c["dead_letters"]) == (6, 1, 7)
    assert buf.learner.commit(b1) == 0 and buf.monitor.metrics()["counters"]["dead_letters"] == 7  # no double count


def test_undecodable_prompt_is_dead_lettered_and_claiming_goes_on(buf):
    buf.redis.xadd(buf.keys.prompts, {K.PROMPT_FIELD: b"\x93garbage"})
    buf.redis.hincrby(buf.keys.counters, "prompts_waiting", 1)
    buf.producer.enqueue_prompts(T.prompts(1))
    got = buf.worker.claim("w", 2)
    assert [lease.prompt.prompt_id for lease in got] == ["p0"]
    dead = buf.monitor.dead_letters()
    assert len(dead) == 1 and dead[0]["kind"] == "prompt" and "undecodable prompt" in dead[0]["reason"]
    assert dead[0]["raw"] == b"\x93garbage" and dead[0]["producer"] == "w"
    c = buf.monitor.metrics()["counters"]
    assert (c["prompts_dead_lettered"], c["inflight"], c["admitted"]) == (1, 8, 8)


def test_dead_letter_api_and_the_stream_cap(buf):
    for i in range(300):
        buf.learner.dead_letter(f"reward fn raised ZeroDivisionError #{i}", "w3", b"\x01\x02")
    assert 100 <= buf.redis.xlen(buf.keys.dead) < 300  # MAXLEN ~ 100 trims whole nodes
    c = buf.monitor.metrics()["counters"]
    assert (c["samples_dead_lettered"], c["dead_letters"]) == (300, 300)
    assert buf.monitor.dead_letters(1)[0]["reason"].endswith("#299")


def _produce_one(buf: Clients, pid: str) -> None:
    from rlhf_core.records import Prompt

    buf.producer.enqueue_prompts([Prompt(pid, "x")])
    (lease,) = buf.worker.claim("w", 1)
    buf.worker.complete(lease, [T.sample(pid, index=0)])


def _raw_entry(buf: Clients, pid: str, samples: list, **overrides) -> None:
    """One group written straight into the stream, with the given fields overridden."""
    fields = {K.F_GROUP: f"g-{pid}", K.F_PROMPT_ID: pid, K.F_VERSION: 0, K.F_COUNT: len(samples), K.F_PRODUCER: "rogue",
              K.F_TIME: 0}
    fields.update(overrides)
    for i, s in enumerate(samples):
        fields[f"{K.SAMPLE_FIELD_PREFIX}{i}"] = s.encode()
    buf.redis.xadd(buf.keys.samples, fields)


# (poison entry, what the dead letter's reason says): each once ended or wedged the learner
# (a Lua error in the drop or commit script, an OverflowError while collating, a sample
# trained at staleness -999,998).
POISON = {
    "count not a number": (dict(n="abc"), [T.sample("px")], "entry", "n='abc' is not an integer"),
    "fractional count": (dict(n="1.5"), [T.sample("px")], "entry", "n='1.5' is not an integer"),
    "negative count": (dict(n="-3"), [T.sample("px")], "entry", "n='-3' is not an integer"),
    "version field not a number": (dict(v="zz"), [T.sample("px")], "entry", "v='zz' is not an integer"),
    "token version 2^64-1": ({}, [T.sample("px", token_versions=[2**64 - 1] * 8)], "sample", "policy version out of range"),
    "version ahead of the learner": ({}, [T.sample("px", version=1_000_000)], "sample",
                                     "newer than the learner's version 2"),
}


@pytest.mark.parametrize("name", sorted(POISON))
def test_a_poison_entry_is_dead_lettered_and_training_goes_on(buf, name):
    overrides, samples, kind, reason = POISON[name]
    buf.learner.set_learner_version(2)
    _raw_entry(buf, "px", samples, **overrides)
    _produce_one(buf, "p1")
    batch = buf.learner.read_batch("L", 2, 8, timeout_s=2.0)
    assert [g.group_id for g in batch.groups] == ["g-p1"]  # the poison entry was dropped, not handed out
    assert buf.learner.commit(batch) == 1
    dead = buf.monitor.dead_letters()
    assert [d["kind"] for d in dead] == [kind] and reason in dead[0]["reason"], dead
    assert dead[0]["producer"] == "rogue"
    c = buf.monitor.metrics()["counters"]
    assert c["dead_letters"] == 1 and c["samples_consumed"] == 1
    # no counter went negative or non-numeric (the *_in_buffer gauges are derived: appended -
    # removed, and an entry written around the buffer API was never counted as appended)
    negative = {k: v for k, v in c.items() if k.startswith(("samples_", "groups_")) and not k.endswith("_in_buffer")
                and not v >= 0}
    assert not negative, negative


def test_versions_a_restarted_learner_published_before_its_crash_are_not_refused(buf):
    # The learner published up to v8 and crashed; restored at v4 it reads against v4 while the
    # workers sampled with v7: possible, so trained. Only versions above the stored one are not.
    buf.learner.set_learner_version(8)
    _raw_entry(buf, "pa", [T.sample("pa", version=7)])
    _raw_entry(buf, "pb", [T.sample("pb", version=9)])
    batch = buf.learner.read_batch("L", 4, 8, timeout_s=2.0)
    assert [g.group_id for g in batch.groups] == ["g-pa"]
    buf.learner.commit(batch)
    assert buf.learner.read_batch("L", 4, 8, timeout_s=0.5) is None  # the v9 group is dropped on this read
    assert [d["reason"].split(";")[0] for d in buf.monitor.dead_letters()] == ["policy version 9 is newer than the learner's version 8"]


def test_the_version_a_learner_is_still_sending_is_not_refused(buf):
    # Restored at v4 and replaying, the learner trained v9 and its publish thread sent it: a
    # worker sampled with v9 before the thread told Redis (which still says 8). The learner
    # passes newest=9, so the v9 group trains; a v10 group cannot exist and is refused.
    buf.learner.set_learner_version(8)
    _raw_entry(buf, "pa", [T.sample("pa", version=9)])
    _raw_entry(buf, "pb", [T.sample("pb", version=10)])
    batch = buf.learner.read_batch("L", 4, 8, timeout_s=2.0, newest=9)
    assert [g.group_id for g in batch.groups] == ["g-pa"]
    buf.learner.commit(batch)
    assert buf.learner.read_batch("L", 4, 8, timeout_s=0.5, newest=9) is None
    assert [d["reason"].split(";")[0] for d in buf.monitor.dead_letters()] == ["policy version 10 is newer than the learner's version 9"]


def test_a_huge_dead_record_keeps_a_bounded_prefix_its_size_and_hash(buf):
    import hashlib

    from buffer.keys import DEAD_RAW_MAX

    huge = b"\x01" * (10 * 1024 * 1024)  # once copied whole into the dead-letter stream
    buf.learner.dead_letter("reward fn raised on a 10 MB sample", "w3", huge)
    buf.learner.dead_letter("small", "w3", b"\x02\x03")
    big, small = buf.monitor.dead_letters()
    assert big["raw"] == huge[:DEAD_RAW_MAX] and big["raw_bytes"] == len(huge)
    assert big["raw_sha1"] == hashlib.sha1(huge).hexdigest()
    assert (small["raw"], small["raw_bytes"], small["raw_sha1"]) == (b"\x02\x03", 2, "")


def test_the_scripts_keep_a_bounded_prefix_of_a_huge_dead_record_too(buf):
    import hashlib

    from buffer.keys import DEAD_RAW_MAX

    garbage = b"\xc1" + b"\x00" * (1024 * 1024)  # undecodable, 1 MB
    fields = {K.F_GROUP: "g-ph", K.F_PROMPT_ID: "ph", K.F_VERSION: 0, K.F_COUNT: 1, K.F_PRODUCER: "rogue", K.F_TIME: 0,
              f"{K.SAMPLE_FIELD_PREFIX}0": garbage}
    buf.redis.xadd(buf.keys.samples, fields)
    assert buf.learner.read_batch("L", 0, 8, timeout_s=0.5) is None  # nothing usable: dropped by drop.lua
    (dead,) = buf.monitor.dead_letters()
    assert dead["raw"] == garbage[:DEAD_RAW_MAX] and dead["raw_bytes"] == len(garbage)
    assert dead["raw_sha1"] == hashlib.sha1(garbage).hexdigest()
