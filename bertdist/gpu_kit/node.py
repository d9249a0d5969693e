"""The node side of the GPU kit (run by ``KIT/run.sh OUTDIR``): install offline, build, bench.

Steps, each a row of ``OUTDIR/setup.json`` (which the bench's report lists first):
  1. install: ``pip install --no-index --no-deps --target SITE`` of the kit's wheels, then an
     import check of each;
  2. build, in parallel: the bertdist CUDA extension (for the image's architectures) and
     DeepSpeed's fused LAMB op, with the image's core count as compile jobs;
  3. bench: ``bertdist bench --out OUTDIR --kit KIT`` (the kit's records) in a child process, its deadline
     the time left; killed (with its whole process group) if it overruns.

The deadline covers all three. A step that fails is a row, and later steps still run where they
can; if the bench leaves no report, this writes one with the setup rows and the bench's output.
Everything written goes to OUTDIR: env.txt, setup.json, node.log, the report (.md, .json).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_DEADLINE_S = 510.0  # install + build + bench inside 9 minutes, with room to copy the results
BUILD_TIMEOUT_S = 300.0
MARGIN_S = 15.0  # the bench stops this long before the node deadline, to write its report

EXT_BUILD = """
import sys, torch
from bertdist.ops import _extension
try:
    from bertdist import _C as mod
    print("prebuilt bertdist._C")
except ImportError:
    try:
        mod, how = _extension._jit_build()
    except Exception as e:
        text = str(e)
        errors = [ln for ln in text.splitlines() if "error" in ln.lower()][:12]
        print("\\n".join(errors))  # the compiler's own lines first: the row keeps the tail
        print(f"JIT build failed: {type(e).__name__}: {text[-4000:]}")
        print("\\n".join(errors[:6]))
        sys.exit(1)
    print(how)
if torch.cuda.is_available() and not mod.with_cuda():
    print("built without the CUDA kernels")
    sys.exit(1)
"""
LAMB_BUILD = """
import sys
from bertdist.train.optim import build_deepspeed_op
ok, why = build_deepspeed_op("lamb")
print(why)
sys.exit(0 if ok else 1)
"""


class Clock:
    def __init__(self, seconds: float):
        self.t0, self.seconds = time.monotonic(), seconds

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.t0)


def _tail(text: str, n: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-n:])


class Node:
    def __init__(self, kit: Path, out: Path, site: Path, work: Path, jobs: int, archs: str, clock: Clock):
        self.kit, self.out, self.site, self.work, self.jobs, self.archs, self.clock = kit, out, site, work, jobs, archs, clock
        self.rows: list[dict] = []
        self.log = open(out / "node.log", "a", buffering=1)

    def env(self) -> dict:
        """The environment of every child: the kit's site first, then the repository; one build
        folder for our extension and one for DeepSpeed's ops, so the bench reuses both builds."""
        path = os.pathsep.join([str(self.site), str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "MAX_JOBS": str(self.jobs),
                "BERTDIST_CUDA_ARCHS": self.archs, "TORCH_CUDA_ARCH_LIST": self.archs,
                "BERTDIST_JIT_DIR": str(self.work / "jit"), "TORCH_EXTENSIONS_DIR": str(self.work / "torch_extensions")}

    def record(self, step: str, status: str, seconds: float, detail: str) -> dict:
        row = {"step": step, "status": status, "seconds": round(seconds, 1), "detail": detail}
        self.rows.append(row)
        (self.out / "setup.json").write_text(json.dumps({"rows": self.rows}, indent=1) + "\n")
        self.log.write(f"[gpu-kit] {step}: {status} ({seconds:.0f} s) {detail[:2000]}\n")
        print(f"[gpu-kit] {step}: {status} ({seconds:.0f} s) {detail.splitlines()[0] if detail else ''}", flush=True)
        return row

    def run(self, step: str, cmd: list[str], timeout: float) -> dict:
        t0 = time.monotonic()
        if timeout <= 0:
            return self.record(step, "skipped", 0.0, "deadline reached before it could start")
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=self.env(), cwd=REPO)
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            return self.record(step, "failed", time.monotonic() - t0, f"timed out after {timeout:.0f} s\n{_tail(out)}")
        except OSError as e:
            return self.record(step, "failed", time.monotonic() - t0, f"{type(e).__name__}: {e}")
        self.log.write(p.stdout + p.stderr)
        status = "ok" if p.returncode == 0 else "failed"
        detail = _tail(p.stdout + p.stderr, 3 if status == "ok" else 25)
        return self.record(step, status, time.monotonic() - t0, (f"exit {p.returncode}: " if status != "ok" else "") + detail)

    # ------------------------------------------------------------------ steps

    def install(self) -> None:
        kit = json.loads((self.kit / "kit.json").read_text())
        wheels = [str(self.kit / w["file"]) for w in kit["wheels"]]
        if not wheels:
            self.record("install", "ok", 0.0, "the image has everything: no wheel to install")
            return
        self.site.mkdir(parents=True, exist_ok=True)
        self.run("install", [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                             "--disable-pip-version-check", "--upgrade", "--target", str(self.site), *wheels],
                 min(180.0, self.clock.left()))
        # each shipped wheel's import name is its distribution name with '_' for '-'; a wheel where
        # that does not hold fails here, by name
        names = [w["name"].replace("-", "_") for w in kit["wheels"]]
        check = ("import importlib, sys\nbad = []\nfor m in sys.argv[1:]:\n    try:\n        importlib.import_module(m)\n"
                 "    except Exception as e:\n        bad.append(f'{m}: {type(e).__name__}: {e}')\n"
                 "print('\\n'.join(bad) or 'all import: ' + ', '.join(sys.argv[1:]))\nsys.exit(1 if bad else 0)")
        self.run("import check", [sys.executable, "-c", check, *names], min(120.0, self.clock.left()))

    def build(self, cuda: bool) -> None:
        """Our extension and DeepSpeed's fused LAMB, built at the same time."""
        timeout = min(BUILD_TIMEOUT_S, self.clock.left() - 60)
        steps = [("build bertdist extension", EXT_BUILD)]
        if cuda:
            steps.append(("build DeepSpeed fused LAMB", LAMB_BUILD))
        else:
            self.record("build DeepSpeed fused LAMB", "skipped", 0.0, "no CUDA device: the op is CUDA-only")
        if timeout <= 0:
            for name, _ in steps:
                self.record(name, "skipped", 0.0, "deadline reached before it could start")
            return
        procs = []
        for name, code in steps:
            procs.append((name, time.monotonic(), subprocess.Popen(
                [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                env=self.env(), cwd=REPO, start_new_session=True)))
        for name, t0, p in procs:
            try:
                out, _ = p.communicate(timeout=max(1.0, timeout - (time.monotonic() - t0)))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                out, _ = p.communicate()
                self.record(name, "failed", time.monotonic() - t0, f"timed out after {timeout:.0f} s\n{_tail(out or '')}")
                continue
            self.log.write(out)
            ok = p.returncode == 0
            self.record(name, "ok" if ok else "failed", time.monotonic() - t0,
                        ("" if ok else f"exit {p.returncode}: ") + _tail(out, 2 if ok else 25))

    def bench(self, extra: list[str]) -> int:
        left = self.clock.left() - MARGIN_S
        if left < 30:
            self.record("bench", "skipped", 0.0, f"{max(left, 0):.0f} s left of the deadline")
            return 1
        cmd = [sys.executable, "-m", "bertdist.cli.main", "bench", "--out", str(self.out), "--deadline-s", f"{left:.0f}",
               "--kit", str(self.kit), "--setup-json", str(self.out / "setup.json"), *extra]
        self.log.write(f"[gpu-kit] {' '.join(cmd)}\n")
        t0 = time.monotonic()
        p = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env(), cwd=REPO,
                             start_new_session=True)
        try:
            rc = p.wait(timeout=left + MARGIN_S / 2)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            rc = -9
        seconds = time.monotonic() - t0
        reports = sorted(self.out.glob("acceptance_*.md"))
        print(f"[gpu-kit] bench exit {rc} after {seconds:.0f} s; report: {', '.join(map(str, reports)) or 'none'}", flush=True)
        if not reports:
            self.fallback_report(rc, seconds)
        return rc

    def fallback_report(self, rc: int, seconds: float) -> None:
        """The bench died before its first report: the setup rows and its output, in the report's place."""
        log = (self.out / "node.log").read_text(errors="replace")
        lines = ["# GPU acceptance: the bench wrote no report", "",
                 f"The bench exited {rc} after {seconds:.0f} s without a report.", "",
                 "| step | status | seconds | detail |", "|---|---|---:|---|"]
        lines += [f"| {r['step']} | {r['status']} | {r['seconds']} | {r['detail'].splitlines()[0] if r['detail'] else ''} |"
                  for r in self.rows]
        lines += ["", "## Output (tail)", "", "```", _tail(log, 80), "```"]
        (self.out / "acceptance_bench-failed.md").write_text("\n".join(lines) + "\n")


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """This script's options, and the rest: the bench's own, passed through."""
    # allow_abbrev off: the bench's --skip must not be taken for --skip-build
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--kit", required=True, help="the kit folder (holds kit.json)")
    ap.add_argument("--out", required=True, help="where everything is written")
    ap.add_argument("--deadline-s", type=float, default=DEFAULT_DEADLINE_S,
                    help=f"install + build + bench (default {DEFAULT_DEADLINE_S:.0f})")
    ap.add_argument("--site", default="/tmp/bertdist-gpu-kit/site", help="where the wheels are installed")
    ap.add_argument("--work", default="/tmp/bertdist-gpu-kit/build", help="build folders")
    ap.add_argument("--quick", action="store_true", help="the bench's quick variant (small models)")
    ap.add_argument("--skip-build", action="store_true", help="no ahead-of-time builds (the bench JIT-builds)")
    return ap.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    args, bench_extra = parse_args(argv)
    clock = Clock(args.deadline_s)
    kit, out = Path(args.kit).resolve(), Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    from bertdist.gpu_kit.image import load_image

    image = load_image(kit / "image.yaml")
    jobs = min(image.cores, os.cpu_count() or 1)
    node = Node(kit, out, Path(args.site), Path(args.work), jobs, image.torch_cuda_archs, clock)
    try:
        import torch

        cuda = torch.cuda.is_available()
    except Exception as e:  # noqa: BLE001 - the bench's own row will say what broke
        node.record("torch", "failed", 0.0, f"{type(e).__name__}: {e}")
        cuda = False
    node.install()
    if args.skip_build:
        node.record("build", "skipped", 0.0, "--skip-build")
    else:
        node.build(cuda)
    rc = node.bench(["--quick"] * args.quick + bench_extra)
    failed = [r["step"] for r in node.rows if r["status"] == "failed"]
    print(f"[gpu-kit] done in {args.deadline_s - clock.left():.0f} s; failed setup steps: {failed or 'none'}; "
          f"bench exit {rc}", flush=True)
    return 1 if failed or rc != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
