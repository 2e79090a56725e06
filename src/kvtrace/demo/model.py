"""A tiny random-weight Llama and its tokenizer, made offline and cached on disk.

Used by `kvtrace demo` and the tests: vLLM's CPU build loads it like any local Hugging Face model.
Head size 64 (the CPU attention kernel refuses 16), float32, 2 layers, a plain chat template. Nothing is
downloaded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

MODEL_VERSION = "tiny-llama-v2"  # bump when the recipe changes, so stale caches are not reused
# A plain chat template, so that `vllm serve` of the model answers chat completions too.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
VOCAB_SIZE = 512


def default_cache_dir() -> Path:
    root = os.environ.get("KVTRACE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "kvtrace")
    return Path(root) / MODEL_VERSION


def _training_text() -> list[str]:
    # Enough variety for a byte-level BPE to learn a few hundred merges; content is irrelevant.
    words = ("kv cache block prefix token request step layer attention decode prefill schedule "
             "evict hit miss pin offload swap recompute the a of to and in is for on with").split()
    return [" ".join(words[(i * 7 + j) % len(words)] for j in range(24)) for i in range(400)]


def save_tokenizer(target: Path):
    """Train the tiny byte-level BPE tokenizer (with the chat template) and save it into `target`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=["<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_training_text(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(target)
    return fast


def ensure_tiny_model(path: str | os.PathLike | None = None, layers: int = 2) -> Path:
    """Create the model folder if it is missing; returns its path. Takes a few seconds the first time."""
    target = Path(path) if path else default_cache_dir()
    done = target / ".complete"
    if done.exists():
        return target
    target.mkdir(parents=True, exist_ok=True)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    fast = save_tokenizer(target)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=fast.vocab_size, hidden_size=256, intermediate_size=512,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,  # head size 64
        max_position_embeddings=4096, bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(target, safe_serialization=True)
    (target / "kvtrace_model.json").write_text(json.dumps({"version": MODEL_VERSION, "layers": layers}))
    done.touch()
    return target


def ensure_tiny_mla_model(path: str | os.PathLike, layers: int = 2) -> Path:
    """A config-only DeepSeek-V2 folder (Multi-head Latent Attention) with the tiny model's tokenizer:
    load it with `load_format="dummy"` (vLLM fills random weights). MLA's latent KV cache is one
    576-wide entry per token (kv_lora_rank 512 + rope 64), the size vLLM's MLA kernels (the CPU one
    included) are built for, and DeepSeek's head sizes (128 + 64 query/key, 128 value), the ones
    FlashAttention's MLA prefill takes; dense MLP layers only (no experts)."""
    target = Path(path)
    done = target / ".complete"
    if done.exists():
        return target
    target.mkdir(parents=True, exist_ok=True)
    fast = save_tokenizer(target)
    config = {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "vocab_size": fast.vocab_size, "hidden_size": 256, "intermediate_size": 512,
        "moe_intermediate_size": 256, "num_hidden_layers": layers, "num_attention_heads": 4,
        "num_key_value_heads": 4, "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "first_k_dense_replace": layers, "moe_layer_freq": 1,
        # experts are declared (the config's checks want them) but no layer has any: every layer is
        # below first_k_dense_replace
        "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
        "topk_method": "greedy", "n_group": 1, "topk_group": 1, "norm_topk_prob": False,
        "scoring_func": "softmax", "routed_scaling_factor": 1.0, "hidden_act": "silu",
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "attention_bias": False, "tie_word_embeddings": False, "bos_token_id": fast.bos_token_id,
        "eos_token_id": fast.eos_token_id, "torch_dtype": "float32",
    }
    (target / "config.json").write_text(json.dumps(config, indent=1))
    (target / "kvtrace_model.json").write_text(json.dumps({"version": MODEL_VERSION + "-mla", "layers": layers}))
    done.touch()
    return target
