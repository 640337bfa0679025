"""Every YAML file under conf/ composes through the real entry points' config names, and
derived settings are validated once with errors that name the numbers."""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from rlhf_core.config import Config, ConfigError, register_configs, to_object, validate

CONF = Path(__file__).resolve().parents[2] / "conf"
SCRIPTS = ("rlhf-run", "rlhf-worker", "rlhf-learner", "rlhf-weight-server", "rlhf-monitor")


def entry_config_names() -> dict[str, str]:
    eps = {ep.name: ep for ep in entry_points(group="console_scripts") if ep.name in SCRIPTS}
    assert sorted(eps) == sorted(SCRIPTS), "console scripts missing: is the project installed (pip install -e .)?"
    return {name: ep.load().config_name for name, ep in eps.items()}


def compose_cfg(config_name: str, overrides: list[str] = ()):
    register_configs()
    with initialize_config_module(config_module="conf", version_base="1.3"):
        return compose(config_name=config_name, overrides=list(overrides))


def group_options() -> list[tuple[str, str]]:
    """(group, option) for every YAML file in a group folder, found recursively."""
    found = []
    for path in sorted(CONF.rglob("*.yaml")):
        rel = path.relative_to(CONF)
        if len(rel.parts) > 1:
            found.append(("/".join(rel.parts[:-1]), rel.stem))
    return found


def primary_configs() -> list[str]:
    return sorted(p.stem for p in CONF.glob("*.yaml"))


def test_every_primary_config_is_an_entry_point_config():
    names = entry_config_names()
    assert set(names.values()) == set(primary_configs())
    assert names["rlhf-run"] == names["rlhf-worker"] == names["rlhf-learner"] == names["rlhf-weight-server"] == "config"
    assert names["rlhf-monitor"] == "monitor"


@pytest.mark.parametrize("group, option", group_options())
def test_group_option_composes(group, option):
    for config_name in set(entry_config_names().values()) - {"monitor"}:
        cfg = compose_cfg(config_name, [f"{group}={option}"])
        assert isinstance(OmegaConf.to_container(cfg, resolve=False), dict)
        # A file with ??? values: start-up refuses it and names the key. (Composed into an
        # Optional field of the schema, ??? arrives as None, so validate() checks each one.)
        required = [line.split(":")[0].strip() for line in (CONF / group / f"{option}.yaml").read_text().splitlines()
                    if line.split("#")[0].strip().endswith(": ???")]
        if (group, option) == ("weight_server", "curve"):  # each process needs its own keys: refused where used
            validate(cfg)
            _check_curve_keys_refused(to_object(cfg).weight_server)
        elif _has_missing(cfg) or required:
            with pytest.raises(ConfigError, match="required setting .* has no value|needs") as err:
                validate(cfg)
            assert all(f".{key}" in str(err.value) for key in required), (required, str(err.value))
        else:
            validate(cfg)
        if required and group in ("model", "data"):  # given a value, it starts
            validate(compose_cfg(config_name, [f"{group}={option}"] + [f"{group}.{k}=/some/where" for k in required]))


def _check_curve_keys_refused(ws) -> None:
    """The CURVE keys the file leaves as ???: the server refuses to bind, a client to connect."""
    import zmq

    from weight_server.auth import configure_client_socket, configure_server_socket
    from weight_server.sockets import Context

    with Context() as ctx:  # closes the sockets, whatever is raised
        for configure in (configure_server_socket, configure_client_socket):
            with pytest.raises(ConfigError, match="weight_server.curve_"):
                configure(ctx.socket(zmq.DEALER), ws)


def _has_missing(cfg) -> bool:
    from omegaconf.errors import MissingMandatoryValue

    try:
        OmegaConf.to_container(cfg, throw_on_missing=True)
    except MissingMandatoryValue:
        return True
    return False


def test_default_config_is_typed_and_valid():
    cfg = compose_cfg("config")
    obj = to_object(cfg)
    assert isinstance(obj, Config)
    assert obj.model.name == "tiny" and obj.algo.estimator == "grpo"
    validate(obj)


def test_monitor_config_requires_url():
    cfg = compose_cfg("monitor", ["run_id=r1"])
    assert OmegaConf.is_missing(cfg, "url")
    cfg = compose_cfg("monitor", ["url=redis://127.0.0.1:6379"])
    assert cfg.url == "redis://127.0.0.1:6379"


# algo.vf_coef is gone: the critic has its own AdamW (invariant to its loss's scale) and clipping, so
# it did nothing (learner.critic_lr is the knob); a run that sets it is told, not silently ignored
@pytest.mark.parametrize("key", ["nonsense", "vf_coef"])
def test_unknown_key_is_refused_at_composition(key):
    with pytest.raises(Exception, match=f"algo.{key}|{key}"):
        compose_cfg("config", ["algo=ppo", f"algo.{key}=1"])


# Hydra answers `learner.max_update=5` with "To append to your config use +learner.max_update=5",
# which it then accepts: the run trained its 1,200 default updates and ignored the setting
@pytest.mark.parametrize("override, message", [
    ("+learner.max_update=5", r"learner.max_update is not a setting \(did you mean learner.max_updates\?\)"),
    ("+nonsense=1", r"nonsense is not a setting; .*--help"),
])
def test_a_key_added_with_plus_outside_a_free_form_dict_is_refused(override, message):
    with pytest.raises(ConfigError, match=message):
        to_object(compose_cfg("config", [override]))


def test_keys_added_with_plus_to_free_form_dicts_still_work():
    cfg = to_object(compose_cfg("config", ["+reward.functions.mine._target_=my_pkg.score", "+rollout.env.tries=6",
                                           "+ray.worker.resources.rollout=1"]))
    assert cfg.reward.functions["mine"]["_target_"] == "my_pkg.score" and cfg.rollout.env["tries"] == 6


def test_wrong_type_is_refused_at_composition():
    with pytest.raises(Exception, match="group_size"):
        compose_cfg("config", ["algo.group_size=four"])


def choice_fields(node=Config, prefix=""):
    """(key, Enum) of every choice in the schema, found by walking its dataclasses' field types."""
    import dataclasses
    import typing
    from enum import Enum

    for f in dataclasses.fields(node):
        kind = typing.get_type_hints(node)[f.name]
        args = [a for a in typing.get_args(kind) if a is not type(None)] or [kind]
        if dataclasses.is_dataclass(kind):
            yield from choice_fields(kind, f"{prefix}{f.name}.")
        elif isinstance(args[0], type) and issubclass(args[0], Enum):
            yield f"{prefix}{f.name}", args[0]
        elif typing.get_origin(kind) is list and issubclass(typing.get_args(kind)[0], Enum):
            yield f"{prefix}{f.name}", typing.get_args(kind)[0]


def test_every_choice_is_an_enum():
    # the schema holds no free string whose values are a fixed set: those are Enums (rlhf_core.choices)
    keys = {key for key, _ in choice_fields()}
    assert {"algo.estimator", "algo.agg_mode", "model.dtype", "rollout.engine", "learner.engine", "weight_server.auth",
            "weight_server.shm", "data.source", "eval.data.source", "reward.empty_response", "run.loggers",
            "run.wandb_mode", "launcher", "ray.learner.strategy", "ray.worker.strategy"} <= keys


@pytest.mark.parametrize("key, choices", list(choice_fields()), ids=lambda x: x if isinstance(x, str) else "")
def test_a_value_that_is_no_choice_is_refused_at_composition_naming_the_key_and_the_choices(key, choices):
    value = "[nonsense]" if key == "run.loggers" else "nonsense"
    with pytest.raises(Exception) as err:
        compose_cfg("config", [f"{key}={value}"])
    said = f"{err.value}\n{err.value.__cause__}"
    if key == "launcher":  # also a config group: Hydra lists its files, one per choice
        assert "Available options in 'launcher':\n\tlocal\n\tray\n" in said, said
        return
    assert f"Invalid value 'nonsense', expected one of [{', '.join(c.name for c in choices)}]" in said, said
    assert f"full_key: {key}" in said, said


def test_a_choice_given_as_its_name_composes_to_its_member():
    cfg = to_object(compose_cfg("config", ["algo.agg_mode=seq-mean-token-sum", "run.loggers=[wandb]", "launcher=ray"]))
    assert cfg.algo.agg_mode == "seq-mean-token-sum" and cfg.run.loggers == ["wandb"] and cfg.launcher == "ray"
    assert type(cfg.launcher).__name__ == "Launcher"


def test_a_bad_choice_on_the_command_line_says_the_key_and_the_choices():
    import subprocess
    import sys

    exe = Path(sys.executable).with_name("rlhf-run")
    out = subprocess.run([str(exe), "rollout.engine=vlm"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "Error merging override rollout.engine=vlm" in out.stderr
    assert "Invalid value 'vlm', expected one of [hf, vllm]" in out.stderr


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["learner.batch_size=30", "algo.group_size=4"], "learner.batch_size 30 is not divisible by algo.group_size 4"),
        (["learner.batch_size=32", "learner.num_minibatches=3", "learner.micro_batch_size=2"],
         "learner.batch_size 32 is not divisible by learner.num_minibatches 3"),
        (["learner.micro_batch_size=64"], "learner.micro_batch_size 64 must be between 1 and the minibatch size 32"),
        # once a ZeroDivisionError (batch_size % 0), and a batch of 0 blamed micro_batch_size
        (["learner.num_minibatches=0"], r"learner.num_minibatches must be >= 1 \(optimizer steps per epoch\), got 0"),
        (["learner.batch_size=0"], r"learner.batch_size must be >= 1 \(samples per update\), got 0"),
        # 0 checkpointed after every update (the learner's max(1, 0)) and meant 'never' to rlhf-plan
        (["learner.checkpoint_every=0"], "learner.checkpoint_every must be >= 1 update, got 0: a checkpoint is where"),
        # zero_stage was checked only when the DeepSpeed engine was built; adam_betas of the wrong length at the first step
        (["learner.engine=deepspeed", "learner.zero_stage=4"], "learner.zero_stage must be 1, 2 or 3 \\(DeepSpeed's ZeRO stages\\), got 4"),
        (["learner.adam_betas=[0.9]"], r"learner.adam_betas must be two numbers in \[0, 1\) and learner.adam_eps > 0, got \[0.9\], 1e-08"),
        (["learner.adam_betas=[0.9,1.0]"], r"learner.adam_betas must be two numbers in \[0, 1\)"),
        (["learner.adam_eps=0"], r"learner.adam_betas must be two numbers in \[0, 1\) and learner.adam_eps > 0, got \[0.9, 0.999\], 0.0"),
        (["algo.group_size=1"], "algo.estimator=grpo compares responses of one prompt"),
        (["algo.max_staleness=-1"], "algo.max_staleness must be >= 0, got -1"),
        # passed validate, then value_loss raised at the first update / V-trace did nothing but force a pi_prox pass /
        # a negative KL coefficient rewarded drifting from the reference (kl_mode=reward: raised at the first update)
        (["algo.estimator=gae", "algo.value_clip=0"], r"algo.value_clip must be > 0 \(or null: no clipping\), got 0.0"),
        (["algo.vtrace=true"], "algo.vtrace=true corrects the critic's targets of algo.estimator=gae; algo.estimator=grpo"),
        (["algo.kl_coef=-0.1"], r"algo.kl_coef must be >= 0 \(0: no KL term\), got -0.1"),
        (["algo.mismatch_warn=0"], r"algo.mismatch_warn must be > 0 \(the lag-0 KL\(behaviour \|\| learner\) per token above .*, got 0.0"),
        (["algo.mismatch_warn=-1e-6"], r"algo.mismatch_warn must be > 0 .*, got -1e-06"),
        (["algo.is_correction=mis", "algo.mis_low=2.0", "algo.mis_high=1.0"], r"mis_low < algo.mis_high, got \[2.0, 1.0\]"),
        (["algo.is_level=sequence", "algo.is_correction=mis", "algo.seq_mis_low=1.01", "algo.seq_mis_high=1.0"],
         r"algo.seq_mis_low < algo.seq_mis_high, got \[1.01, 1.0\]"),
        (["algo.is_level=sequence", "algo.is_correction=tis", "algo.seq_tis_cap=0"], r"algo.seq_tis_cap must be > 0 \(use a large number to disable truncation\), got 0.0"),
        (["rollout.max_prompt_tokens=200", "rollout.max_new_tokens=100"],
         "rollout.max_prompt_tokens 200 \\+ rollout.max_new_tokens 100 = 300 exceeds model.tiny.max_position_embeddings 256"),
        # a gateway run's budget is rollout.max_episode_tokens; the message named max_new_tokens (6) beside 512
        (["rollout.max_prompt_tokens=64", "rollout.max_episode_tokens=512"],
         "rollout.max_prompt_tokens 64 \\+ rollout.max_episode_tokens 512 = 576 exceeds model.tiny.max_position_embeddings 256"),
        (["rollout.temperature=0"], "rollout.temperature must be > 0"),
        (["rollout.temperature=nan"], r"rollout.temperature must be > 0 and finite \(sampling is required for RL\), got nan"),
        (["rollout.temperature=inf"], "rollout.temperature must be > 0 and finite"),
        (["eval.every=10", "eval.temperature=nan"], "eval.temperature must be > 0 and finite"),
        # without an environment this passed, and the buffer then dead-lettered every longer response
        (["rollout.max_new_tokens=16", "rollout.max_episode_tokens=4"],
         "rollout.max_episode_tokens 4 is below rollout.max_new_tokens 16: a response must hold at least one whole reply"),
        (["rollout.max_new_tokens=16", "rollout.max_episode_tokens=0"], "rollout.max_episode_tokens 0 is below"),
        (["algo.overlong=shaping", "algo.overlong_buffer=8", "rollout.max_episode_tokens=8"],
         r"algo.overlong_buffer 8 must be between 1 and the response budget 8 \(rollout.max_episode_tokens\) - 1"),
        (["algo.overlong=shaping", "algo.overlong_buffer=16", "rollout.max_new_tokens=16"],
         r"algo.overlong_buffer 16 must be between 1 and the response budget 16 \(rollout.max_new_tokens\) - 1"),
        (["buffer.lease_timeout_s=1", "buffer.heartbeat_interval_s=2"], "buffer.lease_timeout_s 1.0 must exceed"),
        # heartbeats back to back (a busy loop on Redis); a prompt dead-lettered "after 0 deliveries" was delivered once
        (["buffer.heartbeat_interval_s=0"], r"buffer.heartbeat_interval_s must be > 0 seconds, got 0.0"),
        (["buffer.max_deliveries=0"], r"buffer.max_deliveries must be >= 1 \(deliveries of a prompt before it is dead-lettered\), got 0"),
        # a run that trained nothing and said "learner finished" / checked only once the models were loaded /
        # torch's AdamW raised a ValueError traceback at the learner's start
        (["learner.max_updates=0"], r"learner.max_updates and learner.ppo_epochs must be >= 1 .*, got 0, 1"),
        (["learner.ppo_epochs=0"], r"learner.max_updates and learner.ppo_epochs must be >= 1 .*, got 1200, 0"),
        (["learner.lr=-1e-3"], r"learner.lr and learner.critic_lr must be >= 0 and finite \(critic_lr null: lr\), got -0.001, None"),
        (["buffer.url=http://localhost"], "must start with redis://"),
        (["weight_server.host=0.0.0.0"], "weight_server.auth=curve"),
        (["weight_server.auth=hmac"], "needs weight_server.secret"),
        (["weight_server.shm_dir=shm"], "weight_server.shm_dir must be an absolute path"),
        (["weight_server.keyframe_every=0"], r"weight_server.keyframe_every must be an int >= 1 \(1 = every version whole\), got 0"),
        (["weight_server.delta_max_share=1.5"], r"weight_server.delta_max_share must be in \(0, 1\] .*, got 1.5"),
        (["weight_server.delta_max_share=0"], r"weight_server.delta_max_share must be in \(0, 1\]"),
        (["weight_server.delta=auto"], r"weight_server.delta=auto is not available yet: versions travel whole"),
        (["buffer.capacity=8"], "buffer.capacity 8 is smaller than one batch"),
        # numpy's shuffle of every epoch raised on them, and the producer retried it for ever: no prompt, no word
        # nothing was ever enqueued, and the producer and the learner waited for ever
        (["data.epochs=0"], r"data.epochs must be >= 1 \(passes over the prompts; the run ends once the last is trained on\), got 0"),
        (["data.seed=-1"], r"data.seed must be >= 0 \(it seeds the shuffle of each epoch\), got -1"),
        (["eval.every=10", "eval.data.seed=-2"], r"eval.data.seed must be >= 0 \(it seeds the shuffle of each epoch\), got -2"),
    ],
)
def test_validation_names_the_numbers(overrides, message):
    cfg = compose_cfg("config", overrides)
    with pytest.raises(ConfigError, match=message):
        validate(cfg)


def test_float16_is_refused_where_nothing_scales_the_loss():
    # the torch engine has no loss scaling: a loss scaled to its share of a minibatch of 131,072
    # tokens moved 0 of 89,087 weights of the tiny model in float16 (bf16: every one with a gradient);
    # DeepSpeed's ZeRO optimizer scales the loss itself
    with pytest.raises(ConfigError, match="model.dtype=float16 with learner.engine=torch.*use model.dtype=bfloat16"):
        validate(compose_cfg("config", ["model.dtype=float16"]))
    validate(compose_cfg("config", ["model.dtype=float16", "learner.engine=deepspeed"]))
    validate(compose_cfg("config", ["model.dtype=bfloat16"]))


@pytest.mark.parametrize("script", SCRIPTS)
def test_console_scripts_parse_help(script):
    import shutil
    import subprocess
    import sys

    # the script installed beside this interpreter (the venv), else whatever PATH has
    exe = Path(sys.executable).with_name(script)
    exe = str(exe) if exe.exists() else shutil.which(script)
    assert exe, f"{script} is not installed: install the project with pip install -e ."
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Configuration groups" in out.stdout or "== Config ==" in out.stdout
