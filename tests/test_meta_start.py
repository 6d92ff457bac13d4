"""train.py's meta_start: weights drawn shard by shard are the same at any world size; under
FSDP2 each rank's host memory grows by its shard only while a model is built whose full
FP32 copy on every rank would not fit the machine; ZeRO-3's partitions hold the same values."""
from __future__ import annotations

import json
import os
import re
import sys

import pytest
import torch

from coat_ds.models.llama import Llama, ModelConfig
from coat_ds.models.sharded_init import BLOCK_NUMEL, fill_normal, init_local_shards

# Built whole on each of the 4 ranks, its FP32 weights would exceed the memory of the machines
# the suite runs on (docs/deepspeed.md, "Model start"); its shards, a quarter of it per rank,
# fit well. Four ranks rather than two: the model need only exceed a quarter of the memory, not
# half, so what the ranks allocate in all (the model, once) stays well within it.
WIDE = ModelConfig(vocab_size=256, dim=4096, n_layers=8, n_heads=32, ffn_dim=11008, max_seq_len=16)
RANKS = 4
# Beyond its shards, a rank's build may hold two blocks of drawn values and the allocator's slack.
OVERHEAD_BYTES = 2 * 4 * BLOCK_NUMEL + (128 << 20)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no GPU"))])
def test_a_range_drawn_alone_equals_that_range_of_the_whole(device):
    numel, std = 3 * BLOCK_NUMEL + 1000, 0.02
    whole = torch.empty(numel, device=device)
    fill_normal(whole, 0, numel, std, seed=3, name="w")
    assert abs(whole.std().item() - std) < 0.01 * std and abs(whole.mean().item()) < 1e-4
    # Cuts that fall inside blocks, on block edges, and a piece inside one block.
    for lo, hi in ((0, 5), (BLOCK_NUMEL - 7, 2 * BLOCK_NUMEL + 9), (BLOCK_NUMEL, 2 * BLOCK_NUMEL), (17, 4099),
                   (3 * BLOCK_NUMEL, numel)):
        part = torch.empty(hi - lo, device=device)
        fill_normal(part, lo, numel, std, seed=3, name="w")
        assert torch.equal(part, whole[lo:hi]), (lo, hi)
        half = torch.empty(hi - lo, dtype=torch.bfloat16, device=device)  # rounded from the same FP32 values
        fill_normal(half, lo, numel, std, seed=3, name="w")
        assert torch.equal(half, whole[lo:hi].bfloat16()), (lo, hi)
    other = torch.empty(numel, device=device)
    fill_normal(other, 0, numel, std, seed=3, name="v")  # another parameter: other values
    assert not torch.equal(other[:100], whole[:100])


def test_whole_model_init_by_name_follows_the_constructors_distributions():
    cfg = ModelConfig(dim=128, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=16)
    torch.manual_seed(0)
    ref = Llama(cfg)
    with torch.device("meta"):
        model = Llama(cfg)
    model.to_empty(device="cpu")
    init_local_shards(model, model.init_std, seed=11)
    for (name, a), (_, b) in zip(ref.named_parameters(), model.named_parameters()):
        if model.init_std(name) is None:
            assert torch.equal(a, b) and torch.equal(b, torch.ones_like(b)), name
        else:
            assert b.std().item() == pytest.approx(a.std().item(), rel=0.1), name
    with pytest.raises(ValueError, match="no initial distribution known for parameter 'extra'"):
        model.init_std("extra")


def _rss_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", open("/proc/self/status").read()).group(1))


def _zero3_partitions_match(seed: int) -> dict:
    """ZeRO-3 (deepspeed.zero.Init, BF16 as the JSON says): each rank's partitions hold the
    parameter's values drawn whole, rounded to BF16, and zeros past its end."""
    import deepspeed

    from coat_ds.models.sharded_init import local_range
    from coat_ds.train.model_start import ModelStart, build_model

    deepspeed.init_distributed()
    model = build_model(ModelStart("zero3", ""), ModelConfig(dim=66, n_layers=1, n_heads=3, ffn_dim=80),
                        seed, torch.device("cpu"), "ds_configs/coat_zero3.json")
    same, padded = True, 0
    for name, p in model.named_parameters():
        r = local_range(p)
        whole = torch.empty(r.numel)
        std = model.init_std(name)
        if std is None:
            whole.fill_(1.0)
        else:
            fill_normal(whole, 0, r.numel, std, seed, name)
        same &= r.flat.dtype == torch.bfloat16 and torch.equal(r.flat, whole[r.start:r.start + r.flat.numel()].bfloat16())
        if r.padding is not None:
            padded += r.padding.numel()
            same &= not r.padding.any()
    return {"same": bool(same), "padded": padded}


def worker(out: str) -> None:
    """One rank: build the wide model as train.py does (meta_start, FSDP2) and measure; then
    a small one under ZeRO-3."""
    import torch.distributed as dist

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import train
    from coat_ds.models.sharded_init import local_range
    from coat_ds.train.engine_setup import read_ds_settings
    from coat_ds.train.model_start import build_model, model_start

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cfg = train.TrainConfig(engine="fsdp", seed=7)
    start = model_start(cfg, read_ds_settings(cfg.deepspeed, dist.get_world_size()))
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident set (VmHWM) restarts from the current one
    before = _rss_kib("VmRSS")
    runner = train.setup_fsdp_engine(cfg, build_model(start, WIDE, cfg.seed, torch.device("cpu"), cfg.deepspeed))
    growth = (_rss_kib("VmHWM") - before) * 1024
    params = dict(runner.model.named_parameters())
    # This rank's elements of one parameter, against the same parameter drawn whole here.
    name = "blocks.3.attn.wo.weight"
    r = local_range(params[name])
    whole = torch.empty(r.numel)
    fill_normal(whole, 0, r.numel, runner.model.init_std(name), cfg.seed, name)
    result = {"where": start.where, "growth": growth, "local_numel": r.flat.numel(),
              "shard_bytes": sum(local_range(p).flat.numel() * 4 for p in params.values()),
              "same_values": torch.equal(r.flat, whole[r.start:r.start + r.flat.numel()])}
    del runner, params, whole
    result["zero3"] = _zero3_partitions_match(cfg.seed)
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_ranks_hold_their_shards_only(tmp_path):
    from helpers import run_ranks

    run_ranks(__file__, str(tmp_path), timeout=300, nproc=RANKS, DS_ACCELERATOR="cpu")
    full = WIDE.num_params() * 4
    results = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(RANKS)]
    assert sum(r["local_numel"] for r in results) == 4096 * 4096  # the parameter, cut once
    assert results[-1]["zero3"]["padded"] > 0  # 66-element norms: the last ranks' partitions end in padding
    for rank, r in enumerate(results):
        assert r["where"] == "meta" and r["same_values"] and r["zero3"]["same"], (rank, r)
        assert full > 3.9 * r["shard_bytes"]
        # The shards were allocated and written; nothing near the whole model ever was.
        assert 0.9 * r["shard_bytes"] < r["growth"] < r["shard_bytes"] + OVERHEAD_BYTES, (rank, r, full)


if __name__ == "__main__":
    worker(sys.argv[1])
