"""``model``: the policy (a local HF folder, a Hub id, or the built-in ``tiny`` model) and its LoRA adapters."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rlhf_core.choices import Dtype
from rlhf_core.errors import ConfigError

#: the adapter ranks vLLM's LoRA support is built for (its max_lora_rank is one of them)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass
class TinyModelConfig:
    """A small random-initialised Llama-style causal LM built locally (no downloads)."""

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 128
    max_position_embeddings: int = 256
    seed: int = 0


@dataclass
class LoraConfig:
    """LoRA adapters on the policy (extra ``lora``: peft). ``r`` 0 or null: off, the whole model trains.

    With ``r > 0`` the learner trains the adapters only, the weight server carries only the
    adapter tensors (every version complete: base weights come from ``model.path`` on every
    side), workers apply them to their own copy of the base model, and ``learner.export_dir``
    gets the merged model. See ``rlhf_core/lora.py``.
    """

    r: int | None = 0  # adapter rank; 0 or null: no adapters
    alpha: float = 16.0  # the update is scaled by alpha / r (alpha / sqrt(r) with rslora)
    # on the adapter's input while training (the learner's pi_prox pass and the workers run without it;
    # > 0 turns off reading pi_prox off the training pass, see learner/update.py)
    dropout: float = 0.0
    # module names (or suffixes) that get an adapter; all-linear: every linear layer but the output head
    # ([all-linear, lm_head]: the head too, which a random-initialised model such as `tiny` needs to learn)
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    rslora: bool = False  # rank-stabilised scaling alpha / sqrt(r)

    def check(self) -> None:
        """Rank, scaling, dropout, targets, and peft installed. (Whether the targets match layers of
        the model is checked on a weightless copy of it by ``rlhf_core.models.check_lora`` before
        ``rlhf-run`` starts anything.)"""
        r = self.r
        if r is None or r == 0:
            return
        if r < 0:
            raise ConfigError(f"model.lora.r must be >= 0 (0 or null: no adapters, the whole model trains), got {r}")
        if not (self.alpha > 0 and math.isfinite(self.alpha)):
            raise ConfigError(f"model.lora.alpha must be > 0 (the adapter's update is scaled by alpha / r; "
                              f"alpha = r gives 1), got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"model.lora.dropout must be in [0, 1) (0: none, the usual choice for RL), got {self.dropout}")
        targets = [str(t) for t in self.target_modules]
        if not targets or any(not t.strip() for t in targets):
            raise ConfigError(f"model.lora.target_modules must name layers (e.g. [q_proj, v_proj]) or be [all-linear], "
                              f"got {targets}")
        import importlib.util

        if importlib.util.find_spec("peft") is None:
            raise ConfigError(f"model.lora.r={r} needs peft, which is not installed: pip install -e '.[lora]' "
                              "(or set model.lora.r=0 to train the whole model)")


@dataclass
class ModelConfig:
    name: str = "tiny"
    # A local HF-format directory. When set it is loaded with from_pretrained; when null the
    # `tiny` builder makes one (saved under cache_dir so loading goes through from_pretrained too).
    path: str | None = None
    tokenizer_path: str | None = None
    ref_path: str | None = None  # reference policy; defaults to `path` (the initial policy)
    critic_path: str | None = None  # value model; defaults to a value head on `path`
    dtype: Dtype = Dtype.float32
    device: str = "cpu"  # cpu | cuda | cuda:N | auto
    cache_dir: str = "~/.cache/rlhf-service"
    trust_remote_code: bool = False
    gradient_checkpointing: bool = False
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def check(self) -> None:
        """A model other than the built-in tiny one needs its local directory (``model=hf`` leaves
        ``model.path`` as ??? for the user)."""
        if not self.path and self.name != "tiny":
            raise ConfigError(f"model={self.name} needs model.path=/local/hf/dir (a directory written by save_pretrained; "
                              "or a Hugging Face Hub id such as Qwen/Qwen2.5-0.5B-Instruct); only model=tiny is built locally")
        self.lora.check()
