"""reward=code_tests without running anything: where a response's program is, the shapes a row's
tests come in, how a run's result is judged, and the sandbox settings a reward node passes."""

from __future__ import annotations

import json

import pytest

from rlhf_core.choices import CodeExtract, SandboxBackend
from rlhf_core.config import ConfigError
from rlhf_core.config.sandbox import SandboxConfig
from rollout_workers.code_reward import CodeTest, extract_program, judge, parse_tests, plan
from rollout_workers.sandbox import SandboxResult, SandboxStatus


def result(status=SandboxStatus.ok, stdout="", code=0) -> SandboxResult:
    return SandboxResult(status, code, stdout, "", 0.1)


# ---------------------------------------------------------------------------- programs


def test_the_last_python_block_is_the_program():
    text = "First try:\n```python\nprint(1)\n```\nBetter:\n```py\nprint(2)\n```\nand a shell line:\n```bash\nls\n```\n"
    assert extract_program(text) == "print(2)\n"  # the bash block is no program
    assert extract_program("```\nprint(3)\n```") == "print(3)\n"  # an unlabelled fence counts


def test_without_a_block_auto_takes_the_whole_response_and_fenced_takes_nothing():
    assert extract_program("print(4)") == "print(4)"
    assert extract_program("print(4)", CodeExtract.fenced) is None
    assert extract_program("```python\nprint(5)\n```", CodeExtract.whole) == "```python\nprint(5)\n```"
    assert extract_program("   \n") is None


# ---------------------------------------------------------------------------- tests


def test_the_shapes_of_a_rows_tests():
    pairs = [CodeTest(stdin="1 2\n", expected="3\n"), CodeTest(stdin="", expected="0")]
    assert parse_tests([{"input": "1 2\n", "output": "3\n"}, {"output": "0"}]) == pairs
    assert parse_tests(json.dumps([{"input": "1 2\n", "output": "3\n"}, {"output": "0"}])) == pairs  # a nested column
    assert parse_tests({"inputs": ["1 2\n", ""], "outputs": ["3\n", "0"]}) == pairs  # APPS / TACO
    assert parse_tests(json.dumps({"inputs": [["a", "b"]], "outputs": [["c"]]})) == [CodeTest(stdin="a\nb", expected="c")]
    assert parse_tests(["assert f(1) == 2", "assert f(2) == 3"]) == [CodeTest(assertion="assert f(1) == 2"),
                                                                    CodeTest(assertion="assert f(2) == 3")]  # MBPP
    assert parse_tests("assert f(1) == 2") == [CodeTest(assertion="assert f(1) == 2")]


@pytest.mark.parametrize(("value", "says"), [
    ({"inputs": ["1"], "outputs": []}, "one length"),
    (7, "must be a list"),
    ([{"input": "1"}], "a test must be"),
])
def test_tests_that_cannot_be_read_say_why(value, says):
    with pytest.raises(ValueError, match=says):
        parse_tests(value)


def test_judging_stdin_stdout_tests():
    test = CodeTest(stdin="", expected="3\n4")
    assert judge(test, result(stdout="3   \n4\n\n")) == "passed"  # trailing spaces and blank lines do not matter
    assert judge(test, result(stdout="3\n5\n")) == "wrong_output"
    assert judge(test, result(SandboxStatus.timeout, stdout="3\n4", code=None)) == "timeout"  # the output is not enough


def test_an_assert_test_passes_only_with_its_token_as_the_last_line():
    (run,) = plan("def f(x):\n    return x + 1", [CodeTest(assertion="assert f(1) == 2")])
    assert run.source.startswith("def f(x):") and "assert f(1) == 2" in run.source
    assert run.source.rstrip().endswith(f"print({run.token!r})")
    assert judge(run.test, result(stdout=f"noise\n{run.token}\n"), run.token) == "passed"
    assert judge(run.test, result(stdout=""), run.token) == "wrong_output"  # exited 0 before the assert ran
    other = plan("pass", [CodeTest(assertion="assert True")])[0].token
    assert other != run.token  # each run its own token


# ---------------------------------------------------------------------------- settings


def test_sandbox_settings_from_a_reward_node():
    assert SandboxConfig.of(None) == SandboxConfig()
    cfg = SandboxConfig.of({"backend": "none", "wall_s": 2.5})
    assert cfg.backend == SandboxBackend.none and cfg.wall_s == 2.5
    with pytest.raises(ConfigError, match="walls is no sandbox setting"):
        SandboxConfig.of({"walls": 1})
    with pytest.raises(ConfigError, match="sandbox.backend='docker' is not one of bwrap, none"):
        SandboxConfig.of({"backend": "docker"})
    with pytest.raises(ConfigError, match="sandbox.memory_mb=0"):
        SandboxConfig.of({"memory_mb": 0})
    with pytest.raises(ConfigError, match="must be an absolute path"):
        SandboxConfig.of({"python": "python3"})
