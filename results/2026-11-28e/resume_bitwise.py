"""A resume at the same world size against an uninterrupted run, on GPUs, deterministic kernels:
train.py --fsdp (FSDP2) --recipe speed --compile, 125m preset, a 32,000-id BPE of torch's Python
sources. ref: 60 steps; saved: the same with saves at steps 30 and 60 (also a second run of ref:
determinism); resumed: --resume saved/step30 to step 60. Prints which steps' losses are equal.
Run: bash bench/device_env.sh python results/2026-11-28e/resume_bitwise.py OUT_DIR"""
import glob, json, os, subprocess, sys, sysconfig, time

OUT = sys.argv[1] if len(sys.argv) > 1 else "/tmp/resume_bitwise"
N = int(os.environ.get("NGPU", "2"))
os.makedirs(OUT, exist_ok=True)
sys.path.insert(0, "bench")
from scaling import with_micro_batch  # noqa: E402

data = os.path.join(sysconfig.get_paths()["purelib"], "torch", "**", "*.py")
BASE = ["train.py", "--fsdp", "--deepspeed", with_micro_batch("coat_zero3", 8), "--preset", "125m", "--seq-len", "1024",
        "--data", data, "--tokenizer", "bpe", "--bpe-vocab-size", "32000", "--max-data-bytes", "30000000",
        "--data-cache", f"{OUT}/cache", "--max-steps", "60", "--warmup-steps", "5", "--log-interval", "1",
        "--eval-interval", "0", "--eval-batches", "1", "--compile", "--recipe", "speed", "--deterministic"]


def launch(name, *flags):
    t0 = time.time()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(N), "--master_port", "29631",
           *BASE, "--metrics-file", f"{OUT}/{name}.jsonl", *flags]
    code = subprocess.call(cmd, stdout=open(f"{OUT}/{name}.log", "w"), stderr=subprocess.STDOUT)
    print(f"{name}: exit {code} ({time.time() - t0:.0f} s)", flush=True)
    if code:
        print("".join(open(f"{OUT}/{name}.log").readlines()[-8:]))
    return {m["step"]: m["loss"] for m in map(json.loads, open(f"{OUT}/{name}.jsonl")) if "loss" in m} \
        if os.path.exists(f"{OUT}/{name}.jsonl") else {}


ref = launch("ref")
saved = launch("saved", "--save-dir", f"{OUT}/ckpt", "--save-interval", "30")
resumed = launch("resumed", "--resume", f"{OUT}/ckpt/step30")
for name, got, lo in (("saved vs ref (determinism)", saved, 1), ("resumed vs ref", resumed, 31)):
    steps = [s for s in sorted(got) if s >= lo and s in ref]
    same = [s for s in steps if got[s] == ref[s]]
    diff = [(s, ref[s], got[s]) for s in steps if got[s] != ref[s]][:3]
    print(f"| {name} | {len(same)}/{len(steps)} steps equal bit for bit | first differences {diff} |")
print("ref loss at 1, 30, 60:", ref.get(1), ref.get(30), ref.get(60))
