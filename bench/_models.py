"""Real-sized model directories for the GPU benchmarks, built from a config (random weights).

No model can be downloaded where the benchmarks run, so a model of a real architecture's
shape is built here and saved in HF format; the benchmarks then load it through
``from_pretrained`` like any user model. The tokenizer is a word-level one whose vocabulary
covers every id of the model (``t0`` .. ``t<V-1>``), so any sampled id decodes.

    from _models import qwen2_05b_dir
    path = qwen2_05b_dir("/tmp/rlhf-bench-cache")   # then model.path=<path>
"""

from __future__ import annotations

import os
from pathlib import Path

#: Qwen2-0.5B's shape (its config.json), with tied embeddings as in the released model.
QWEN2_05B = dict(
    vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
    num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
    rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
)


def word_tokenizer(vocab_size: int):
    """A fast tokenizer with ids 0..vocab_size-1: 0 pad, 1 bos, 2 eos, 3 unk, then ``t4`` ..;
    text splits on whitespace, so ``"t17 t9"`` encodes to [17, 9]."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab.update({f"t{i}": i for i in range(len(specials), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>", padding_side="left")


def tokenizer_dir(model_path: Path) -> Path:
    """The word tokenizer of a model built here, in a folder of its own (``model.tokenizer_path``).

    Loaded from the model's folder, transformers picks the tokenizer class of the model type
    (``Qwen2Tokenizer`` for qwen2), whose byte-level pre-tokenizer maps every word to nothing
    in this vocabulary; from a folder without ``config.json`` it loads as saved.
    """
    out = model_path / "word-tokenizer"
    if not (out / "tokenizer.json").exists():
        from transformers import AutoConfig

        word_tokenizer(AutoConfig.from_pretrained(model_path).vocab_size).save_pretrained(out)
    return out


def qwen2_05b_dir(cache_dir: str | os.PathLike, dtype: str = "bfloat16", seed: int = 0, **overrides) -> Path:
    """A Qwen2-0.5B-shaped model + tokenizer under ``cache_dir`` (built once, atomically).

    ``overrides`` change the shape (e.g. ``num_hidden_layers=2`` for a CPU check of the code path).
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlhf_core.models import save_model_dir

    shape = {**QWEN2_05B, **overrides}
    tag = "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
    out = Path(cache_dir).expanduser() / f"qwen2-0.5b-shape-{dtype}-s{seed}{'-' + tag if tag else ''}"
    if (out / "config.json").exists():
        return out
    tokenizer = word_tokenizer(shape["vocab_size"])
    config = Qwen2Config(**shape, pad_token_id=0, bos_token_id=1, eos_token_id=2, torch_dtype=dtype)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(getattr(torch, dtype))
    save_model_dir(model, tokenizer, out)
    return out
