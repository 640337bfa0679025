"""Control state another client corrupted: every reader stops with CorruptStateError naming the
key (no Lua arithmetic on nil, no traceback loop), and the processes' entry points turn it into
one clear line and a non-zero exit."""

from __future__ import annotations

import pytest

import factories as T
from buffer import CorruptStateError
from buffer_clients import Clients
from rlhf_core.config import BufferConfig
from rlhf_core.records import Prompt

pytestmark = pytest.mark.integration


@pytest.fixture
def buf(redis_url):
    b = Clients.connect(redis_url, "corrupt", BufferConfig(lease_timeout_s=5.0))
    b.learner.init_run(batch_size=4, group_size=4, max_staleness=2, max_response_tokens=16, vocab_size=100)
    b.producer.enqueue_prompts(T.prompts(2))
    yield b
    b.close()


def _fill(b: Clients) -> int:
    return b.producer.fill_prompts(lambda epoch: iter([Prompt(f"q{epoch}-{i}", "x") for i in range(8)]), epochs=2, low_watermark=100)


# (what another client did, the call that reads it, what the error names)
CASES = {
    "counter not a number": (lambda b: b.redis.hset(b.keys.counters, "admitted", "abc"),
                             lambda b: b.worker.claim("w", 1), ["counters admitted holds", "'abc'"]),
    "version not a number": (lambda b: b.redis.set(b.keys.version, "v7"),
                             lambda b: b.worker.claim("w", 1), ["version", "'v7'"]),
    "updates not a number": (lambda b: b.redis.set(b.keys.updates, "u7"),
                             lambda b: b.worker.claim("w", 1), ["updates", "'u7'"]),
    "wake stream replaced by a string": (lambda b: (b.redis.delete(b.keys.wake_prompts), b.redis.set(b.keys.wake_prompts, "x")),
                                         lambda b: b.learner.set_learner_version(1), ["WRONGTYPE", "wake:prompts"]),
    "fill cursor not a number": (lambda b: b.redis.hset(b.keys.fill, mapping={"epoch": 0, "index": "abc"}),
                                 _fill, ["fill index holds 'abc'"]),
    "histogram field not a number": (lambda b: b.redis.hset(b.keys.hist_consumed, "abc", "xyz"),
                                     lambda b: b.monitor.metrics(), ["hist:consumed", "'abc'"]),
    "counters hash replaced by a list": (lambda b: (b.redis.delete(b.keys.counters), b.redis.rpush(b.keys.counters, "x")),
                                         lambda b: b.monitor.metrics(), ["WRONGTYPE", "counters"]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_corrupt_control_state_names_the_key_and_stops(buf, name):
    corrupt, read, words = CASES[name]
    read(buf)  # fine before
    corrupt(buf)
    with pytest.raises(CorruptStateError) as err:
        read(buf)
    message = str(err.value)
    assert all(w in message for w in words), message
    assert "another client" in message.lower() and "acl" in message.lower()
