"""A real checkpointing worker for the requeue test of the SLURM script's preemption path:
each rank counts steps (0.2 s each), saves its step every --every steps and on SIGTERM,
and starts from its saved step. Independent of the trainer, so the script's
SIGTERM -> checkpoint -> requeue -> resume loop is tested on its own."""
import json
import os
import signal
import sys
import time
from pathlib import Path

out, total, every = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
rank = int(os.environ["RANK"])
ckpt = out / f"ckpt-{rank}.json"
events = out / f"events-{rank}.jsonl"
stop = False


def on_term(*_):
    global stop
    stop = True


signal.signal(signal.SIGTERM, on_term)
step = json.loads(ckpt.read_text())["step"] if ckpt.exists() else 0


def log(**kw):
    with events.open("a") as f:
        f.write(json.dumps({"rank": rank, "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0")), **kw}) + "\n")


def save(step):
    tmp = ckpt.with_suffix(".tmp")
    tmp.write_text(json.dumps({"step": step}))
    os.replace(tmp, ckpt)


log(event="start", step=step, world=int(os.environ["WORLD_SIZE"]))
while step < total:
    if stop:
        save(step)
        log(event="sigterm_checkpoint", step=step)
        sys.exit(0)
    time.sleep(0.2)
    step += 1
    log(event="step", step=step)
    if step % every == 0:
        save(step)
save(step)
log(event="done", step=step)
