"""Hugging Face T5 under gradient checkpointing plus compression: where the extra error comes
from (docs/activations.md, "Activation checkpointing"). Run with -s to print the figures."""
from __future__ import annotations

import math
import sys

import pytest
import torch

import coat_ds
from coat_ds import ActivationConfig
from coat_ds.activation.packing import Kept
from helpers import sqnr_db

CFG = ActivationConfig(backend="torch", min_numel=256)


def _t5():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                   num_decoder_layers=2, num_heads=4, dropout_rate=0.0, decoder_start_token_id=0,
                                   pad_token_id=0)
    return transformers.T5ForConditionalGeneration(config).train()


def _grads(model, ids, labels) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=labels).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _overall_db(want, got) -> float:
    signal = sum(w.double().pow(2).sum().item() for w in want.values())
    return 10 * math.log10(signal / sum((want[n].double() - got[n].double()).pow(2).sum().item() for n in want))


def _saving_checkpoint_inputs() -> bool:
    # torch.utils.checkpoint saves the layer's inputs from a method of this name (torch 2.13).
    frame = sys._getframe(2)
    for _ in range(6):
        if frame is None:
            return False
        if frame.f_code.co_name == "save_inputs" and "checkpoint" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def _compressed_grads(model, ids, labels, keep_checkpoint_inputs=False):
    handle = coat_ds.compress_activations(model, config=CFG)
    pack, during_backward = handle.compressor.pack, []

    def watching_pack(t):
        during_backward.append(torch._C._current_graph_task_id() != -1)
        return Kept(t) if keep_checkpoint_inputs and _saving_checkpoint_inputs() else pack(t)

    handle.compressor.pack = watching_pack
    try:
        return _grads(model, ids, labels), handle.stats(), any(during_backward)
    finally:
        handle.remove()


def test_t5_checkpointing_error_comes_from_its_fp8_inputs():
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(1, 128, (2, 32), generator=g), torch.randint(1, 128, (2, 24), generator=g)
    model = _t5()
    want = _grads(model, ids, labels)
    plain, _, _ = _compressed_grads(model, ids, labels)
    model.gradient_checkpointing_enable()  # transformers' default: non-reentrant
    ckpt, stats, packed_in_backward = _compressed_grads(model, ids, labels)
    exact_inputs, _, _ = _compressed_grads(model, ids, labels, keep_checkpoint_inputs=True)
    figures = {name: (_overall_db(want, got), min(sqnr_db(want[n], got[n]) for n in want))
               for name, got in (("no checkpointing", plain), ("checkpointing", ckpt),
                                 ("checkpointing, its inputs exact", exact_inputs))}
    print({k: "overall %.1f dB, worst parameter %.1f dB" % v for k, v in figures.items()})
    # Nothing is quantized twice: the recomputation in backward is never packed, and only
    # what the checkpoints keep (each layer's inputs) and what runs outside them is stored.
    assert not packed_in_backward and stats.compressed_tensors <= 16
    # The loss is the recomputation from FP8 inputs: each layer's input error runs through
    # the whole recomputed layer (T5 scales no attention scores), where without checkpointing
    # each saved tensor's error reaches the gradients once. Measured (torch 2.13, CPU):
    # 26.5 / 20.1 dB, 21.6 / 16.3 dB, 36.8 / 32.8 dB (overall / worst parameter).
    assert figures["no checkpointing"][1] > 19.0
    assert figures["checkpointing"][0] < figures["no checkpointing"][0] - 3.0
    assert figures["checkpointing, its inputs exact"][1] > 30.0
