"""Model and tokenizer loading: HF-format directories or Hub ids (:mod:`rlhf_core.model_paths`),
or the `tiny` builder: a small random-initialised Llama-style causal LM with a character-level
tokenizer, built once under the cache dir and loaded through ``from_pretrained`` like a real model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import DictConfig

from rlhf_core import lora
from rlhf_core.config import Config, ConfigError, ModelConfig, TinyModelConfig, response_budget
from rlhf_core.config.rollout import budget_setting
from rlhf_core.model_paths import resolve_path

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# The tiny tokenizer: one token per printable ASCII character, plus specials.
PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
TINY_ALPHABET = [chr(c) for c in range(32, 127)]
TINY_FORMAT = 1  # bump when the tiny builder changes what it writes


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ConfigError(f"dtype {name!r} is not one of {', '.join(_DTYPES)}") from None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"model.device={name} but CUDA is not available here; use model.device=cpu or auto")
    return dev


def build_tiny_tokenizer():
    """A character-level fast tokenizer over printable ASCII (no files needed)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([PAD, BOS, EOS, UNK, *TINY_ALPHABET])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK
    )


def _tiny_key(tiny: TinyModelConfig, head: str) -> str:
    import transformers

    spec = {"tiny": dict(tiny) if isinstance(tiny, DictConfig) else vars(tiny), "head": head,
            "format": TINY_FORMAT, "transformers": transformers.__version__}
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:16]


def build_tiny_model(tiny: TinyModelConfig, out_dir: str | os.PathLike, head: str = "causal") -> Path:
    """Build the tiny model + tokenizer into ``out_dir`` (atomically). ``head``: causal, or sequence
    (an AutoModelForSequenceClassification with one label: a reward model)."""
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    out = Path(out_dir).expanduser()
    if (out / "config.json").exists():
        return out
    tokenizer = build_tiny_tokenizer()
    config = tiny_model_config(tiny, tokenizer)
    cls = {"causal": LlamaForCausalLM, "sequence": LlamaForSequenceClassification}[head]
    gen = torch.random.fork_rng(devices=[])
    with gen:
        torch.manual_seed(tiny.seed)
        model = cls(config)
    save_model_dir(model, tokenizer, out)
    log.info("built tiny %s model in %s", head, out)
    return out


def tiny_model_config(tiny: TinyModelConfig, tokenizer: Any = None) -> Any:
    """The tiny model's ``LlamaConfig`` (the builder's, and the shape checks' without building it)."""
    from transformers import LlamaConfig

    tokenizer = tokenizer if tokenizer is not None else build_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size,
        num_hidden_layers=tiny.num_layers,
        num_attention_heads=tiny.num_heads,
        num_key_value_heads=tiny.num_heads,
        max_position_embeddings=tiny.max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    config.num_labels = 1  # a property (it sets id2label); this transformers' LlamaConfig takes no such argument
    return config


def save_model_dir(model: PreTrainedModel, tokenizer: Any, out: Path) -> None:
    """Save ``model`` and ``tokenizer`` in HF format as ``out``, atomically (a temporary sibling
    renamed: a concurrent builder wins or finds it done). Every process writes its own copy,
    torch.distributed or not (``save_pretrained`` alone writes nothing on a rank other than 0)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        # this rank's private folder; an instance attribute overrides the method for this one save
        model.should_save_on_this_rank = lambda is_main_process: True  # type: ignore[method-assign]
        try:
            model.save_pretrained(tmp)
        finally:
            del model.should_save_on_this_rank
        if not (tmp / "config.json").exists():
            raise RuntimeError(f"transformers' save_pretrained wrote no config.json for {out}; "
                               "this transformers release is not one the project pins (constraints-cpu.txt)")
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, out)
        except OSError as exc:
            if not (out / "config.json").exists():
                raise OSError(f"cannot put the model built for {out} in place ({exc}); if that folder is left "
                              "from an interrupted or older build, delete it and start again") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def model_dir(cfg: ModelConfig) -> Path:
    """The local directory the policy is loaded from (a Hub id resolved to its cached snapshot;
    the tiny model built if needed)."""
    if cfg.path:
        return resolve_path(str(cfg.path), "model.path")
    if cfg.name != "tiny":
        raise ConfigError(f"model.name={cfg.name!r} needs model.path=/local/hf/dir (only 'tiny' is built locally)")
    cache = Path(cfg.cache_dir).expanduser()
    return build_tiny_model(cfg.tiny, cache / f"tiny-causal-{_tiny_key(cfg.tiny, 'causal')}", head="causal")


def load_tokenizer(cfg: ModelConfig):
    """The tokenizer (with its chat template, when the directory has one). Pads on the left."""
    from transformers import AutoTokenizer

    path = resolve_path(str(cfg.tokenizer_path), "model.tokenizer_path", "tokenizer_config.json") \
        if cfg.tokenizer_path else model_dir(cfg)
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def _from_pretrained(cls: Any, path: Path, cfg: ModelConfig, **kwargs: Any) -> PreTrainedModel:
    model = cls.from_pretrained(path, dtype=torch_dtype(cfg.dtype), trust_remote_code=cfg.trust_remote_code, **kwargs)
    return model.to(resolve_device(cfg.device))


def load_policy(cfg: ModelConfig) -> PreTrainedModel:
    """The policy: the base model, with LoRA adapters in place when ``model.lora.r`` > 0
    (:mod:`rlhf_core.lora`; the learner and every worker build the same module names)."""
    from transformers import AutoModelForCausalLM

    model = _from_pretrained(AutoModelForCausalLM, model_dir(cfg), cfg)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if lora.enabled(cfg.lora):
        lora.apply_lora(model, cfg.lora)
        if cfg.gradient_checkpointing:
            # frozen embeddings give checkpointed blocks inputs without grad: no gradient would reach the adapters
            model.enable_input_require_grads()
        adapters, total = lora.counts(model)
        log.info("LoRA r=%d on %d layers: %d adapter parameters of %d (%.2f%%)", cfg.lora.r,
                 len(lora.lora_layers(model)), adapters, total, 100.0 * adapters / total)
    return model


def check_lora(cfg: ModelConfig) -> tuple[int, int] | None:
    """Apply ``model.lora`` to a weightless copy of the policy: a ConfigError now instead of in every
    process later. Returns (adapter parameters, all parameters), or None when LoRA is off."""
    if not lora.enabled(cfg.lora):
        return None
    config = policy_config(cfg)
    return lora.check_targets(config, cfg.lora, trust_remote_code=cfg.trust_remote_code)


def policy_config(cfg: ModelConfig) -> Any:
    """The policy's transformers config, read without its weights (the tiny model's not even built)."""
    if cfg.path is None and cfg.name == "tiny":
        return tiny_model_config(cfg.tiny)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir(cfg), trust_remote_code=cfg.trust_remote_code)


def check_teacher(cfg: Config) -> Path:
    """The folder of ``distill.teacher.path`` once its files show it can score the student's
    samples: it exists, its tokenizer gives every token of the student's the student's id, its vocabulary
    covers the student's (a larger one is padding no token the student samples reaches, e.g.
    Qwen2.5-7B's 152,064 rows beside 0.5B's 151,936) and its context holds a prompt and a
    response of this run. A :class:`ConfigError` naming both sides otherwise. Reads configs and
    tokenizers, no weights."""
    from transformers import AutoConfig, AutoTokenizer

    value, model = str(cfg.distill.teacher.path), cfg.model
    path = resolve_path(value, "distill.teacher.path")
    key = f"distill.teacher.path={value}"
    student = f"model.path={model.path}" if model.path else f"model={model.name}"
    if not (path / "tokenizer_config.json").exists():
        raise ConfigError(f"{key} has no tokenizer (tokenizer_config.json): save the teacher's tokenizer beside it "
                          "(tokenizer.save_pretrained), so that it can be checked against the student's")
    teacher_vocab = AutoTokenizer.from_pretrained(path, trust_remote_code=model.trust_remote_code).get_vocab()
    student_vocab = load_tokenizer(model).get_vocab()
    moved = [t for t, i in student_vocab.items() if teacher_vocab.get(t) != i]
    if moved:
        example = moved[0]
        raise ConfigError(f"{key}: its tokenizer ({len(teacher_vocab)} tokens) is not the student's ({student}, "
                          f"{len(student_vocab)} tokens): {len(moved)} of the student's tokens have another id or none "
                          f"there (e.g. {example!r}: {student_vocab.get(example)} vs {teacher_vocab.get(example)}); "
                          "distillation compares the two models' log-probs of the same token ids")
    teacher = AutoConfig.from_pretrained(path, trust_remote_code=model.trust_remote_code).get_text_config()
    mine = policy_config(model).get_text_config()
    if teacher.vocab_size < mine.vocab_size:
        raise ConfigError(f"{key} has vocab_size {teacher.vocab_size}, the student ({student}) {mine.vocab_size}: the "
                          "teacher has no log-prob for the student's last ids; distil from a teacher whose vocabulary "
                          "covers the student's")
    context = getattr(teacher, "max_position_embeddings", None)
    need = cfg.rollout.max_prompt_tokens + response_budget(cfg.rollout)
    if context is not None and context < need:
        raise ConfigError(f"{key} holds max_position_embeddings {context} tokens, but a sample of this run takes up to "
                          f"rollout.max_prompt_tokens {cfg.rollout.max_prompt_tokens} + {budget_setting(cfg.rollout)} "
                          f"{response_budget(cfg.rollout)} = {need}; shorten them or distil from a teacher with a "
                          "longer context")
    return path


def load_teacher(cfg: Config) -> PreTrainedModel:
    """The frozen teacher of ``distill.teacher.path`` (checked by :func:`check_teacher` first),
    at ``model.dtype`` on ``model.device``, as the reference model is."""
    from transformers import AutoModelForCausalLM

    model = _from_pretrained(AutoModelForCausalLM, check_teacher(cfg), cfg.model)
    model.eval().requires_grad_(False)
    return model


def load_reference(cfg: ModelConfig) -> PreTrainedModel:
    """The frozen reference policy (the initial policy unless model.ref_path says otherwise)."""
    from transformers import AutoModelForCausalLM

    path = resolve_path(str(cfg.ref_path), "model.ref_path") if cfg.ref_path else model_dir(cfg)
    model = _from_pretrained(AutoModelForCausalLM, path, cfg)
    model.eval().requires_grad_(False)
    return model


def load_critic(cfg: ModelConfig) -> PreTrainedModel:
    """A value model, one scalar per token (AutoModelForTokenClassification, num_labels=1), from
    ``model.critic_path`` or the policy's trunk with a fresh head. Its dropout is off: ``old_values``
    come from an eval-mode pass, and dropped features would clip values that have not moved."""
    from transformers import AutoModelForTokenClassification

    path = resolve_path(str(cfg.critic_path), "model.critic_path") if cfg.critic_path else model_dir(cfg)
    critic = _from_pretrained(AutoModelForTokenClassification, path, cfg, num_labels=1)
    for m in critic.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd):
            m.p = 0.0
    return critic


def load_reward_model(path: str | os.PathLike, cfg: ModelConfig) -> tuple[PreTrainedModel, Any]:
    """A reward model (AutoModelForSequenceClassification, one label) and its tokenizer."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    p = resolve_path(str(path), "the reward model's path")
    model = _from_pretrained(AutoModelForSequenceClassification, p, cfg)
    model.eval().requires_grad_(False)
    if model.config.num_labels != 1:
        raise ConfigError(f"reward model {path} has {model.config.num_labels} labels; a reward model needs exactly 1")
    tok = AutoTokenizer.from_pretrained(p, trust_remote_code=cfg.trust_remote_code)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    # Batches are padded (on the right) with the tokenizer's pad token, and the head reads each row
    # at its last token that is not config.pad_token_id: the two must be one id, or a short row is
    # read at a padding position and its score depends on its batch-mates.
    if model.config.pad_token_id != tok.pad_token_id:
        if model.config.pad_token_id is not None:
            log.warning("reward model %s: config pad_token_id %s differs from its tokenizer's pad token %r (id %s); "
                        "using the tokenizer's", path, model.config.pad_token_id, tok.pad_token, tok.pad_token_id)
        model.config.pad_token_id = tok.pad_token_id
    return model, tok
