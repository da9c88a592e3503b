"""A Llama-shaped GGUF of random quantized blocks (a Q4_K_M-like mix: Q4_K, with attn_v,
ffn_down and output in Q6_K, as llama.cpp's llama_tensor_get_type), for decode benchmarks of
big shapes without a checkpoint. Both engines read the same file; the vocabulary is the test
tokenizer's (small), so the output matrix is a few MB.

    python scripts/random_gguf.py 7b OUT.gguf      (Llama-2-7B: 4096 hidden, 11008 MLP, 32 layers)
    python scripts/random_gguf.py 1b OUT.gguf      (TinyLlama-1.1B: 2048, 5632, 22 layers, 4 KV heads)
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tests.test_gguf_packed as t  # noqa: E402

SHAPES = {"7b": (4096, 11008, 32, 32, 32), "1b": (2048, 5632, 22, 32, 4)}


def main(shape: str, out: str) -> None:
    hidden, inter, layers, heads, kv_heads = SHAPES[shape]
    kv = hidden // heads * kv_heads
    t.HIDDEN, t.INTER, t.HEADS, t.KV_HEADS, t.LAYERS = hidden, inter, heads, kv_heads, layers
    t.LAYER_TENSORS = {"attn_q": (hidden, hidden), "attn_k": (kv, hidden), "attn_v": (kv, hidden),
                       "attn_output": (hidden, hidden), "ffn_gate": (inter, hidden),
                       "ffn_up": (inter, hidden), "ffn_down": (hidden, inter)}
    # weights of standard deviation ~0.02, as trained checkpoints' matrices
    t.unit_scale = lambda q: 0.02 / float(t.gguf_dequantized(t.random_blocks(q, 16, 256, seed=0), q).std())
    t.write_random_gguf(Path(out), t.Q4_K_M)
    print("wrote", out, f"{Path(out).stat().st_size / 2**30:.2f} GiB")


if __name__ == "__main__":
    main(*sys.argv[1:3])
