import sys; sys.path.insert(0, "bench")
import torch, coat_ds
import fp8_linear as B
for fresh in (False, True):
    torch.manual_seed(0)
    model, opt = B.build("1b", "coat_fp8_nocomp_fmlp_headloss", 2048, True)
    mods = [m for m in model.modules() if isinstance(m, coat_ds.Fp8Linear)]
    ids = torch.randint(0, model.config.vocab_size, (8, 2048), device="cuda")
    out = []
    for step in range(10):
        if fresh:
            ids = torch.randint(0, model.config.vocab_size, (8, 2048), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
        g = [m.fp8_grad_guess for m in mods if m.fp8_grad_guess[1].item() != 0]
        h = [m.fp8_input_guess for m in mods if m.fp8_input_guess[1].item() != 0]
        out.append("%d: loss %.2f h missed %d/%d, dgate/dup missed %d/%d" % (step, loss.item(), sum(int(s[0] != s[2]) for s in h), len(h), sum(int(s[0] != s[2]) for s in g), len(g)))
    print("fresh batches" if fresh else "one batch (the bench)"); print("\n".join(out))
