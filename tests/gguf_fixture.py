"""A tiny random Llama written as a GGUF file (with the reference target's tokenizer), for GGUF tests.

llama.cpp's converter is not available here, so the file is written with the `gguf` package's writer
in llama.cpp's tensor naming; transformers reads it back exactly as it reads a real GGUF target.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

REF = Path(__file__).resolve().parents[1] / "assets" / "reference-target"
H, LAYERS, HEADS, KV, INTER = 64, 2, 4, 2, 128


def _tokenizer(w) -> int:
    tj = json.loads((REF / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    for t in tj.get("added_tokens", []):
        vocab.setdefault(t["content"], t["id"])
    tokens = [None] * (max(vocab.values()) + 1)
    for tok, i in vocab.items():
        tokens[i] = tok
    special = {t["id"] for t in tj.get("added_tokens", []) if t.get("special")}
    # transformers' GGUF tokenizer appends <|endoftext|> when the file lacks it: ship it as a token
    special.add(len(tokens))
    tokens.append("<|endoftext|>")
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    cfg = json.loads((REF / "tokenizer_config.json").read_text())
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    w.add_token_merges(merges)
    eos = vocab[cfg["eos_token"]] if isinstance(cfg.get("eos_token"), str) else 0
    w.add_eos_token_id(eos)
    w.add_bos_token_id(eos)
    template = cfg.get("chat_template") or (REF / "chat_template.jinja").read_text()
    w.add_chat_template(template)
    return len(tokens)


def write_tiny_gguf(path: Path, quant: str = "Q8_0", seed: int = 0, arch: str = "llama") -> Path:
    """``arch`` is the GGUF architecture written (keys and name): "t5" makes a seq2seq file, an unknown name
    one transformers does not support; the tensors stay llama's (the file is refused before they matter)."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-test-llama")
    vocab = _tokenizer(w)
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(H)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    qt = getattr(gguf.GGMLQuantizationType, quant)

    def put(name: str, shape: tuple[int, ...], norm: bool = False) -> None:
        x = (np.ones(shape) if norm else rng.normal(0, 0.08, shape)).astype(np.float32)
        if norm or qt == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, x)
        else:
            w.add_tensor(name, gguf.quants.quantize(x, qt), raw_dtype=qt)

    hd = H // HEADS
    put("token_embd.weight", (vocab, H))
    for i in range(LAYERS):
        put(f"blk.{i}.attn_norm.weight", (H,), norm=True)
        put(f"blk.{i}.attn_q.weight", (H, H))
        put(f"blk.{i}.attn_k.weight", (KV * hd, H))
        put(f"blk.{i}.attn_v.weight", (KV * hd, H))
        put(f"blk.{i}.attn_output.weight", (H, H))
        put(f"blk.{i}.ffn_norm.weight", (H,), norm=True)
        put(f"blk.{i}.ffn_gate.weight", (INTER, H))
        put(f"blk.{i}.ffn_up.weight", (INTER, H))
        put(f"blk.{i}.ffn_down.weight", (H, INTER))
    put("output_norm.weight", (H,), norm=True)
    put("output.weight", (vocab, H))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def damaged_copies(good: Path, where: Path) -> dict[str, Path]:
    """Broken variants of a good GGUF file, by the cause their error must name."""
    data = good.read_bytes()
    bad_count = bytearray(data)
    bad_count[16:24] = struct.pack("<Q", 2**40)  # the metadata entry count of the header
    variants = {"truncated": data[: len(data) // 2], "truncated_tail": data[:-4096], "not_gguf": b"<html>404</html>" * 8,
                "empty": b"", "damaged_header": bytes(bad_count)}
    out = {}
    for kind, blob in variants.items():
        out[kind] = where / f"{kind}.gguf"
        out[kind].write_bytes(blob)
    return out
