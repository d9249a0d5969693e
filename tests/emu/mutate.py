"""Mutation tests of the emulated-kernel suite: each class of CUDA bug below, injected into a copy
of csrc/ one at a time, must make `make emu-test` fail.

    python tests/emu/mutate.py [--only NAME[,NAME...]] [--skip-survivors] [--jobs N] [--record] [--list]

A mutant is an exact edit of one source file; the script first checks that its text occurs
exactly once, so a kernel change that moves the text stops the script with a clear message
instead of silently testing nothing. Each worker copies csrc/ to a scratch folder, runs
`make emu-check` on the unmutated copy (the baseline: it must pass), then for each of its
mutants writes the edit and runs `make emu-test EMU_CSRC=<copy> EMU_BUILD=<its build>`: the
standalone driver first (incremental: only the edited file's objects are rebuilt), then, if the
driver passed, the Python-level tests against an extension built from the mutant. A mutant is
killed only when a kernel check fails (a driver check or a pytest test). A mutant that does not
build, one that runs past the time limit and a make that fails otherwise (a crashed driver) are
reported as such, never as kills: none of them shows that a check catches the bug. Mutants
marked `survives` document what the emulator cannot see; the script fails if one of them is
killed too (then the note is stale) or if any other mutant is not killed.
A survivor costs the most (the driver passes, so the extension is built from it and the Python
tests run): --skip-survivors leaves them out of a quick run.

--record writes benchmarks/results/emu_mutations_<date>.md: every mutant, killed or not, by
which check, how long it took, and the command.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CSRC = REPO / "csrc"
TIMEOUT_S = 600  # a mutant still running then is reported as a timeout, not as a kill
RESULTS = ("killed", "survived", "build failure", "timeout", "error")


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    bug: str  # the bug class, as a reviewer would name it
    file: str  # relative to csrc/
    old: str
    new: str
    survives: str = ""  # why the emulator cannot catch it, for the known survivors


MUTANTS = (
    Mutant("attn_fwd_tile_loop_syncthreads", "missing __syncthreads in the tile loop: the next K/V tile overwrites "
           "shared memory other warps still read", "cuda_attention.cu",
           "    __syncthreads();  // the previous tile is consumed\n", ""),
    Mutant("attn_dq_load_syncthreads", "missing __syncthreads between loading a tile and reading it (dQ)",
           "cuda_attention.cu", "    __syncthreads();\n    const int jmax = min(BK, s.len - k0);\n",
           "    const int jmax = min(BK, s.len - k0);\n"),
    Mutant("attn_dkdv_syncwarp_1", "missing __syncwarp in dK/dV: P and dS read before every lane wrote them",
           "cuda_attention.cu", "      Sw[warp * kBQ2 + lane] = ds;\n      __syncwarp();\n",
           "      Sw[warp * kBQ2 + lane] = ds;\n"),
    Mutant("attn_dkdv_syncwarp_2", "missing __syncwarp in dK/dV: the next key overwrites P and dS still being read",
           "cuda_attention.cu",
           "          dk[kk][c] = fmaf(sw, Qs[ii * QP + lane + 32 * c], dk[kk][c]);\n        }\n      }\n"
           "      __syncwarp();\n",
           "          dk[kk][c] = fmaf(sw, Qs[ii * QP + lane + 32 * c], dk[kk][c]);\n        }\n      }\n"),
    Mutant("attn_fwd_smem_pitch", "wrong shared-memory pitch: K stored with pitch D, read with D + 1",
           "cuda_attention.cu", "load_tile<T, D, BK>(Ks, D + 1, p.k, p, b, h, s, k0);\n    load_tile<T, D, BK>(Vs, D, p.v",
           "load_tile<T, D, BK>(Ks, D, p.k, p, b, h, s, k0);\n    load_tile<T, D, BK>(Vs, D, p.v"),
    Mutant("attn_fwd_shuffle_in_lane_lt_16", "shuffle inside if (lane < 16): half the warp skips the row max",
           "cuda_attention.cu", "      tmax = warp_max(tmax);\n", "      if (lane < 16) tmax = warp_max(tmax);\n"),
    Mutant("attn_dkdv_dropout_column", "dropout mask regenerated at the wrong key in the backward (dK/dV)",
           "cuda_attention.cu", "static_cast<uint32_t>(k0 + jl), threshold)",
           "static_cast<uint32_t>(k0 + jl + 1), threshold)"),
    Mutant("attn_key_padding_ignored", "key padding treated as a real key", "cuda_attention.cu",
           "  if (p.key_mask && !p.key_mask[b * p.mask_stride_b + j]) return 1.f;",
           "  if (p.key_mask && !p.key_mask[b * p.mask_stride_b + j]) return 2.f;"),
    Mutant("attn_varlen_stats_row", "varlen: softmax statistics row ignores the sequence's start", "cuda_attention.cu",
           "static_cast<int64_t>(h) * p.total_tokens + s0};", "static_cast<int64_t>(h) * p.total_tokens};"),
    Mutant("attn_fwd_syncwarp_1", "missing __syncwarp in the forward between the probabilities' write and read",
           "cuda_attention.cu", "      m[rr] = mnew;\n      __syncwarp();\n", "      m[rr] = mnew;\n",
           survives="the warp_sum shuffle between that write and read is a rendezvous of all 32 lanes, and the "
                    "emulator's memory is sequentially consistent: it cannot model a GPU that reorders the shared "
                    "-memory accesses around a shuffle"),
    Mutant("block_sum2_middle_barrier", "missing middle barrier of block_sum2: warp 0 reads the per-warp partials "
           "before the other warps wrote them", "cuda_common.cuh",
           "    smem[33 + w] = b;\n  }\n  __syncthreads();\n", "    smem[33 + w] = b;\n  }\n"),
    Mutant("block_sum2_last_barrier", "missing last barrier of block_sum2: the total read before warp 0 wrote it",
           "cuda_common.cuh", "      smem[65] = tb;\n    }\n  }\n  __syncthreads();\n",
           "      smem[65] = tb;\n    }\n  }\n"),
    Mutant("warp_sum_partial_mask", "partial shuffle mask: warp_sum over half a warp", "cuda_common.cuh",
           "v += __shfl_xor_sync(0xffffffffu, v, o);", "v += __shfl_xor_sync(0x0000ffffu, v, o);"),
    Mutant("ln_fwd_vector_bound", "off-by-one vector bound: the layer-norm forward reads one vector past the row",
           "cuda_layer_norm.cu",
           "    if (vi >= nvec) continue;\n    const int64_t off = base + static_cast<int64_t>(vi) * VEC;\n"
           "    Vec<T, VEC> xv",
           "    if (vi > nvec) continue;\n    const int64_t off = base + static_cast<int64_t>(vi) * VEC;\n"
           "    Vec<T, VEC> xv"),
    Mutant("ln_aligned16_always_true", "always-true alignment test: 16-byte vector loads on misaligned rows",
           "cuda_layer_norm.cu",
           "bool aligned16(const void* ptr) { return ptr == nullptr || (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }",
           "bool aligned16(const void* ptr) { return (void)ptr, true; }"),
    Mutant("ln_layout_thread_rounding", "too few threads for the row: the last vectors never normalised",
           "cuda_layer_norm.cu", "((nvec + nv - 1) / nv + 31) / 32 * 32", "(nvec / nv + 31) / 32 * 32"),
    Mutant("ln_column_sum_drops_a_part", "the backward's column sums drop the last block's partial",
           "cuda_layer_norm.cu", "for (int i = 0; i < parts; ++i) s += src", "for (int i = 0; i + 1 < parts; ++i) s += src"),
    Mutant("launch_no_pending_error_check", "no check before a launch: an earlier operation's error is reported "
           "under our kernel's name", "cuda_common.cuh",
           "  const cudaError_t e = cudaPeekAtLastError();\n  if (e != cudaSuccess)\n",
           "  const cudaError_t e = cudaSuccess;\n  if (e != cudaSuccess)\n"),
    Mutant("max_threads_not_cached", "kernel attributes queried at every launch", "cuda_layer_norm.cu",
           "  static PerKernelDevice cache;\n", "  PerKernelDevice cache;\n"),
    Mutant("flat_lamb_trust_unclamped", "LAMB trust ratio not clamped to [min_coeff, max_coeff]",
           "cuda_flat_optim.cu", "fminf(fmaxf(w_norm / u_norm, p.min_coeff), p.max_coeff)", "w_norm / u_norm"),
    Mutant("flat_lamb_trust_inverted", "LAMB trust ratio ||u|| / ||p|| instead of ||p|| / ||u||", "cuda_flat_optim.cu",
           "fmaxf(w_norm / u_norm, p.min_coeff)", "fmaxf(u_norm / w_norm, p.min_coeff)"),
    Mutant("flat_norm_drops_last_chunk", "the gradient norm leaves out each segment's last chunk",
           "cuda_flat_optim.cu", "c < p.seg.chunk_offsets[s + 1]; ++c) a += p.partial[c];",
           "c + 1 < p.seg.chunk_offsets[s + 1]; ++c) a += p.partial[c];"),
    Mutant("flat_lamb_apply_one_chunk", "the trust ratio from the block's own chunk, not its whole segment",
           "cuda_flat_optim.cu", "for (int64_t c = p.seg.chunk_offsets[r.seg] + threadIdx.x; c < p.seg.chunk_offsets[r.seg + 1];",
           "for (int64_t c = blockIdx.x + threadIdx.x; c < blockIdx.x + 1;"),
)
REPRESENTATIVE = ("attn_fwd_tile_loop_syncthreads", "attn_dkdv_syncwarp_2", "attn_fwd_shuffle_in_lane_lt_16")


@dataclasses.dataclass
class Outcome:
    mutant: Mutant
    result: str  # one of RESULTS
    by: str  # the failing check; else what make said (the build error, the timeout, its last line)
    seconds: float

    @property
    def killed(self) -> bool:
        return self.result == "killed"


def check_texts(mutants) -> None:
    for m in mutants:
        n = (CSRC / m.file).read_text().count(m.old)
        if n != 1:
            raise SystemExit(f"mutant {m.name}: its text occurs {n} times in csrc/{m.file} (must be once); "
                             "update the mutant to the current source")


@dataclasses.dataclass
class MakeRun:
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool = False


def _make(args: list[str], jobs: int) -> MakeRun:
    env = {**os.environ, "MAX_JOBS": str(jobs)}
    cmd = ["make", "--no-print-directory", "-C", str(REPO), f"PY={sys.executable}", *args]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=TIMEOUT_S)
        return MakeRun(r.returncode, r.stdout, r.stderr)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return MakeRun(-1, out, f"timed out after {TIMEOUT_S} s", timed_out=True)


def _first_failure(r: MakeRun) -> str:
    lines = (r.stdout + "\n" + r.stderr).splitlines()
    for prefix in ("FAILED ", "ERROR tests/", "emu build: ", "E   "):
        for line in lines:
            if line.startswith(prefix):
                return line[:300]
    tail = [line for line in lines if line.strip()]
    return (tail[-1] if tail else f"make exited {r.returncode}")[:300]


def classify(r: MakeRun) -> tuple[str, str]:
    """(result, detail) of one `make emu-test`: "killed" only when a kernel check failed (the
    driver's FAILED lines and failed count, pytest's FAILED/ERROR lines)."""
    if r.timed_out:
        return "timeout", r.stderr.strip()
    if r.returncode == 0:
        return "survived", "make emu-test passed"
    lines = (r.stdout + "\n" + r.stderr).splitlines()
    failed_check = next((line for line in lines if line.startswith(("FAILED ", "ERROR tests/"))), None)
    driver_failed = any(re.match(r"\d+ passed, [1-9]\d* failed", line) for line in lines)
    if failed_check or driver_failed:
        return "killed", _first_failure(r)
    if any(line.startswith("emu build: ") for line in lines):
        return "build failure", _first_failure(r)
    return "error", f"make exited {r.returncode} without a failing check: {_first_failure(r)}"


def run_worker(mutants, jobs: int, scratch: Path, baseline: bool = True) -> list[Outcome]:
    """One copy of csrc/ and one build folder for a batch of mutants, in order. `baseline`: run
    the checks on the unmutated copy first (else only build it, when the caller checked them)."""
    copy, build = scratch / "csrc", scratch / "build"
    shutil.copytree(CSRC, copy)
    if baseline:
        base = _make(["emu-check", f"EMU_CSRC={copy}", f"EMU_BUILD={build}"], jobs)
    else:
        base = subprocess.run([sys.executable, "-m", "bertdist.ops._emu_build", "driver", "--csrc", str(copy),
                               "--out", str(build)], cwd=REPO, capture_output=True, text=True,
                              env={**os.environ, "MAX_JOBS": str(jobs)})
    if base.returncode != 0:
        raise RuntimeError(f"the unmutated sources fail `make emu-check`: {_first_failure(base)}\n{base.stdout[-3000:]}")
    out, dirty = [], None
    for m in mutants:
        if dirty is not None and dirty != m.file:  # undo the previous mutant (a fresh mtime: make rebuilds)
            (copy / dirty).write_text((CSRC / dirty).read_text())
        text = (CSRC / m.file).read_text()
        (copy / m.file).write_text(text.replace(m.old, m.new))
        dirty = m.file
        t0 = time.perf_counter()
        r = _make(["emu-test", f"EMU_CSRC={copy}", f"EMU_BUILD={build}"], jobs)
        secs = time.perf_counter() - t0
        result, by = classify(r)
        out.append(Outcome(m, result, by, secs))
        print(f"{result.upper():13} {m.name} ({secs:.0f} s): {by}", flush=True)
    return out


def run(mutants, jobs: int, baseline: bool = True) -> tuple[list[Outcome], float]:
    check_texts(mutants)
    t0 = time.perf_counter()
    # Mutants of one file stay together: each switch of file rebuilds one more object.
    ordered = sorted(mutants, key=lambda m: m.file)
    batches = [ordered[i::jobs] for i in range(jobs)] if jobs > 1 else [ordered]
    batches = [b for b in batches if b]
    with tempfile.TemporaryDirectory(prefix="bertdist-mutants-") as tmp:
        with ThreadPoolExecutor(len(batches)) as pool:
            futures = [pool.submit(run_worker, b, 1 if len(batches) > 1 else 2, Path(tmp) / f"w{i}", baseline)
                       for i, b in enumerate(batches)]
            outcomes = [o for f in futures for o in f.result()]
    order = {m.name: i for i, m in enumerate(mutants)}
    outcomes.sort(key=lambda o: order[o.mutant.name])
    return outcomes, time.perf_counter() - t0


def verdict(outcomes) -> list[str]:
    """The problems with a run: mutants no check caught (survivors, build failures, timeouts,
    errors), and known survivors that were killed or did not run to the end."""
    bad = []
    for o in outcomes:
        if o.mutant.survives:
            if o.killed:
                bad.append(f"{o.mutant.name} was killed although marked as a known survivor ({o.by}): update its note")
            elif o.result != "survived":
                bad.append(f"{o.mutant.name} (a known survivor): {o.result}: {o.by}")
        elif o.result == "survived":
            bad.append(f"{o.mutant.name} survived: {o.mutant.bug}")
        elif not o.killed:
            bad.append(f"{o.mutant.name}: {o.result}, not caught by a check ({o.by}); fix the mutant or the run")
    return bad


def record(outcomes, seconds: float, command: str) -> Path:
    today = datetime.date.today().isoformat()
    path = REPO / "benchmarks" / "results" / f"emu_mutations_{today}.md"
    killed = sum(o.killed for o in outcomes)
    others = {r: sum(o.result == r for o in outcomes) for r in ("build failure", "timeout", "error")}
    lines = [
        f"# Mutation tests of the emulated CUDA kernels ({today})",
        "",
        f"Command: `{command}` (from the repository root). Machine: {platform.machine()}, {os.cpu_count()} cores "
        f"(shared), {platform.python_implementation()} {platform.python_version()}.",
        "",
        f"Score: **{killed} of {len(outcomes)} mutants killed** by a failing check of `make emu-test`; "
        f"{sum(bool(o.mutant.survives) for o in outcomes)} known survivor(s), explained below; "
        f"{others['build failure']} build failure(s), {others['timeout']} timeout(s) and {others['error']} other "
        "error(s), none of them counted as kills. "
        f"Wall time {seconds:.0f} s for the whole set (builds included).",
        "",
        "| mutant | bug class | file | result | caught by | seconds |",
        "|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        by = o.by.replace("|", "\\|")
        lines.append(f"| `{o.mutant.name}` | {o.mutant.bug} | {o.mutant.file} | {o.result} | {by} | "
                     f"{o.seconds:.0f} |")
    survivors = [o for o in outcomes if o.mutant.survives]
    if survivors:
        lines += ["", "Known survivors:"] + [f"- `{o.mutant.name}`: {o.mutant.survives}." for o in survivors]
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma-separated mutant names (default: all)")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="mutants built and run in parallel")
    ap.add_argument("--record", action="store_true", help="write benchmarks/results/emu_mutations_<date>.md")
    ap.add_argument("--skip-survivors", action="store_true", help="leave out the known survivors (the slowest)")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    a = ap.parse_args(argv)
    if a.list:
        for m in MUTANTS:
            print(f"{m.name:34} {m.file:20} {m.bug}{' (known survivor)' if m.survives else ''}")
        return 0
    mutants = MUTANTS
    if a.only:
        names = a.only.split(",")
        unknown = sorted(set(names) - {m.name for m in MUTANTS})
        if unknown:
            raise SystemExit(f"unknown mutants {unknown}; --list shows them")
        mutants = tuple(m for m in MUTANTS if m.name in names)
    if a.skip_survivors:
        mutants = tuple(m for m in mutants if not m.survives)
    outcomes, seconds = run(mutants, max(1, a.jobs))
    counts = {r: sum(o.result == r for o in outcomes) for r in RESULTS}
    others = ", ".join(f"{n} {r}" for r, n in counts.items() if n and r != "killed")
    print(f"{counts['killed']} of {len(outcomes)} mutants killed in {seconds:.0f} s" + (f"; {others}" if others else ""))
    if a.record:
        print(f"recorded in {record(outcomes, seconds, 'python tests/emu/mutate.py ' + ' '.join(argv or sys.argv[1:]))}")
    bad = verdict(outcomes)
    for line in bad:
        print(f"FAILED {line}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
