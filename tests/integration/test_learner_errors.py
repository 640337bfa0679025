"""Errors a user can cause, as ``rlhf-learner`` (``python -m learner``) shows them: exit code 2
and one line ``error: <what was wrong and what to do>`` on stderr, no traceback.

The tokenizer cases run against a real redis-server and weight server; this test plays a worker
whose tokenizer does not match the learner's model, through the buffer API a worker uses
(``claim`` + ``complete``), so its samples reach the buffer exactly as a real worker's would.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from buffer_clients import Clients
from factories import LogSeen
from rlhf_core.config import ModelConfig, WeightServerConfig
from rlhf_core.errors import STOPPED_EARLY_EXIT
from rlhf_core.records import Sample, rle_encode

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

GROUP = 4
VOCAB = 99  # the tiny model
EOS = 2  # the tiny tokenizer's end of sequence; 3 is <unk>
NOWHERE = ["buffer.url=redis://127.0.0.1:1/0", "buffer.run_id=errors", "weight_server.address=tcp://127.0.0.1:1"]


def learner(args: list[str], tmp: Path, timeout: float = 90) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "learner", *args, f"hydra.run.dir={tmp / 'hydra'}", "hydra.output_subdir=null"]
    return subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)


def one_clear_line(proc: subprocess.CompletedProcess) -> str:
    """The single ``error:`` line of a learner that stopped on a user error."""
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


def test_batch_size_not_divisible_by_group_size(tmp_path):
    line = one_clear_line(learner([*NOWHERE, "learner.batch_size=10", "algo.group_size=4"], tmp_path))
    assert line == ("error: learner.batch_size 10 is not divisible by algo.group_size 4; groups are kept whole, "
                    "so use a multiple such as 8")


def test_a_tokenizer_that_does_not_fit_the_model(tmp_path, model_cache):
    from rlhf_core.models import load_tokenizer

    tok = load_tokenizer(ModelConfig(cache_dir=str(model_cache)))
    tok.add_tokens([f"<extra{i}>" for i in range(5)])  # 104 tokens for a model of 99
    tok.save_pretrained(tmp_path / "tok")
    args = [*NOWHERE, f"model.cache_dir={model_cache}", f"model.tokenizer_path={tmp_path / 'tok'}"]
    line = one_clear_line(learner(args, tmp_path))
    assert f"the tokenizer ({VOCAB + 5} tokens;" in line and f"does not fit the model's vocabulary of {VOCAB}" in line
    assert "model.tokenizer_path must name the tokenizer the model was trained with" in line


# ------------------------------------------------------------------ worker samples from another tokenizer
@pytest.fixture
def servers(redis_url):
    from weight_server import WeightServer

    ws = WeightServer(WeightServerConfig()).start()
    yield redis_url, ws
    ws.stop()


def start_learner(tmp: Path, redis_url: str, ws, cache: Path, run_id: str, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "learner", f"buffer.url={redis_url}", f"buffer.run_id={run_id}",
           f"weight_server.address={ws.address}", f"weight_server.pub_address={ws.pub_address}",
           f"model.cache_dir={cache}", "learner.batch_size=8", "learner.micro_batch_size=8", f"algo.group_size={GROUP}",
           "rollout.max_new_tokens=8", f"run.output_dir={tmp / 'out'}", f"hydra.run.dir={tmp / 'hydra'}",
           "hydra.output_subdir=null", *extra]
    return subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def play_worker(buf: Clients, tokenizer, response_ids: list[int], finish_reason: str, groups: int = 2) -> None:
    """Claim ``groups`` prompts the learner enqueued and complete each with GROUP samples."""
    deadline = time.monotonic() + 60
    while not buf.store.initialised():
        assert time.monotonic() < deadline, "the learner never initialised the run"
        time.sleep(0.05)
    done = 0
    while done < groups:
        assert time.monotonic() < deadline, f"only {done} of {groups} prompts claimed"
        for lease in buf.worker.claim("bad-worker", groups - done, block_s=1.0):
            gid = f"{lease.prompt.prompt_id}:{lease.lease_id}"
            n = len(response_ids)
            group = [Sample(sample_id=f"{gid}/{i}", prompt_id=lease.prompt.prompt_id, group_id=gid,
                            prompt_ids=np.asarray(tokenizer(lease.prompt.text)["input_ids"], dtype=np.int32),
                            response_ids=np.asarray(response_ids, dtype=np.int32),
                            behaviour_logprobs=np.full(n, -1.0, dtype=np.float32), versions=rle_encode([0] * n),
                            reward=float(i), finish_reason=finish_reason, worker_id="bad-worker", group_size=GROUP,
                            group_index=i)
                     for i in range(GROUP)]
            buf.worker.complete(lease, group)
            done += 1


def wait_for_version(buf: Clients, proc: subprocess.Popen, version: int) -> None:
    wait = time.monotonic() + 60
    while buf.learner.learner_version() < version and time.monotonic() < wait:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.1)
    assert buf.learner.learner_version() >= version


def run_with_bad_worker(tmp, servers, model_cache, run_id, response_ids, finish_reason):
    from rlhf_core.models import load_tokenizer

    redis_url, ws = servers
    proc = start_learner(tmp, redis_url, ws, model_cache, run_id)
    buf = Clients.connect(redis_url, run_id)
    try:
        play_worker(buf, load_tokenizer(ModelConfig(cache_dir=str(model_cache))), response_ids, finish_reason)
        out, err = proc.communicate(timeout=60)
        counters = buf.monitor.metrics()["counters"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        buf.close()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), counters


def test_samples_with_token_ids_beyond_the_vocabulary_stop_the_learner_with_a_clear_error(tmp_path, servers,
                                                                                          model_cache):
    """The buffer dead-letters them (the run's vocabulary is the learner's), so no batch can ever
    form: the learner says why instead of waiting for ever."""
    proc, counters = run_with_bad_worker(tmp_path, servers, model_cache, "vocab", [150, 40, EOS], "stop")
    line = one_clear_line(proc)
    assert counters["samples_dead_lettered"] == 2 * GROUP and counters["samples_appended"] == 0
    assert "the last 8 samples from worker(s) bad-worker were dead-lettered by the buffer" in line
    assert f"response_ids hold token ids outside the vocabulary [0, {VOCAB}): min 2, max 150" in line
    assert f"The learner's model has {VOCAB} tokens, so the workers tokenize with another tokenizer" in line
    assert "point model.path / model.tokenizer_path of workers and learner at the same model" in line


def test_samples_with_other_special_tokens_stop_the_learner_with_a_clear_error(tmp_path, servers, model_cache):
    """In range, so the buffer takes them; but they stopped on <unk> (3), which is no end of
    sequence of the learner's tokenizer: a worker whose tokenizer has other special tokens."""
    proc, counters = run_with_bad_worker(tmp_path, servers, model_cache, "specials", [40, 41, 3], "stop")
    line = one_clear_line(proc)
    assert counters["samples_appended"] == 2 * GROUP and counters["samples_consumed"] == 0  # not trained, not acked
    assert f"does not fit the learner's end-of-sequence token ids [{EOS}]: it finished with 'stop' on token 3" in line
    assert "from worker bad-worker" in line
    assert "point model.path / model.tokenizer_path of workers and learner at the same tokenizer" in line
    assert "start a new run (buffer.run_id): this batch stays in the buffer" in line


# ------------------------------------------------------------------ bad prompt data
@pytest.mark.parametrize("content, words", [
    ('{"prompt": "fine"}\n{"prompt": "fine too"\n', ["prompts.jsonl:2: not valid JSON"]),
    (None, ["prompts.jsonl' does not exist"]),
], ids=["malformed line", "missing file"])
def test_bad_prompt_data_stops_the_learner_with_the_first_error(tmp_path, servers, model_cache, content, words):
    """The prompt producer once logged the error and looped on a dead iterator for ever: a bad
    row after a good one, and a file that is not there. The other data errors' messages are
    tests/unit/test_buffer_datasets.py's; they take the same path out of the producer."""
    data = tmp_path / "prompts.jsonl"
    if content is not None:
        data.write_text(content)
    redis_url, ws = servers
    args = [f"buffer.url={redis_url}", f"buffer.run_id=data{abs(hash(content)) % 10**6}", f"weight_server.address={ws.address}",
            f"weight_server.pub_address={ws.pub_address}", f"model.cache_dir={model_cache}", "data=jsonl",
            f"data.path={data}", f"run.output_dir={tmp_path / 'out'}"]
    line = one_clear_line(learner(args, tmp_path, timeout=90))
    assert all(w in line for w in words), line


@pytest.mark.parametrize("mode, settings, updates", [
    ("fifo", [], 2),  # 4 prompts x 1 epoch x 4 samples = 2 batches of 8
    # each group trained twice (drawn ones come back once committed); the played samples are all of
    # version 0, so a staleness bound above the 4 updates keeps them
    ("replay", ["buffer.max_reuse=2", "algo.max_staleness=8"], 4),
])
def test_a_learner_whose_data_is_used_up_stops_and_says_so(tmp_path, servers, model_cache, mode, settings, updates):
    """learner.max_updates 10 is never reached: the learner waited for batches that could never
    come, for ever (rlhf-run then never ended: no export, no summary). Now it ends cleanly (exit
    0, which rlhf-run takes for a finished run) with stopped_by "data" in its last stats."""
    from rlhf_core.metric_names import STOPPED_BY
    from rlhf_core.models import load_tokenizer

    redis_url, ws = servers
    run_id = f"used-up-{mode}"
    proc = start_learner(tmp_path, redis_url, ws, model_cache, run_id, "data.num_prompts=4", "data.epochs=1",
                         "learner.max_updates=10", "learner.checkpoint_every=100", *settings)
    buf = Clients.connect(redis_url, run_id)
    try:
        play_worker(buf, load_tokenizer(ModelConfig(cache_dir=str(model_cache))), [40, 41, EOS], "stop", groups=4)
        out, err = proc.communicate(timeout=90)
        assert proc.returncode == 0, err[-3000:]
        assert f"every prompt of data.epochs=1 is trained on (what is left makes no batch): stopping after {updates} " \
               "updates (learner.max_updates=10)" in out + err
        assert buf.learner.learner_version() == updates and buf.monitor.stats("learner")[STOPPED_BY] == "data"
        assert buf.monitor.metrics()["counters"]["samples_consumed"] == 8 * updates
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        buf.close()


def test_a_metrics_file_the_disk_cannot_hold_stops_the_learner_with_one_line(tmp_path, servers, model_cache):
    """metrics.jsonl on a full disk (/dev/full answers every write with ENOSPC, as a full disk
    does) ended the learner with a traceback, exit 1, and rlhf-run restarted it into the same
    disk. Now: one line naming the file and the room left, exit 2, which rlhf-run never restarts."""
    (tmp_path / "out").mkdir()
    metrics = tmp_path / "out" / "metrics.jsonl"
    metrics.symlink_to("/dev/full")
    redis_url, ws = servers
    proc = start_learner(tmp_path, redis_url, ws, model_cache, "full-disk", "learner.checkpoint_every=100")
    buf = Clients.connect(redis_url, "full-disk")
    try:
        play_worker(buf, lambda text: {"input_ids": [40, 41, 42]}, [40, 41, EOS], "stop")  # any prompt ids will do
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        buf.close()
    line = one_clear_line(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    assert line.startswith(f"error: cannot write {metrics} (No space left on device); ") and " MiB free on its disk: " in line
    assert line.endswith("make room there (or move the run's output to a larger disk), then continue the run: "
                         "rlhf-run resume=<its output folder>")


def test_the_prompt_producer_ends_on_an_error_and_tries_again_only_while_redis_is_unreachable(redis_server):
    """A prompt that cannot be produced (here a source with a bug; once a row msgpack could not
    encode or a file that was not UTF-8) was logged and tried again every 100 ms for ever: the
    cursor stays before it, so nothing was ever enqueued again and the run stalled without a
    word. Only Redis unreachable past buffer.max_retry_s may come back; that alone is retried."""
    from learner.prompts import produce_prompts
    from rlhf_core.config import BufferConfig, Config
    from rlhf_core.records import Prompt

    cfg = Config()
    cfg.learner.batch_size, cfg.algo.group_size, cfg.data.epochs = 8, GROUP, 1
    buf = Clients.connect(redis_server.url, "producer", BufferConfig(max_retry_s=0.3))
    buf.learner.init_run(batch_size=8, group_size=GROUP, max_staleness=0)
    stop = threading.Event()
    calls = []

    def broken(epoch: int):
        calls.append(epoch)
        raise RuntimeError("a bug in the prompt source")
        yield  # a generator, as iter_prompts is

    raised = []

    def produce() -> None:
        try:
            produce_prompts(buf.producer, cfg, stop, broken)
        except RuntimeError as exc:
            raised.append(exc)

    t = threading.Thread(target=produce, daemon=True)
    t.start()
    t.join(30)
    stop.set()
    assert raised and calls == [0], f"the producer tried the broken source {len(calls)} times and went on"

    retried = LogSeen("trying again")
    logging.getLogger("learner.prompts").addHandler(retried)
    try:
        redis_server.stop()  # SIGTERM: Redis writes its data, and comes back with it on the same port
        t = threading.Thread(target=produce_prompts, args=(buf.producer, cfg, threading.Event(),
                                                           lambda e: (Prompt(f"p{i}", "q") for i in range(5))), daemon=True)
        t.start()
        assert retried.event.wait(30), "the producer gave up on an unreachable Redis"
        redis_server.start(port=redis_server.port)
        t.join(30)
        assert not t.is_alive() and buf.producer.fill_state()["done"]
        assert buf.monitor.metrics()["counters"]["prompts_enqueued"] == 5
    finally:
        logging.getLogger("learner.prompts").removeHandler(retried)
        buf.close()


def test_a_few_samples_with_other_special_tokens_are_dead_lettered_and_training_goes_on(tmp_path, servers, model_cache):
    """One group of four stopping on <unk> among good groups: those samples become dead letters
    (once, a single such record crash-looped the learner: re-delivered after every restart); the
    rest trains. Then a whole batch of them (12 of the last 24 samples: not most, so not the
    tokenizers differing): discarded, its admission back (acked as trained, it kept a batch of
    room for good), and training goes on."""
    from rlhf_core.models import load_tokenizer

    redis_url, ws = servers
    proc = start_learner(tmp_path, redis_url, ws, model_cache, "few-misfits")
    buf = Clients.connect(redis_url, "few-misfits")
    tok = load_tokenizer(ModelConfig(cache_dir=str(model_cache)))
    try:
        play_worker(buf, tok, [40, 41, 3], "stop", groups=1)        # 4 misfits ...
        play_worker(buf, tok, [40, 41, EOS], "stop", groups=3)      # ... and 12 good samples: two batches of 8
        wait_for_version(buf, proc, 2)
        dead = buf.monitor.dead_letters()
        assert len(dead) == GROUP and all("finished with 'stop' on token 3" in d["reason"] for d in dead), dead
        play_worker(buf, tok, [40, 41, 3], "stop", groups=2)        # a batch of misfits only ...
        play_worker(buf, tok, [40, 41, EOS], "stop", groups=2)      # ... then a good one
        wait_for_version(buf, proc, 3)
        assert len(buf.monitor.dead_letters()) == 3 * GROUP
        assert buf.monitor.metrics()["counters"]["budget_returned"] == 2 * GROUP
        assert proc.poll() is None  # still training
        # stopped by a signal long before its 1,200 updates: not exit 0, which rlhf-run took for a
        # finished run (and deleted its Redis data)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == STOPPED_EARLY_EXIT, proc.communicate()[1][-3000:]
    finally:
        proc.kill()
        proc.wait()
        buf.close()
