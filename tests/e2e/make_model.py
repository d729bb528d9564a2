"""Make a small random-weight Llama and a locally trained tokenizer (no hub).

Usage: python tests/e2e/make_model.py OUT_DIR [--layers N] [--hidden H]
       [--max-positions P] [--seed S]

Deterministic for a given seed: the weights come from ``torch.manual_seed``
and the tokenizer is a byte-level BPE trained on text generated here. The
model is saved in bf16 with ``save_pretrained``; the tokenizer as a
``PreTrainedTokenizerFast`` with a chat-free config vLLM can load.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

WORDS = (
    "the", "a", "of", "to", "and", "in", "is", "it", "that", "for", "on", "with", "as", "was",
    "at", "by", "an", "be", "this", "from", "or", "have", "are", "kv", "cache", "block",
    "file", "tier", "engine", "token", "prompt", "layer", "head", "model", "store", "load",
    "hit", "miss", "offload", "disk", "memory", "page", "row", "chunk", "key", "value", "hash",
    "prefix", "restart", "shared", "root",
)


def corpus(seed: int, lines: int = 4000) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30))) for _ in range(lines)]


def make(out: Path, layers: int, hidden: int, max_positions: int, seed: int) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(out)

    torch.manual_seed(seed)
    head_dim = 64
    cfg = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=hidden // head_dim,
        num_key_value_heads=max(1, hidden // head_dim // 2),
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():  # larger logits spread: greedy ties become unlikely
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--max-positions", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print(make(a.out, a.layers, a.hidden, a.max_positions, a.seed))


if __name__ == "__main__":
    main()
