"""Writes a tiny Llama-architecture model as GGUF, with random weights and a byte-level
SentencePiece vocabulary: `python make_tiny_llama.py OUT.gguf`. Nothing is downloaded; the same
seed gives the same file. Its answers are gibberish, but a real engine (llama.cpp) loads it,
tokenizes, prefills, decodes and streams exactly as it would a real model, on a CPU in
milliseconds a token."""

import sys

import numpy as np
from gguf import GGUFWriter, TokenType

N_EMBD, N_FF, N_HEAD, N_LAYER, N_CTX = 64, 128, 4, 2, 512
rng = np.random.default_rng(26)

# <unk>, <s>, </s>, every byte (so any text tokenizes), then a few whole words.
words = ["▁the", "▁a", "▁model", "▁fleet", "▁GPU", "▁lane", "▁hello", "▁world", "▁is", "▁and", "."]
tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + words
types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256 + [TokenType.NORMAL] * len(words)
scores = [0.0] * 3 + [-1000.0] * 256 + [-float(i) for i in range(len(words))]
n_vocab = len(tokens)

w = GGUFWriter(sys.argv[1], "llama")
w.add_name("laneway-tiny-llama")
w.add_context_length(N_CTX)
w.add_embedding_length(N_EMBD)
w.add_block_count(N_LAYER)
w.add_feed_forward_length(N_FF)
w.add_head_count(N_HEAD)
w.add_head_count_kv(N_HEAD)
w.add_rope_dimension_count(N_EMBD // N_HEAD)
w.add_layer_norm_rms_eps(1e-5)
w.add_vocab_size(n_vocab)
w.add_tokenizer_model("llama")
w.add_token_list(tokens)
w.add_token_scores(scores)
w.add_token_types(types)
w.add_bos_token_id(1)
w.add_eos_token_id(2)
w.add_unk_token_id(0)
w.add_add_bos_token(True)
# ChatML, so chat completions have a template to render.
w.add_chat_template(
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def t(*shape):
    return (rng.standard_normal(shape) * 0.02).astype(np.float32)


# numpy shapes are GGUF's dimensions reversed: token_embd is (n_vocab, n_embd) here.
w.add_tensor("token_embd.weight", t(n_vocab, N_EMBD))
w.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=np.float32))
w.add_tensor("output.weight", t(n_vocab, N_EMBD))
for i in range(N_LAYER):
    w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
        w.add_tensor(f"blk.{i}.{name}.weight", t(N_EMBD, N_EMBD))
    w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    w.add_tensor(f"blk.{i}.ffn_gate.weight", t(N_FF, N_EMBD))
    w.add_tensor(f"blk.{i}.ffn_up.weight", t(N_FF, N_EMBD))
    w.add_tensor(f"blk.{i}.ffn_down.weight", t(N_EMBD, N_FF))

w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
print(f"tiny llama: {n_vocab} tokens, {N_LAYER} layers of {N_EMBD}: {sys.argv[1]}")
