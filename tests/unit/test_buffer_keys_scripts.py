"""Key layout and the Lua scripts' names (no Redis)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from redis.crc import key_slot

from buffer import keys as K
from buffer import metrics, pacing, scripts


def test_every_key_of_a_run_is_under_its_prefix_in_one_cluster_slot():
    k = K.RunKeys.for_run("sweep/algo.max_staleness=2")
    names = k.all()
    assert len(names) == len(set(names)) == 24
    channel = k.gw_out("gateway-1")  # a pub/sub channel (not a key): named under the prefix too
    assert all(n.startswith("rlhf:{sweep/algo.max_staleness=2}:") for n in [*names, channel])
    assert {key_slot(n.encode()) for n in names} == {key_slot(b"sweep/algo.max_staleness=2")}
    assert k.pattern() == "rlhf:{sweep/algo.max_staleness=2}:*"


def test_runs_do_not_share_keys_even_when_one_id_prefixes_another():
    a, b = K.RunKeys.for_run("a"), K.RunKeys.for_run("a:b")
    assert not set(a.all()) & set(b.all())
    assert not any(re.fullmatch(a.pattern().replace("*", ".*").replace("{", r"\{").replace("}", r"\}"), n) for n in b.all())


@pytest.mark.parametrize("bad", ["", "has space", "glob*", "br{ace}", "q?", "[x]", "x" * 201, "back\\slash"])
def test_bad_run_ids_are_refused_with_the_rule(bad):
    with pytest.raises(K.BadName, match="cannot be used as a Redis key prefix"):
        K.RunKeys.for_run(bad)


def test_consumer_names():
    assert K.check_consumer("worker-3@host") == "worker-3@host"
    for bad in ("", "a b", K.RELEASED_CONSUMER):
        with pytest.raises(K.BadName):
            K.check_consumer(bad)


LUA = sorted(Path(scripts.__file__).parent.glob("*.lua"))


def test_each_script_file_is_registered_and_starts_with_flags():
    assert sorted(p.stem for p in LUA) == sorted(scripts.SCRIPT_NAMES)
    for name in scripts.SCRIPT_NAMES:
        src = scripts.source(name)
        assert src.startswith("#!lua\n") and src.count("#!lua") == 1


def test_lua_uses_only_declared_counters_and_no_hardcoded_names():
    declared = set(metrics.COUNTERS)
    for name in scripts.SCRIPT_NAMES:
        src = scripts.source(name)  # the body with the preamble (pacing's Lua included)
        used = set(re.findall(r"\bC\.(\w+)", src))
        assert used <= declared, f"{name}.lua: unknown counters {used - declared}"
        # group / consumer names come from the preamble, never as literals in a body
        for literal in (K.WORKERS_GROUP, K.LEARNER_GROUP, K.RELEASED_CONSUMER):
            assert f"'{literal}'" not in (Path(scripts.__file__).parent / f"{name}.lua").read_text(), f"{name}.lua hard-codes {literal!r}"


def test_every_script_names_its_keys_once_at_the_top():
    # KEYS[i] appears only in the `local ..._key = KEYS[i]` lines that name them, so the body
    # reads `prompts_key`, never a bare index a caller could misorder unnoticed
    for path in LUA:
        lines = path.read_text().splitlines()
        naming = [i for i, line in enumerate(lines) if "KEYS[" in line]
        assert naming, f"{path.name} names no KEYS"
        for i in naming:
            line = lines[i]
            decl = line.startswith("local ") or (i > 0 and lines[i - 1].startswith("local ") and lines[i - 1].rstrip().endswith("="))
            assert decl and "redis.call" not in line, f"{path.name}:{i + 1} uses KEYS outside the naming lines: {line.strip()}"
        names = re.findall(r"(\w+_key)\b", " ".join(lines[i] for i in naming))
        assert len(names) == len(set(names)), f"{path.name} names a key twice: {names}"


def test_preamble_counter_table_matches_metrics():
    pre = scripts.preamble()
    for name in metrics.COUNTERS:
        assert f"{name} = '{name}'" in pre
    assert f"local WORKERS = '{K.WORKERS_GROUP}'" in pre and f"local F_COUNT = '{K.F_COUNT}'" in pre


def test_preamble_carries_pacing_with_its_parameter_names():
    pre = scripts.preamble()
    assert "local function admission_budget(" in pre and "local function limiter_can_sample(" in pre
    assert "'HMGET', params_key, " + ", ".join(f"'{n}'" for n in pacing.PARAMS) in pre
    assert set(pacing.COUNTERS) <= set(metrics.COUNTERS)


def test_run_parameters_read_by_lua_are_written_by_init_run():
    from buffer.store import PARAM_NAMES

    read = set()
    for name in scripts.SCRIPT_NAMES:
        for call in re.findall(r"'HM?GET', \w+, ([^)]*)\)", scripts.source(name)):
            read.update(re.findall(r"'(\w+)'", call))
    assert set(pacing.PARAMS) <= read  # pacing's reads are seen too
    assert read and read <= set(PARAM_NAMES), read - set(PARAM_NAMES)
