"""Random tiny Hugging Face Qwen3 / Qwen3-MoE models for checkpoint and MoE tests."""

from __future__ import annotations

import os

import numpy as np

from tg_jax.models import ModelConfig


def make_hf_model(cfg: ModelConfig, seed: int = 0, std: float = 0.1):
    """A random fp32 `Qwen3ForCausalLM` or `Qwen3MoeForCausalLM` with the architecture of cfg.

    Norm weights are random too, so that a wrong norm mapping cannot hide behind ones.
    """
    import torch
    import transformers

    common = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        max_position_embeddings=cfg.max_seq_len,
        attention_bias=False,
        use_sliding_window=False,
    )
    if cfg.is_moe:
        hf_cfg = transformers.Qwen3MoeConfig(
            **common,
            intermediate_size=4 * cfg.moe_mlp_dim,
            moe_intermediate_size=cfg.moe_mlp_dim,
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.experts_per_token,
            norm_topk_prob=cfg.norm_topk_prob,
            router_aux_loss_coef=cfg.router_aux_loss_coef,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
        model_cls = transformers.Qwen3MoeForCausalLM
    else:
        hf_cfg = transformers.Qwen3Config(**common, intermediate_size=cfg.mlp_dim)
        model_cls = transformers.Qwen3ForCausalLM
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(hf_cfg).eval().to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(std * torch.randn_like(p))
    return model


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(np.asarray(tokens, np.int64)))
    return out.logits.numpy()


TEMPLATE_PATH = os.path.join(os.path.dirname(__file__), "data", "qwen3_chat_template.jinja")
SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>",
    "</tool_call>", "<tool_response>", "</tool_response>",
)  # fmt: skip
_CORPUS = (
    "def f(x):\n    return x * 3 + 1\n",
    '{"name": "run_tests", "arguments": {"code": "def f(x):\\n    return x"}}',
    "Find the integer function f from the examples. f(0) = 4, f(1) = 7, f(2) = 10.",
    "All tests passed. Submit your answer with the submit tool.",
    "```python\ndef f(x):\n    if x > 0:\n        return x - 2\n    return -x\n```",
)


def make_tokenizer(vocab_size: int = 400):
    """A small byte-level BPE trained here, with Qwen3's chat special tokens."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(list(_CORPUS) * 20, trainer=trainer)
    return tok


TEMPLATES = {
    "qwen3": TEMPLATE_PATH,  # Qwen3's official template: Hermes JSON calls, thinking
    # Qwen3-Coder's public template: XML tool calls, no thinking.
    "qwen3_coder": os.path.join(
        os.path.dirname(__file__), "data", "qwen3_coder_chat_template.jinja"
    ),
}


def chat_template(name: str) -> str:
    """A public chat template by name, or "chatml_no_newline": Qwen3's writing nothing between
    messages."""
    if name == "chatml_no_newline":
        t = chat_template("qwen3").replace("'<|im_end|>' + '\\n'", "'<|im_end|>'")
        return t.replace("<|im_end|>\\n", "<|im_end|>")
    with open(TEMPLATES[name]) as f:
        return f.read()


def make_model_dir(path, cfg: ModelConfig, seed: int = 0, template: str = "qwen3") -> ModelConfig:
    """A checkpoint directory as a user brings it: a random transformers model saved by
    `save_pretrained`, a tokenizer trained here (tokenizer.json, tokenizer_config.json), a
    public chat template (`chat_template(template)`, in chat_template.jinja) and
    generation_config.json. cfg.vocab_size is replaced by the tokenizer's size rounded up to a
    multiple of 8; returns the config used."""
    import dataclasses

    import transformers

    tok = make_tokenizer()
    template = chat_template(template)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        chat_template=template,
    )  # fmt: skip
    fast.save_pretrained(str(path))
    n = tok.get_vocab_size(with_added_tokens=True)
    cfg = dataclasses.replace(cfg, vocab_size=-(-n // 8) * 8)
    model = make_hf_model(cfg, seed=seed, std=0.02)
    model.generation_config = transformers.GenerationConfig(
        eos_token_id=[tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")],
        pad_token_id=tok.token_to_id("<|endoftext|>"),
    )
    model.save_pretrained(str(path))
    return cfg
