"""compress_activations under real FSDP2 (`fully_shard`), 2 ranks on gloo, CPU."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WORLD = 2


def _worker(rank: int, init_file: str):
    from torch.distributed.fsdp import fully_shard

    import coat_ds
    from coat_ds import ActivationConfig
    from coat_ds.activation.packing import FP8Saved
    from helpers import end_worker, stored_as_is
    from test_act_llama_block import GRAD_SQNR_DB, TinyLlama, sqnr_db

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        def build():
            torch.manual_seed(0)
            # 131 embedding and lm_head rows do not split evenly over 2 ranks: uneven shards.
            model = TinyLlama(vocab=131, dim=64, layers=2, heads=4, kv_heads=2, hidden=176)
            for layer in model.layers:
                fully_shard(layer)
            fully_shard(model)
            return model

        ref, model = build(), build()
        handle = coat_ds.compress_activations(
            model, config=ActivationConfig(backend="torch", min_numel=256),
            module_filter_fn=lambda m, fqn: fqn.startswith("layers.") and fqn.count(".") == 1)
        saves = []
        pack = handle.compressor.pack

        def spying_pack(t):
            out = pack(t)
            root = t._base if t._base is not None else t
            saves.append((isinstance(root, nn.Parameter), stored_as_is(t, out), isinstance(out, FP8Saved)))
            return out

        handle.compressor.pack = spying_pack
        torch.manual_seed(100 + rank)  # each rank its own batch
        ids = torch.randint(0, 131, (2, 32))
        for m in (ref, model):
            logits = m(ids)
            torch.nn.functional.cross_entropy(logits.reshape(-1, 131), ids.reshape(-1)).backward()
        st = handle.stats()
        # FSDP2 hands autograd its gathered full weights (nn.Parameter or views of them):
        # they are seen and never copied.
        param_saves = [s for s in saves if s[0]]
        assert param_saves and all(kept for _, kept, _ in param_saves), param_saves
        assert st.compressed_tensors >= 2 * 9 and st.ratio < 0.40, st  # 0.375: q, k and v exact
        for (name, p_ref), (_, p) in zip(ref.named_parameters(), model.named_parameters()):
            g_ref, g = p_ref.grad.full_tensor(), p.grad.full_tensor()
            assert torch.isfinite(g).all(), name
            assert sqnr_db(g_ref, g) > GRAD_SQNR_DB, (name, sqnr_db(g_ref, g))
        # A second step with the same wrapper (params resharded and re-gathered in between).
        handle.reset_stats()
        model(ids).sum().backward()
        assert handle.stats().compressed_tensors == st.compressed_tensors
    except BaseException:
        dist.destroy_process_group()
        raise
    end_worker()


@pytest.mark.slow
def test_fsdp2_two_ranks_gloo():
    with tempfile.TemporaryDirectory() as d:
        init_file = os.path.join(d, "init")
        mp.spawn(_worker, args=(init_file,), nprocs=WORLD, join=True)
