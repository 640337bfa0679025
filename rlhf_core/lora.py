"""LoRA adapters on the policy (``model.lora``; extra ``lora``: peft).

The learner and every worker apply the same adapters in place (:func:`apply_lora`, peft's
``inject_adapter_in_model``: no ``PeftModel`` wrapper), so they hold the same module names; only
the adapters train and cross the weight server (:func:`adapter_parameters`), export merges them
(:func:`merged_state_dict`), and vLLM loads them from a PEFT adapter directory
(:func:`save_adapter`). docs/architecture.md (LoRA) tells the design.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

from rlhf_core.config import ConfigError, LoraConfig

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ADAPTER = "default"  # peft's adapter name: the one adapter of a model here
ADAPTER_MARK = "lora_"  # peft's prefix of adapter parameters (its `_mark_only_adapters_as_trainable` rule)
ALL_LINEAR = "all-linear"
INSTALL_HINT = "pip install -e '.[lora]' (peft)"


def rank(lora: LoraConfig | None) -> int:
    """The adapter rank ``model.lora.r``; 0 when off (0 or null)."""
    return 0 if lora is None or lora.r is None else int(lora.r)


def enabled(lora: LoraConfig | None) -> TypeGuard[LoraConfig]:
    """Whether ``model.lora`` asks for adapters (``r`` > 0)."""
    return rank(lora) > 0


def import_peft() -> Any:
    try:
        import peft
    except ImportError as exc:
        raise ConfigError(f"model.lora.r > 0 needs peft, which is not importable ({exc}): {INSTALL_HINT}; "
                          "or train the whole model with model.lora.r=0") from None
    return peft


def target_modules(lora: LoraConfig, model: PreTrainedModel) -> str | list[str]:
    """peft's ``target_modules`` for ``model.lora.target_modules``: ``all-linear`` is every linear
    layer but the output head, plus the other names listed (``[all-linear, lm_head]``: the head too)."""
    names = [str(t) for t in lora.target_modules]
    if names == [ALL_LINEAR]:
        return ALL_LINEAR
    if ALL_LINEAR not in names:
        return names
    head = model.get_output_embeddings()
    head_names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if head is not None and m is head}
    extra = [n for n in names if n != ALL_LINEAR]
    return sorted(set(linear_layer_names(model)) - head_names | set(extra))


def peft_config(lora: LoraConfig, model: PreTrainedModel) -> Any:
    """peft's ``LoraConfig`` for ``model.lora`` on ``model``."""
    peft = import_peft()
    return peft.LoraConfig(r=rank(lora), lora_alpha=float(lora.alpha), lora_dropout=float(lora.dropout),
                           target_modules=target_modules(lora, model), use_rslora=bool(lora.rslora), bias="none")


def apply_lora(model: PreTrainedModel, lora: LoraConfig, what: str = "the policy") -> PreTrainedModel:
    """Put adapters into ``model`` in place; returns ``model``. ConfigError when the target
    modules match nothing, name layers other than linear ones, or peft cannot wrap the model."""
    peft = import_peft()
    config = peft_config(lora, model)
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is getattr(model.get_input_embeddings(), "weight", None)
    try:
        peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    except (ValueError, TypeError, KeyError, NotImplementedError, AttributeError) as exc:
        raise ConfigError(
            f"model.lora.target_modules={list(lora.target_modules)} cannot put LoRA adapters on {what} "
            f"({type(model).__name__}): {str(exc).rstrip('.')}. Its linear layers are {linear_layer_names(model)[:12]}; name some of "
            f"them (suffixes such as q_proj) or use [{ALL_LINEAR}], or set model.lora.r=0 to train the whole model"
        ) from None
    layers = lora_layers(model)
    if tied and any(layer.get_base_layer() is head for layer in layers.values()):
        raise ConfigError(f"model.lora.target_modules={list(lora.target_modules)} puts an adapter on the output head of "
                          f"{what}, which shares its matrix with the input embeddings (tie_word_embeddings): its update "
                          "cannot be merged into the one shared matrix (the export would fail at the end of the run). "
                          f"Leave the head out ([{ALL_LINEAR}] does), or use a model whose embeddings are not tied")
    odd = sorted({f"{name} ({type(layer.get_base_layer()).__name__})" for name, layer in layers.items()
                  if not isinstance(layer, peft.tuners.lora.layer.Linear)})
    if odd:
        raise ConfigError(f"model.lora.target_modules={list(lora.target_modules)} names layers that are not linear: "
                          f"{odd[:4]}; adapters here go on linear layers only (they are merged and sent to vLLM "
                          "as such): name linear layers, or use [all-linear]")
    if not any(p.requires_grad for p in adapter_parameters(model).values()):
        raise ConfigError(f"model.lora put no trainable adapter on {what}; check model.lora.target_modules")
    return model


def linear_layer_names(model: torch.nn.Module) -> list[str]:
    """The distinct last names of the model's linear layers (what target_modules may name)."""
    from transformers.pytorch_utils import Conv1D

    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                   if isinstance(m, (torch.nn.Linear, Conv1D)) and name})


def lora_layers(model: torch.nn.Module) -> dict[str, Any]:
    """``{module name: peft LoRA layer}`` of ``model`` (empty without adapters)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return {}
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def adapter_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """``{name: parameter}`` of the adapters, in ``named_parameters`` order: what the learner
    publishes and what a worker pulls into (empty without adapters)."""
    return {n: p for n, p in model.named_parameters() if ADAPTER_MARK in n}


def has_adapters(model: torch.nn.Module) -> bool:
    return any(ADAPTER_MARK in n for n, _ in model.named_parameters())


def counts(model: torch.nn.Module) -> tuple[int, int]:
    """(adapter parameters, all parameters) of ``model``, in elements."""
    adapter = sum(p.numel() for p in adapter_parameters(model).values())
    return adapter, sum(p.numel() for p in model.parameters())


def merged_state_dict(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base model's state dict with every adapter merged in: for each LoRA layer ``L``,
    ``L.weight = L.base_layer.weight + scaling * (L.lora_B @ L.lora_A)`` (transposed for
    fan-in-fan-out layers), in float32 stored in the base weight's dtype, under the base names.
    ``state``: ``model``'s full state under its own names; only each layer's scaling is read from ``model``."""
    out = dict(state)
    for name, layer in lora_layers(model).items():
        base_key, a_key, b_key = (f"{name}.base_layer.weight", f"{name}.lora_A.{ADAPTER}.weight",
                                  f"{name}.lora_B.{ADAPTER}.weight")
        if a_key not in out:
            continue
        base, a, b = out.pop(base_key), out.pop(a_key), out.pop(b_key)
        delta = (b.float() @ a.float()) * float(layer.scaling[ADAPTER])
        if getattr(layer, "fan_in_fan_out", False):
            delta = delta.T
        out[base_key] = (base.float() + delta).to(base.dtype)
    renamed = {}
    for key, value in out.items():
        if ADAPTER_MARK in key:
            raise ValueError(f"cannot merge adapter tensor {key!r}: its layer is not a LoRA layer of the model")
        renamed[key.replace(".base_layer.", ".")] = value
    return renamed


def peft_adapter_name(name: str) -> str:
    """A parameter name here -> its name in a PEFT adapter file (``base_model.model.`` prefix, no
    adapter name): ``m.layers.0.q_proj.lora_A.default.weight`` -> ``base_model.model.m.layers.0.q_proj.lora_A.weight``."""
    return "base_model.model." + name.replace(f".{ADAPTER}.", ".")


def save_adapter(directory: str | os.PathLike, tensors: Mapping[str, torch.Tensor], lora: LoraConfig,
                 base_model: str | None = None) -> Path:
    """Write ``tensors`` (adapter parameters under this module's names) as a PEFT adapter
    directory: ``adapter_config.json`` + ``adapter_model.safetensors``, what
    ``PeftModel.from_pretrained`` and vLLM's ``LoRARequest`` load. Files are 0600."""
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    modules = sorted({n.split(f".{ADAPTER_MARK}", 1)[0].rsplit(".", 1)[-1] for n in tensors})
    alpha = float(lora.alpha)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank(lora),
        "lora_alpha": int(alpha) if alpha.is_integer() else alpha, "lora_dropout": 0.0,
        "target_modules": modules, "use_rslora": bool(lora.rslora), "bias": "none", "fan_in_fan_out": False,
        "modules_to_save": None, "init_lora_weights": True, "base_model_name_or_path": base_model,
    }
    weights = out / "adapter_model.safetensors"
    save_file({peft_adapter_name(n): t.detach().to("cpu").contiguous() for n, t in tensors.items()}, str(weights))
    (out / "adapter_config.json").write_text(json.dumps(config, indent=1))
    for f in (weights, out / "adapter_config.json"):
        os.chmod(f, 0o600)
    return out


def meta_model(config: Any, lora: LoraConfig, trust_remote_code: bool = False) -> PreTrainedModel:
    """The policy the model ``config`` describes with ``lora`` applied, weightless (meta device:
    no memory, nothing read): its names and shapes, cheaply, for checks before any model loads."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
        return apply_lora(model, lora)


def check_targets(config: Any, lora: LoraConfig, trust_remote_code: bool = False) -> tuple[int, int]:
    """Apply ``lora`` to a weightless copy of the model (:func:`meta_model`), so a setting that
    matches nothing is refused before any process starts. Returns (adapter parameters, all parameters)."""
    return counts(meta_model(config, lora, trust_remote_code))


def adapter_shapes(config: Any, lora: LoraConfig, trust_remote_code: bool = False) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of every adapter tensor a version holds for this model and ``lora``."""
    return {n: tuple(p.shape) for n, p in adapter_parameters(meta_model(config, lora, trust_remote_code)).items()}
