"""reward=math's rows: the usual shapes (GSM8K's question/answer, MATH's problem/solution, a
prompt with its ground_truth) load from JSONL, Parquet and save_to_disk folders with the default
data settings, and their references reach the reward; the shipped arithmetic set is what its
generator writes."""

from __future__ import annotations

import json

import pytest

from buffer import DataError, iter_prompts
from rlhf_core.config import DataConfig
from rlhf_core.data import ARITHMETIC
from rlhf_core.data.make_arithmetic import rows as arithmetic_rows
from rollout_workers.math_reward import reference_answer

SHAPES = {
    "gsm8k": [{"question": "Tom has 3 bags of 4 apples. How many apples?", "answer": "3 * 4 = 12\n#### 12"}],
    "math": [{"problem": "What is $\\frac{2}{4}$ in lowest terms?", "solution": "It is $\\boxed{\\frac{1}{2}}$."}],
    "ground_truth": [{"prompt": "2 + 2 =", "ground_truth": "4"}],
}
TEXT = {"gsm8k": "Tom has 3 bags of 4 apples. How many apples?", "math": "What is $\\frac{2}{4}$ in lowest terms?",
        "ground_truth": "2 + 2 ="}
GOLD = {"gsm8k": "12", "math": "\\frac{1}{2}", "ground_truth": "4"}


def write(kind: str, shape: str, tmp_path) -> DataConfig:
    rows = SHAPES[shape]
    if kind == "jsonl":
        path = tmp_path / f"{shape}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == "parquet":
        pa = pytest.importorskip("pyarrow")
        pq = pytest.importorskip("pyarrow.parquet")
        path = tmp_path / f"{shape}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        datasets = pytest.importorskip("datasets")
        path = tmp_path / f"{shape}_hf"
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return DataConfig(source=kind, path=str(path))


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("kind", ["jsonl", "parquet", "hf_disk"])
def test_each_shape_loads_with_the_default_settings_and_its_reference_is_read(kind, shape, tmp_path):
    (prompt,) = list(iter_prompts(write(kind, shape, tmp_path), epoch=0))
    assert prompt.text == TEXT[shape]
    assert not {"question", "problem", "prompt"} & set(prompt.metadata)  # the prompt's field is not a column too
    # what the math reward reads: the first of ground_truth, answer, solution the row has
    reference = next(reference_answer(prompt.metadata[f]) for f in ("ground_truth", "answer", "solution") if f in prompt.metadata)
    assert reference == GOLD[shape]


def test_a_row_with_none_of_the_fields_still_says_which_to_set(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps({"query": "hi", "label": 1}) + "\n")
    with pytest.raises(DataError, match="no string field 'prompt' .*set data.text_field"):
        list(iter_prompts(DataConfig(source="jsonl", path=str(path)), 0))


def test_an_explicit_text_field_is_never_replaced(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps({"question": "q", "body": "b"}) + "\n")
    (p,) = list(iter_prompts(DataConfig(source="jsonl", path=str(path), text_field="body"), 0))
    assert p.text == "b" and p.metadata == {"question": "q"}


def test_the_shipped_arithmetic_set_is_its_generators_output_and_every_answer_is_read():
    lines = ARITHMETIC.read_text().splitlines()
    assert [json.loads(line) for line in lines] == arithmetic_rows(200, 0)  # regenerate it with python -m rlhf_core.data.make_arithmetic
    prompts = list(iter_prompts(DataConfig(source="jsonl", path=str(ARITHMETIC)), 0))
    assert len(prompts) == 200 and len({p.prompt_id for p in prompts}) == 200
    answers = [reference_answer(p.metadata["answer"]) for p in prompts]
    assert all(a is not None and a.lstrip("-").isdigit() for a in answers)
    assert any(int(a) >= 1000 for a in answers if a)  # so a response may write 1,000 for 1000


def test_the_worked_answer_of_each_row_is_right():
    # each row's working ends in the line `#### n`, and n is the last number of its working
    for row in arithmetic_rows(200, 0):
        work, gold = row["answer"].rsplit("\n#### ", 1)
        assert work.rstrip(".").split()[-1] == gold
