"""distill.teacher.path refused at start, in one line naming both sides: a path that is no model,
a teacher of another tokenizer or a smaller vocabulary, one whose context is shorter than a
sample; the ``distill`` section's rules; a teacher that fits is loaded frozen."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from rlhf_core.config import Config, ConfigError, DistillConfig, TeacherConfig, TinyModelConfig, register_configs, to_object, validate
from rlhf_core.models import build_tiny_model, build_tiny_tokenizer, check_teacher, load_teacher, save_model_dir, tiny_model_config
from rlhf_run.supervisor import check_before_start


def config(tiny_model_cfg, teacher: Path | str, **rollout) -> Config:
    cfg = Config(model=tiny_model_cfg, distill=DistillConfig(teacher=TeacherConfig(path=str(teacher))))
    for key, value in rollout.items():
        setattr(cfg.rollout, key, value)
    return cfg


def teacher_dir(out: Path, vocab_size: int | None = None, tokenizer=None) -> Path:
    """A tiny Llama teacher saved with ``tokenizer`` (the tiny one by default) and a config of
    ``vocab_size`` rows (the tokenizer's length by default)."""
    from transformers import LlamaForCausalLM

    tok = tokenizer or build_tiny_tokenizer()
    conf = tiny_model_config(TinyModelConfig(), tok)
    if vocab_size is not None:
        conf.vocab_size = vocab_size
    save_model_dir(LlamaForCausalLM(conf), tok, out)
    return out


def shuffled_tokenizer():
    """The tiny tokenizer's characters, the digits' ids swapped with the letters': another tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from rlhf_core.models import BOS, EOS, PAD, TINY_ALPHABET, UNK

    chars = sorted(TINY_ALPHABET, key=lambda c: (not c.isalpha(), c))
    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate([PAD, BOS, EOS, UNK, *chars])}, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK)


def test_a_teacher_that_fits_is_loaded_frozen(tiny_model_cfg, tmp_path):
    # the tiny model itself, and one with more (padding) rows than the student: both fit
    same = build_tiny_model(tiny_model_cfg.tiny, tmp_path / "same")
    assert check_teacher(config(tiny_model_cfg, same)) == same
    wider = teacher_dir(tmp_path / "wider", vocab_size=128)
    teacher = load_teacher(config(tiny_model_cfg, wider))
    assert teacher.config.vocab_size == 128 and not teacher.training
    assert not any(p.requires_grad for p in teacher.parameters())


def test_a_path_that_does_not_exist(tiny_model_cfg, tmp_path):
    missing = tmp_path / "no-teacher"
    with pytest.raises(ConfigError, match=rf"^distill.teacher.path={missing}: no such folder") as err:
        check_teacher(config(tiny_model_cfg, missing))
    assert "\n" not in str(err.value)
    # rlhf-run refuses it before anything starts
    with pytest.raises(ConfigError, match="distill.teacher.path"):
        check_before_start(config(tiny_model_cfg, missing))


def test_a_folder_without_a_tokenizer(tiny_model_cfg, tmp_path):
    folder = build_tiny_model(tiny_model_cfg.tiny, tmp_path / "t")
    (folder / "tokenizer_config.json").unlink()
    with pytest.raises(ConfigError, match=r"has no tokenizer \(tokenizer_config.json\)"):
        check_teacher(config(tiny_model_cfg, folder))


def test_another_tokenizer_is_refused_naming_both(tiny_model_cfg, tmp_path):
    folder = teacher_dir(tmp_path / "other-tok", tokenizer=shuffled_tokenizer())
    with pytest.raises(ConfigError) as err:
        check_teacher(config(tiny_model_cfg, folder))
    line = str(err.value)
    assert "\n" not in line and f"distill.teacher.path={folder}" in line and "model=tiny" in line
    assert "is not the student's" in line and "99 tokens" in line


def test_a_smaller_vocabulary_is_refused_naming_both(tiny_model_cfg, tmp_path):
    folder = teacher_dir(tmp_path / "narrow", vocab_size=64)
    with pytest.raises(ConfigError, match=rf"^distill.teacher.path={folder} has vocab_size 64, the student \(model=tiny\) 99"):
        check_teacher(config(tiny_model_cfg, folder))


def test_a_shorter_context_is_refused_naming_both(tiny_model_cfg, tmp_path):
    short = build_tiny_model(dataclasses.replace(tiny_model_cfg.tiny, max_position_embeddings=48), tmp_path / "short")
    # 64 prompt tokens + 16 new tokens = 80 > 48
    with pytest.raises(ConfigError, match=r"max_position_embeddings 48 tokens, but a sample of this run takes up to "
                                          r"rollout.max_prompt_tokens 64 \+ rollout.max_new_tokens 16 = 80") as err:
        check_teacher(config(tiny_model_cfg, short, max_prompt_tokens=64, max_new_tokens=16))
    assert "\n" not in str(err.value)
    check_teacher(config(tiny_model_cfg, short, max_prompt_tokens=32, max_new_tokens=16))  # 48 fits


def compose_cfg(*overrides: str) -> Config:
    register_configs()
    with initialize_config_module(config_module="conf", version_base="1.3"):
        return to_object(compose(config_name="config", overrides=list(overrides)))


def test_experiment_distill_reads_its_teacher_from_a_folder():
    cfg = compose_cfg("experiment=distill")
    assert cfg.distill.enabled and cfg.distill.teacher.path == "./teacher" and cfg.distill.reward_weight == 0
    validate(cfg)
    assert not compose_cfg().distill.enabled  # the default run has no teacher


@pytest.mark.parametrize("overrides, message", [
    (["distill.reward_weight=-0.5"], r"distill.reward_weight must be >= 0 and finite"),
    (["distill.reward_weight=nan"], r"distill.reward_weight must be >= 0 and finite"),
    (["experiment=dpo"], r"distill.teacher.path with algo.estimator=dpo"),
    (["algo.filter_groups=true"], r"algo.filter_groups=true with pure distillation"),
])
def test_section_and_cross_section_rules(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose_cfg(*overrides, "distill.teacher.path=./t"))


def test_the_group_filter_stays_with_a_reward_weight():
    validate(compose_cfg("algo.filter_groups=true", "distill.teacher.path=./t", "distill.reward_weight=1"))
