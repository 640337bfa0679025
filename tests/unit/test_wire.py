"""Round trips of every record kind, and every kind of bad input giving the one typed error."""

from __future__ import annotations

import math
import os
import random
import re

import msgpack
import numpy as np
import pytest

from factories import sample
from rlhf_core import wire
from rlhf_core.records import KIND_PROMPT, KIND_SAMPLE, Prompt, Sample, rle_decode, rle_encode, validate_sample
from rlhf_core.wire import (
    SCHEMA_VERSION,
    WireError,
    decode_record,
    decode_tensor,
    encode_record,
    encode_tensor,
    pack,
    unpack,
)

# every field set to a value of its own, so a round trip that drops or swaps one is seen
EVERY_FIELD = dict(
    sample_id="s-1",
    prompt_id="p-1",
    group_id="g-1",
    prompt_ids=[1, 5, 7],
    response_ids=[9, 10, 2],
    behaviour_logprobs=[-0.5, -1.25, -0.125],
    versions=[[3, 2], [4, 1]],
    reward=0.75,
    reward_components={"correct": 1.0, "length": -0.25},
    finish_reason="stop",
    worker_id="w-0",
    group_size=4,
    index=2,
    ref_logprobs=[-0.4, -1.0, -0.2],
    created_at=1700000000.5,
    finished_at=1700000001.25,
    metadata={"answer": "42", "difficulty": 3},
)


def make_sample(**overrides) -> Sample:
    return sample(**{**EVERY_FIELD, **overrides})


def raw_sample_map(**overrides) -> dict:
    obj = unpack(make_sample().encode())
    obj.update(overrides)
    return obj


# ---------------------------------------------------------------- round trips


def test_sample_round_trip_keeps_every_field():
    s = make_sample()
    back = Sample.decode(s.encode())
    for name in ("sample_id", "prompt_id", "group_id", "versions", "reward", "reward_components", "finish_reason",
                 "worker_id", "group_size", "group_index", "created_at", "finished_at", "metadata"):
        assert getattr(back, name) == getattr(s, name), name
    for name in ("prompt_ids", "response_ids", "behaviour_logprobs", "ref_logprobs"):
        assert getattr(back, name).dtype == getattr(s, name).dtype
        np.testing.assert_array_equal(getattr(back, name), getattr(s, name))
    # versions [[3, 2], [4, 1]] -> tokens were sampled by 3, 3, 4; oldest 3, newest 4
    assert back.token_versions().tolist() == [3, 3, 4]
    assert (back.oldest_version, back.newest_version) == (3, 4)


def test_sample_without_reference_logprobs_round_trips_as_none():
    back = Sample.decode(make_sample(ref_logprobs=None).encode())
    assert back.ref_logprobs is None


def test_prompt_round_trip_with_messages():
    p = Prompt(prompt_id="p-9", text="2+2=", messages=[{"role": "user", "content": "2+2="}],
               metadata={"answer": "4"}, epoch=3, index=17)
    assert Prompt.decode(p.encode()) == p


def test_envelope_carries_schema_version_and_kind():
    obj = unpack(make_sample().encode())
    assert obj["schema_version"] == SCHEMA_VERSION and obj["kind"] == KIND_SAMPLE
    assert unpack(Prompt("p", "t").encode())["kind"] == KIND_PROMPT


def test_tensor_round_trip_is_little_endian_raw_bytes():
    t = encode_tensor(np.array([[1.5, -2.0]], dtype=np.float32))
    # 1.5f = 0x3FC00000 -> little-endian bytes 00 00 C0 3F
    assert t["data"][:4] == bytes([0x00, 0x00, 0xC0, 0x3F])
    assert t["shape"] == [1, 2] and t["dtype"] == "float32"
    np.testing.assert_array_equal(decode_tensor(t), [[1.5, -2.0]])
    big_endian = np.array([7], dtype=">i4")
    assert encode_tensor(big_endian)["data"] == (7).to_bytes(4, "little")


def test_rle_round_trip():
    assert rle_encode([5, 5, 5, 6, 6, 5]) == [[5, 3], [6, 2], [5, 1]]
    assert rle_decode([[5, 3], [6, 2], [5, 1]]).tolist() == [5, 5, 5, 6, 6, 5]
    assert rle_encode([]) == [] and rle_decode([]).tolist() == []


# ---------------------------------------------------------------- bad bytes


@pytest.mark.parametrize("seed", range(20))
def test_random_bytes_give_wire_error(seed):
    rng = random.Random(seed)
    data = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 300)))
    with pytest.raises(WireError):
        Sample.decode(data)


@pytest.mark.parametrize("cut", [1, 10, 50, 100, -1])
def test_truncated_record_gives_wire_error(cut):
    data = make_sample().encode()
    with pytest.raises(WireError, match="truncated|malformed"):
        Sample.decode(data[:cut])


def test_trailing_garbage_is_rejected():
    with pytest.raises(WireError, match="trailing"):
        Sample.decode(make_sample().encode() + b"\x00")


def test_empty_and_non_bytes():
    with pytest.raises(WireError, match="empty"):
        Sample.decode(b"")
    with pytest.raises(WireError, match="expected bytes"):
        Sample.decode("not bytes")  # type: ignore[arg-type]


def test_wrong_schema_version():
    data = pack(raw_sample_map(schema_version=SCHEMA_VERSION + 1))
    with pytest.raises(WireError, match=f"schema_version {SCHEMA_VERSION + 1} is not supported"):
        Sample.decode(data)
    with pytest.raises(WireError, match="no 'schema_version'"):
        decode_record(pack({"kind": "sample"}), "sample")


def test_wrong_kind():
    with pytest.raises(WireError, match="expected a record of kind sample, got kind 'prompt'"):
        Sample.decode(Prompt("p", "t").encode())


def test_not_a_map():
    with pytest.raises(WireError, match="must be a msgpack map"):
        Sample.decode(msgpack.packb([1, 2, 3]))


@pytest.mark.parametrize(
    "field", ["sample_id", "prompt_ids", "response_ids", "behaviour_logprobs", "versions", "reward", "worker_id"]
)
def test_missing_field_is_named(field):
    obj = raw_sample_map()
    del obj[field]
    with pytest.raises(WireError, match=f"missing field '{field}'"):
        Sample.decode(pack(obj))


def test_wrong_field_type_is_named():
    with pytest.raises(WireError, match="field 'reward': expected int/float, got str"):
        Sample.decode(pack(raw_sample_map(reward="high")))
    with pytest.raises(WireError, match="field 'sample_id': expected str, got bool"):
        Sample.decode(pack(raw_sample_map(sample_id=True)))


def test_wrong_dtype():
    obj = raw_sample_map(behaviour_logprobs=encode_tensor(np.array([-1.0, -1.0, -1.0], dtype=np.float64)))
    with pytest.raises(WireError, match="'behaviour_logprobs': expected dtype float32, got float64"):
        Sample.decode(pack(obj))
    obj = raw_sample_map(response_ids={"dtype": "complex64", "shape": [1], "data": b"\0" * 8})
    with pytest.raises(WireError, match="unknown dtype 'complex64'"):
        Sample.decode(pack(obj))


def test_shape_and_data_length_disagree():
    obj = raw_sample_map(response_ids={"dtype": "int32", "shape": [4], "data": b"\0" * 12})
    with pytest.raises(WireError, match=r"shape \[4\] of int32 needs 16 bytes, got 12"):
        Sample.decode(pack(obj))


def test_a_bool_in_a_shape_is_a_wire_error():
    # isinstance(True, int): the header passed and numpy's reshape raised TypeError, which the learner's
    # decode_entry (it catches WireError) let out: one such stream entry stopped its reads after every restart
    header = {"dtype": "int32", "shape": [True], "data": b"\x05\x00\x00\x00"}
    with pytest.raises(WireError, match=r"shape must be a list of non-negative ints, got \[True\]"):
        decode_tensor(header, "prompt_ids")
    with pytest.raises(WireError, match="'prompt_ids': shape must be a list of non-negative ints"):
        Sample.decode(pack(raw_sample_map(prompt_ids=header)))


def test_wrong_rank():
    obj = raw_sample_map(response_ids=encode_tensor(np.zeros((3, 1), dtype=np.int32)))
    with pytest.raises(WireError, match="expected 1 dimension"):
        Sample.decode(pack(obj))


def test_logprobs_and_versions_must_cover_every_response_token():
    obj = raw_sample_map(behaviour_logprobs=encode_tensor(np.array([-1.0, -1.0], dtype=np.float32)))
    with pytest.raises(WireError, match="2 values for 3 response tokens"):
        Sample.decode(pack(obj))
    with pytest.raises(WireError, match="runs cover 4 tokens but the response has 3"):
        Sample.decode(pack(raw_sample_map(versions=[[1, 4]])))
    with pytest.raises(WireError, match=r"\[version, count>0\]"):
        Sample.decode(pack(raw_sample_map(versions=[[1, 0], [2, 3]])))


def test_group_index_outside_group():
    with pytest.raises(WireError, match="group_index 4 is outside group_size 4"):
        Sample.decode(pack(raw_sample_map(group_index=4)))


def test_oversize_record_hits_the_configurable_cap():
    big = make_sample(response_ids=np.zeros(5000, dtype=np.int32),
                      behaviour_logprobs=np.zeros(5000, dtype=np.float32),
                      ref_logprobs=None, versions=[[0, 5000]])
    data = big.encode()
    assert Sample.decode(data).num_response_tokens == 5000
    with pytest.raises(WireError, match=f"record of {len(data)} bytes exceeds the cap of 1024 bytes"):
        Sample.decode(data, max_bytes=1024)


def test_a_record_of_nested_empty_containers_is_refused_before_it_fills_memory():
    # An empty array or map is one byte on the wire and ~60 in Python: 8 MB of them became 590 MB.
    # A record of n bytes may hold 1024 + n // 16 maps and arrays: this one of 3 + 5 + 4,096
    # bytes holds 1 + 1 + 4,096 (the envelope map, the outer array, the empty ones), more than
    # 1024 + 4104 // 16 = 1,280.
    n = 4096
    data = b"\x81\xa1a" + b"\xdd" + n.to_bytes(4, "big") + b"\x80" * n
    with pytest.raises(WireError, match=f"record of {len(data)} bytes holds more than 1280 maps and arrays"):
        wire.unpack(data)
    # a record as dense as a weight manifest (a map per tensor, ~56 bytes each) is far inside it
    manifest = {"tensors": [{"name": f"layers.{i}.mlp.experts.{i % 128}.w", "dtype": "bfloat16", "shape": [768, 2048]}
                            for i in range(20_000)]}
    assert len(wire.unpack(wire.pack(manifest))["tensors"]) == 20_000


def test_no_extension_types_accepted():
    data = msgpack.packb({"schema_version": 1, "kind": "sample", "x": msgpack.ExtType(1, b"abc")})
    with pytest.raises(WireError):
        decode_record(data, "sample")


def test_bad_prompt_messages():
    obj = unpack(Prompt("p", "t").encode())
    obj["messages"] = [{"role": "user"}]
    with pytest.raises(WireError, match="turn 0 must be a map with string 'role' and 'content'"):
        Prompt.decode(pack(obj))


def test_encode_record_roundtrip_generic_kind():
    data = encode_record("ping", {"n": 3})
    assert decode_record(data, ("pong", "ping"))["n"] == 3


# ---------------------------------------------------------------- semantic validation


def test_validate_accepts_a_good_sample():
    s = make_sample()  # largest token id 10, 3 response and 3 prompt tokens
    before = s.encode()
    assert validate_sample(s, vocab_size=11, max_response_tokens=3, max_prompt_tokens=3) is None  # every limit met exactly
    assert s.encode() == before  # checking changes nothing
    # a token sampled with probability 1 has log-prob 0; float error may put it a hair above
    validate_sample(make_sample(behaviour_logprobs=[0.0, 1e-5, -0.1]), vocab_size=11)
    # one past each limit is refused, so the limits above were the boundaries
    with pytest.raises(WireError, match=r"response_ids hold token ids outside the vocabulary \[0, 10\): min 2, max 10"):
        validate_sample(s, vocab_size=10)
    with pytest.raises(WireError, match="log-prob > 0"):
        validate_sample(make_sample(behaviour_logprobs=[0.0, 1e-3, -0.1]))


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"reward": math.nan}, "reward is not finite"),
        ({"reward_components": {"x": math.inf}}, "reward component 'x' is not finite"),
        ({"behaviour_logprobs": np.array([-0.5, 0.3, -0.1], dtype=np.float32)}, "log-prob > 0"),
        ({"behaviour_logprobs": np.array([-0.5, np.nan, -0.1], dtype=np.float32)}, "NaN or inf"),
        ({"response_ids": np.array([9, 11, 2], dtype=np.int32)}, r"outside the vocabulary \[0, 11\)"),
        ({"finish_reason": "tired"}, "finish_reason 'tired'"),
        # passed, and the learner's collate then stopped the run on it (BatchError), again after every resume
        ({"prompt_ids": np.array([], dtype=np.int32)}, "prompt is empty"),
    ],
)
def test_validate_rejects(overrides, message):
    with pytest.raises(WireError, match=message):
        validate_sample(make_sample(**overrides), vocab_size=11)


@pytest.mark.parametrize("length", [3, 200])  # short arrays are checked through a list, long ones by numpy
@pytest.mark.parametrize("bad, message", [(math.nan, "NaN or inf"), (math.inf, "NaN or inf"), (-math.inf, "NaN or inf"),
                                          (0.5, "log-prob > 0")])
@pytest.mark.parametrize("where", [0, -1])  # Python's min/max skip a NaN that comes first or last
def test_validate_finds_a_bad_log_prob_in_short_and_long_responses(length, bad, message, where):
    logp = np.full(length, -0.5, dtype=np.float32)
    logp[where] = bad
    ids = np.full(length, 3, dtype=np.int32)
    with pytest.raises(WireError, match=message):
        validate_sample(make_sample(response_ids=ids, behaviour_logprobs=logp, versions=[[0, length]]), vocab_size=11)
    if bad != 0.5:
        good = np.full(length, -0.5, dtype=np.float32)
        with pytest.raises(WireError, match="ref_logprobs contain NaN or inf"):
            validate_sample(make_sample(response_ids=ids, behaviour_logprobs=good, ref_logprobs=logp,
                                        versions=[[0, length]]), vocab_size=11)
    ids[where] = -1
    with pytest.raises(WireError, match=r"outside the vocabulary \[0, 11\): min -1, max 3"):
        validate_sample(make_sample(response_ids=ids, behaviour_logprobs=np.full(length, -0.5, dtype=np.float32),
                                    versions=[[0, length]]), vocab_size=11)


def test_validate_length_caps():
    with pytest.raises(WireError, match="response has 3 tokens, more than the configured max of 2"):
        validate_sample(make_sample(), max_response_tokens=2)
    with pytest.raises(WireError, match="prompt has 3 tokens, more than the configured max of 1"):
        validate_sample(make_sample(), max_prompt_tokens=1)


def test_no_pickle_anywhere_in_the_project():
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    offenders = []
    for pkg in ("rlhf_core", "buffer", "weight_server", "rollout_workers", "learner"):
        for dirpath, _, files in os.walk(os.path.join(root, pkg)):
            for f in files:
                if f.endswith(".py"):
                    text = open(os.path.join(dirpath, f)).read()
                    # bare eval(/exec( and pickle; method calls such as model.eval() are fine
                    if re.search(r"\bimport pickle|pickle\.loads|(?<![.\w])(eval|exec)\(", text):
                        offenders.append(f)
    assert offenders == []
