"""Decoding sample-stream entries and assembling batches (no Redis)."""

from __future__ import annotations

import math

import factories as T
from buffer import keys as K
from buffer.samples import build_batch, decode_entry
from rlhf_core.config import BufferConfig

PARAMS = {"vocab_size": 100, "max_response_tokens": 16}
MAX_BYTES = BufferConfig().max_record_bytes


def _entry(samples, producer=b"w1", count=None):
    fields = {K.F_GROUP.encode(): b"g", K.F_PROMPT_ID.encode(): b"p", K.F_COUNT.encode(): str(count if count is not None else len(samples)).encode(),
              K.F_PRODUCER.encode(): producer, K.F_VERSION.encode(): b"0"}
    for i, raw in enumerate(samples):
        fields[f"{K.SAMPLE_FIELD_PREFIX}{i}".encode()] = raw
    return fields


def test_decode_entry_keeps_good_samples_and_lists_bad_ones():
    good = [T.sample("p", index=i, version=3 + i) for i in range(2)]
    nan = T.sample("p", index=2, reward=math.nan).encode()
    g = decode_entry("1-0", _entry([good[0].encode(), nan, good[1].encode(), b"\xc1"]), PARAMS, MAX_BYTES)
    assert [s.sample_id for s in g.samples] == [good[0].sample_id, good[1].sample_id]
    assert g.oldest_version == 3  # from the samples themselves, not the entry's field
    assert [(kind, producer, raw) for kind, _, producer, raw in g.bad] == [("sample", "w1", nan), ("sample", "w1", b"\xc1")]
    assert "reward is not finite" in g.bad[0][1]


def test_malformed_entry_is_one_bad_record():
    g = decode_entry("1-0", _entry([T.sample().encode()], count=3), PARAMS, MAX_BYTES)  # says 3, holds 1
    assert g.samples == [] and len(g.bad) == 1 and g.bad[0][0] == "entry"
    assert "malformed sample-stream entry" in g.bad[0][1]


def test_build_batch_slices_groups_and_staleness():
    g1 = decode_entry("1-0", _entry([T.sample("a", index=i, version=4).encode() for i in range(4)]), PARAMS, MAX_BYTES)
    g2 = decode_entry("2-0", _entry([T.sample("b", index=i, version=3).encode() for i in range(2)]), PARAMS, MAX_BYTES)
    b = build_batch([g1, g2], "L", learner_version=5)
    assert b.ids == ["1-0", "2-0"] and b.group_sizes == [4, 2] and len(b) == 6
    assert [(s.start, s.end, s.lag) for s in b.groups] == [(0, 4, 1), (4, 6, 2)]
    # lags: four samples at 1, two at 2 -> mean 8/6
    assert b.staleness == {"min": 1, "max": 2, "mean": 8 / 6, "hist": {1: 4, 2: 2}}
