"""train.py under NCCL on every GPU of the machine (FSDP2, CoatAdamW, the 125m preset): a rank
SIGKILLed mid-run with no launcher watching (the survivors must end within the heartbeat bound,
naming it), a rank SIGKILLed inside a checkpoint save under torchrun, then resumes on all GPUs
(bit for bit against an uninterrupted run) and on half of them (DCP reshards).
Run: bash bench/device_env.sh python results/2026-11-28b/nccl_faults.py OUT_DIR"""
import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.getcwd()
OUT = sys.argv[1] if len(sys.argv) > 1 else "/tmp/nccl_faults"
N = int(os.environ.get("NGPU", "4"))
STEPS = int(os.environ.get("STEPS", "60"))
BASE = ["train.py", "--fsdp", "--preset", os.environ.get("PRESET", "125m"), "--seq-len", os.environ.get("SEQ", "512"), "--log-interval", "1", "--eval-interval", "0",
        "--eval-batches", "2", "--max-data-bytes", "8000000", "--warmup-steps", "2"]
rows = []


def torchrun(nproc, port, *flags, env=None, log):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(port),
           *BASE, *flags]
    return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT)


def losses(path):
    out = {}
    for line in open(path) if os.path.exists(path) else []:
        try:
            m = json.loads(line)
        except ValueError:  # a line being written
            continue
        if "loss" in m:
            out[m["step"]] = m["loss"]
    return out


def tail(log, n=6):
    return [line.rstrip()[:240] for line in open(log) if line.strip()][-n:]


os.makedirs(OUT, exist_ok=True)
t0 = time.monotonic()

# 1. The uninterrupted reference, all GPUs.
ref = torchrun(N, 29601, "--max-steps", str(STEPS), "--metrics-file", f"{OUT}/ref.jsonl", log=f"{OUT}/ref.log")
print("ref exit", ref.wait(), f"({time.monotonic() - t0:.0f} s)", flush=True)
ref_loss = losses(f"{OUT}/ref.jsonl")

# 2. No launcher (as on several machines): N ranks started by hand; rank N-1 SIGKILLed after the
#    step-4 checkpoint exists and step 6 is logged, mid-training. The survivors must exit within the heartbeat bound.
save = f"{OUT}/ckpt"
procs = []
for rank in range(N):
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29602", "RANK": str(rank),
           "LOCAL_RANK": str(rank), "WORLD_SIZE": str(N), "LOCAL_WORLD_SIZE": str(N)}
    procs.append(subprocess.Popen([sys.executable, *BASE, "--max-steps", str(STEPS), "--save-dir", save,
                                   "--save-interval", "4", "--heartbeat-timeout-s", "10", "--dist-timeout-s", "120",
                                   "--metrics-file", f"{OUT}/killed_rank{rank}.jsonl"], cwd=ROOT, env=env,
                                  stdout=open(f"{OUT}/killed_rank{rank}.log", "w"), stderr=subprocess.STDOUT))
deadline = time.monotonic() + 150
while time.monotonic() < deadline and not (os.path.exists(f"{save}/step4/coat_ds_checkpoint.json") and max(
        losses(f"{OUT}/killed_rank0.jsonl"), default=0) >= 6):
    time.sleep(0.02)
procs[-1].send_signal(signal.SIGKILL)
killed = time.monotonic()
codes = []
for p in procs[:-1]:
    try:
        codes.append(p.wait(max(1.0, killed + 90 - time.monotonic())))
    except subprocess.TimeoutExpired:
        codes.append("still running after 90 s")
took = time.monotonic() - killed
for p in procs:
    if p.poll() is None:
        p.kill()
fatal = [line for line in tail(f"{OUT}/killed_rank0.log", 40) if "FATAL" in line or "relaunch" in line]
rows.append(("SIGKILL rank %d mid-run, no launcher" % (N - 1), f"survivors' exits {codes} {took:.1f} s after the kill",
             fatal[0] if fatal else "no FATAL line: " + " / ".join(tail(f"{OUT}/killed_rank0.log", 3))))

# 3. Resume that folder on all GPUs to STEPS: same world size, so the same losses bit for bit.
res = torchrun(N, 29603, "--max-steps", str(STEPS), "--resume", save, "--metrics-file", f"{OUT}/resume_all.jsonl",
               log=f"{OUT}/resume_all.log")
code = res.wait()
got = losses(f"{OUT}/resume_all.jsonl")
same = [s for s in got if s in ref_loss and got[s] == ref_loss[s]]
rows.append((f"resume on {N} GPUs", f"exit {code}; steps {min(got, default=None)}..{max(got, default=None)}",
             f"{len(same)}/{len(got)} losses equal to the reference bit for bit"))

# 4. Resume the same checkpoint on half the GPUs (DCP reshards).
half = max(1, N // 2)
res = torchrun(half, 29604, "--max-steps", str(STEPS), "--resume", f"{save}/step4", "--metrics-file",
               f"{OUT}/resume_half.jsonl", log=f"{OUT}/resume_half.log")
code = res.wait()
got = losses(f"{OUT}/resume_half.jsonl")
rows.append((f"resume step4 on {half} GPUs", f"exit {code}",
             f"loss at {STEPS}: {got.get(STEPS)} (reference on {N}: {ref_loss.get(STEPS)})"))

# 5. torchrun; rank 1 paused as it starts writing its data file of step 8, then SIGKILLed there.
save2, pidfile = f"{OUT}/ckpt_save_kill", f"{OUT}/paused.pid"
run = torchrun(N, 29605, "--max-steps", str(STEPS), "--save-dir", save2, "--save-interval", "4", "--metrics-file",
               f"{OUT}/save_kill.jsonl", log=f"{OUT}/save_kill.log",
               env={"COAT_DS_CKPT_FAULT": f"rank=1,ckpt=step8,file=.distcp,action=pause,pidfile={pidfile}"})
deadline = time.monotonic() + 150
while not os.path.exists(pidfile) and run.poll() is None and time.monotonic() < deadline:
    time.sleep(0.05)
if os.path.exists(pidfile):
    os.kill(int(open(pidfile).read()), signal.SIGKILL)
killed = time.monotonic()
try:
    code = run.wait(90)
except subprocess.TimeoutExpired:
    code = "still running after 90 s"
    run.kill()
left = sorted(os.listdir(save2)) if os.path.isdir(save2) else []
rows.append(("SIGKILL rank 1 inside the step-8 save, torchrun", f"exit {code} {time.monotonic() - killed:.1f} s after",
             f"save folder: {left}"))

# 6. Resume it on all GPUs: the torn step 8 skipped, step 4 resumed, losses bit for bit.
res = torchrun(N, 29606, "--max-steps", str(STEPS), "--resume", save2, "--save-dir", save2, "--metrics-file",
               f"{OUT}/resume_save_kill.jsonl", log=f"{OUT}/resume_save_kill.log")
code = res.wait()
got = losses(f"{OUT}/resume_save_kill.jsonl")
same = [s for s in got if s in ref_loss and got[s] == ref_loss[s]]
skipped = [line for line in tail(f"{OUT}/resume_save_kill.log", 200) if "skipping" in line or "resumed from" in line]
rows.append((f"resume after the torn save on {N} GPUs", f"exit {code}; {' | '.join(skipped)[:200]}",
             f"{len(same)}/{len(got)} losses equal to the reference bit for bit"))

print(f"\n# {N} ranks, train.py --fsdp (FSDP2), {BASE[3]} preset, seq {BASE[5]}, {STEPS} steps; "
      f"{time.monotonic() - t0:.0f} s in all")
print("| fault | what happened | check |\n|---|---|---|")
for r in rows:
    print("| " + " | ".join(str(c).replace("|", "/") for c in r) + " |")
