"""Prompt data sets from local files: JSONL, Parquet, HF datasets on disk, and the builtin hook."""

from __future__ import annotations

import json

import pytest

from buffer import DataError, iter_prompts
from rlhf_core.config import DataConfig
from rlhf_core.records import Prompt

ROWS = [{"prompt": f"q{i}", "answer": i, "tags": ["a", "b"], "extra": {"k": i}} for i in range(6)]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def jsonl(tmp_path):
    return DataConfig(source="jsonl", path=str(_write_jsonl(tmp_path / "d.jsonl", ROWS)), seed=1)


def test_jsonl_rows_become_prompts_with_metadata(jsonl):
    prompts = list(iter_prompts(jsonl, epoch=0))
    assert sorted(p.text for p in prompts) == [f"q{i}" for i in range(6)]
    assert [p.index for p in prompts] == list(range(6)) and {p.epoch for p in prompts} == {0}
    p = next(p for p in prompts if p.text == "q2")
    assert p.prompt_id == "d.jsonl:2"
    assert p.metadata == {"answer": 2, "tags": ["a", "b"], "extra": '{"k": 2}'}  # nested -> JSON string
    assert Prompt.decode(p.encode()) == p  # everything survives the wire


def test_shuffle_is_deterministic_per_seed_and_epoch(jsonl):
    order = lambda e: [p.text for p in iter_prompts(jsonl, e)]  # noqa: E731
    assert order(0) == order(0)
    assert order(0) != order(1)
    other_seed = DataConfig(source="jsonl", path=jsonl.path, seed=2)
    assert [p.text for p in iter_prompts(other_seed, 0)] != order(0)


def test_ids_and_messages_fields(tmp_path):
    rows = [{"id": "x1", "chat": [{"role": "user", "content": "hi"}]}, {"id": 7, "chat": None, "prompt": "plain"}]
    cfg = DataConfig(source="jsonl", path=str(_write_jsonl(tmp_path / "c.jsonl", rows)), messages_field="chat")
    by_id = {p.prompt_id: p for p in iter_prompts(cfg, 0)}
    assert by_id["x1"].messages == [{"role": "user", "content": "hi"}] and by_id["x1"].text == ""
    assert by_id["7"].messages is None and by_id["7"].text == "plain"


def test_a_messages_field_is_read_without_configuration(tmp_path):
    # once: a JSONL with only `messages` failed unless data.messages_field=messages was set
    rows = [{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]},
            {"prompt": "plain", "answer": 1}]
    cfg = DataConfig(source="jsonl", path=str(_write_jsonl(tmp_path / "m.jsonl", rows)))
    by_text = {p.text: p for p in iter_prompts(cfg, 0)}
    assert by_text[""].messages == rows[0]["messages"] and by_text[""].metadata == {}
    assert by_text["plain"].messages is None and by_text["plain"].metadata == {"answer": 1}
    off = DataConfig(source="jsonl", path=cfg.path, messages_field=None)  # null: only the text field
    with pytest.raises(DataError, match="no string field 'prompt'"):
        list(iter_prompts(off, 0))


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": f"q{i}", "n": i} for i in range(4)]), path)
    cfg = DataConfig(source="parquet", path=str(path), text_field="question")
    prompts = list(iter_prompts(cfg, 3))
    assert sorted(p.text for p in prompts) == ["q0", "q1", "q2", "q3"] and {p.epoch for p in prompts} == {3}
    assert sorted(p.metadata["n"] for p in prompts) == [0, 1, 2, 3]


def test_hf_datasets_on_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": f"t{i}"} for i in range(3)])})
    ds.save_to_disk(str(tmp_path / "hf"))
    cfg = DataConfig(source="hf_disk", path=str(tmp_path / "hf"))
    assert sorted(p.text for p in iter_prompts(cfg, 0)) == ["t0", "t1", "t2"]


def test_builtin_source_uses_the_callers_function():
    made = [Prompt(f"b{i}", f"count {i}") for i in range(5)]
    cfg = DataConfig(source="builtin", seed=0)
    prompts = list(iter_prompts(cfg, 2, builtin=lambda c, e: made))
    assert sorted(p.prompt_id for p in prompts) == [f"b{i}" for i in range(5)]
    assert [p.index for p in prompts] == list(range(5)) and {p.epoch for p in prompts} == {2}
    with pytest.raises(DataError, match="pass builtin="):
        list(iter_prompts(cfg, 0))


def test_errors_name_the_file_row_and_field(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        list(iter_prompts(DataConfig(source="jsonl", path=str(tmp_path / "missing.jsonl")), 0))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{not json\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: not valid JSON"):
        list(iter_prompts(DataConfig(source="jsonl", path=str(bad)), 0))
    listed = _write_jsonl(tmp_path / "listed.jsonl", [{"prompt": "ok"}, ["a list"]])
    with pytest.raises(DataError, match=r"listed.jsonl:2: each line must be a JSON object, got list"):
        list(iter_prompts(DataConfig(source="jsonl", path=str(listed)), 0))
    empty = _write_jsonl(tmp_path / "empty.jsonl", [])
    with pytest.raises(DataError, match="empty.jsonl' has no rows"):
        list(iter_prompts(DataConfig(source="jsonl", path=str(empty)), 0))
    nofield = _write_jsonl(tmp_path / "nofield.jsonl", [{"query": "x"}])  # (question and problem are read: GSM8K, MATH)
    with pytest.raises(DataError, match=r"no string field 'prompt' \(fields: query\); set data.text_field"):
        list(iter_prompts(DataConfig(source="jsonl", path=str(nofield)), 0))


def test_bad_rows_are_refused_at_load_before_any_prompt(tmp_path):
    # once found only when the shuffled walk reached them (939 prompts produced before row 700
    # raised), so a run trained for a while, stopped, and a resume stopped again at once
    rows = [{"prompt": f"q{i}"} for i in range(1000)]
    rows[700] = {"query": "no prompt field"}
    rows[900] = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}  # OpenAI's parts
    rows[950] = {"query": "again"}
    rows[990] = {"query": "and again"}
    cfg = DataConfig(source="jsonl", path=str(_write_jsonl(tmp_path / "p.jsonl", rows)))
    it = iter_prompts(cfg, 0)
    with pytest.raises(DataError) as err:
        next(it)
    msg = str(err.value)
    assert msg.startswith("4 of the 1000 rows of ") and "p.jsonl cannot be prompts; fix or remove them (the first 3: " in msg
    assert "line 701: no string field 'prompt' (fields: query)" in msg
    assert "line 901: field 'messages' must be a list of {'role': str, 'content': str} turns" in msg
    assert "line 951: " in msg and "line 991" not in msg


@pytest.mark.parametrize("line, field, why", [
    ('{"prompt": "what is 2**100?", "answer": 1267650600228229401496703205376}', "answer",
     r"holds an integer beyond 64 bits \(1267650600228229401496703205376\), which the wire cannot carry; write it as a string"),
    ('{"prompt": "emoji \\ud83d cut"}', "prompt", r"holds a lone surrogate '\\ud83d' \(half of a \\uXXXX pair"),
    ('{"messages": [{"role": "user", "content": "\\udc00"}]}', "messages", "holds a lone surrogate"),
    ('{"prompt": "q", "steps": [1, 36893488147419103232]}', "steps", "holds an integer beyond 64 bits"),
])
def test_a_value_the_wire_cannot_carry_is_a_data_error_naming_its_field(tmp_path, line, field, why):
    # msgpack raised OverflowError / UnicodeEncodeError when the prompt was enqueued: not a user
    # error, so the learner's producer retried the same prompt for ever and the run stalled
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(DataError, match=rf"line 2: field '{field}' {why}"):
        list(iter_prompts(DataConfig(source="jsonl", path=str(path)), 0))


def test_a_jsonl_that_is_not_utf8_names_its_line(tmp_path):
    # a Latin-1 file raised UnicodeDecodeError, which the producer retried for ever
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9?"}\n')
    with pytest.raises(DataError, match=r"latin1.jsonl:2: not UTF-8 \(byte 0xe9 at byte 16 of the line\); save the file as UTF-8"):
        list(iter_prompts(DataConfig(source="jsonl", path=str(path)), 0))
