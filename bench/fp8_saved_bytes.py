"""Bytes of FP8 input codes that backward holds for a Hugging Face Llama with FP8 linears,
with sibling layers (q/k/v, gate/up) sharing one copy of their input and without.

    python bench/fp8_saved_bytes.py            # CPU, a 2-layer Llama (hidden 256), 2 x 128 tokens
"""
from __future__ import annotations

import argparse
from unittest import mock

import torch

import coat_ds
from coat_ds.linear import shared_input


def saved_code_bytes(model, ids, share: bool) -> int:
    """Unique uint8 storages saved for backward in one step (the layers' FP8 input codes)."""
    seen = {}

    def pack(t):
        if t.dtype == torch.uint8:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    lookup = shared_input.lookup if share else (lambda x, recipe: None)
    with mock.patch.object(shared_input, "lookup", lookup), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast(ids.device.type, dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return sum(seen.values())


def main():
    from transformers import LlamaConfig, LlamaForCausalLM

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=688)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_attention_heads=4,
                      num_key_value_heads=4, num_hidden_layers=args.layers, vocab_size=32000,
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    coat_ds.convert_to_fp8_linear(model, config=coat_ds.Fp8LinearConfig(fp8_gemm="on"))
    ids = torch.randint(0, cfg.vocab_size, (2, args.tokens))
    shared, separate = saved_code_bytes(model, ids, True), saved_code_bytes(model, ids, False)
    print(f"FP8 input codes held for backward: shared {shared:,} bytes, one copy per layer {separate:,} bytes "
          f"({shared / separate:.3f}x)")


if __name__ == "__main__":
    main()
