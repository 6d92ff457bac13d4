"""Forward + backward time of the 350m preset (coat_ds.model, 304M, 12 x 1024 tokens, BF16
autocast, one GPU) without and with FP8 activation compression, eager or every block
compiled: the step-time cost of the hooks on our own model, optimizer left out.

    python bench/act_step.py eager
    python bench/act_step.py compile

Median of 17 steps after 8 warm-up steps; "host" is the time until backward() returns.
"""
import time, torch, statistics, sys
import coat_ds
from coat_ds.model import Llama, model_config
dev = "cuda"
mode = sys.argv[1]
for compress in (False, True):
    torch.manual_seed(0)
    model = Llama(model_config("350m", max_seq_len=1024)).to(dev)
    h = coat_ds.compress_activations(model) if compress else None
    if mode == "compile":
        for b in model.blocks:
            b.compile()
    x = torch.randint(0, 256, (12, 1024), device=dev); y = torch.randint(0, 256, (12, 1024), device=dev)
    fb = []; host = []
    for i in range(25):
        torch.cuda.synchronize(); t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward(); t1 = time.perf_counter()
        torch.cuda.synchronize(); t2 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        if i >= 8:
            fb.append((t2 - t0) * 1e3); host.append((t1 - t0) * 1e3)
    print(f"{mode} compress={compress}: fwd+bwd {statistics.median(fb):.1f} ms (host {statistics.median(host):.1f})", flush=True)
    if h: h.remove()
    del model
