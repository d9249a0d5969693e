#!/usr/bin/env bash
# The GPU kit's one node command:  bash KIT/run.sh OUTDIR [--quick] [--deadline-s S]
#
# 1. records the environment in OUTDIR/env.txt (before anything can fail);
# 2. python -m bertdist.gpu_kit.node: installs the kit's wheels offline, builds the CUDA extension
#    and DeepSpeed's fused LAMB in parallel, runs `bertdist bench --out OUTDIR` against a deadline.
# Every failure is a row of the report in OUTDIR. The repository is the kit's grandparent folder
# (KIT = REPO/dist/gpu-kit), or BERTDIST_REPO; the Python is python3, or PYTHON.
set -u
KIT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${1:?usage: bash run.sh OUTDIR [--quick] [--deadline-s S]}"
shift
mkdir -p "$OUT" || exit 2
OUT="$(cd "$OUT" && pwd)"
REPO="${BERTDIST_REPO:-$(cd "$KIT/../.." && pwd)}"
PY="${PYTHON:-python3}"

section() { printf '\n## %s\n' "$1"; }
try() { "$@" 2>&1 || echo "(failed: exit $? from: $*)"; }
have() { command -v "$1" >/dev/null 2>&1; }

{
  echo "# bertdist GPU node environment"
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "host: $(uname -a)"
  echo "kit: $KIT"
  echo "repository: $REPO"
  section "nvidia-smi"
  if have nvidia-smi; then
    try nvidia-smi
    try nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem,power.limit --format=csv
  else
    echo "nvidia-smi: not found"
  fi
  section "python"
  if have "$PY"; then
    echo "$(command -v "$PY")"
    try "$PY" -VV
    try "$PY" - <<'EOF'
import os, sysconfig
inc = sysconfig.get_paths()["include"]
print(f"Python.h: {os.path.join(inc, 'Python.h')} {'present' if os.path.isfile(os.path.join(inc, 'Python.h')) else 'MISSING'}")
try:
    import torch
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, "
          f"available {torch.cuda.is_available()}, devices {torch.cuda.device_count()}")
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        print(f"device 0: {p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs")
except Exception as e:
    print(f"torch: {type(e).__name__}: {e}")
EOF
  else
    echo "$PY: not found"
  fi
  section "compilers and tools"
  for tool in nvcc g++ ninja git; do
    if have "$tool"; then echo "$tool: $(command -v $tool)"; try "$tool" --version | head -n 4; else echo "$tool: not found"; fi
  done
  section "cpu, memory, disk"
  echo "cores: $(nproc 2>/dev/null || echo unknown)"
  try free -g
  try df -h "$OUT" /tmp
  section "python packages (pip list --format=freeze)"
  if have "$PY"; then try "$PY" -m pip list --format=freeze --disable-pip-version-check; fi
} >"$OUT/env.txt" 2>&1

echo "[gpu-kit] environment recorded in $OUT/env.txt"
if ! have "$PY"; then
  echo "[gpu-kit] $PY not found: nothing else can run (set PYTHON)" | tee -a "$OUT/env.txt"
  exit 2
fi
if [ ! -f "$REPO/bertdist/gpu_kit/node.py" ]; then
  echo "[gpu-kit] no bertdist repository at $REPO (set BERTDIST_REPO)" | tee -a "$OUT/env.txt"
  exit 2
fi
cd "$REPO" || exit 2
PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" exec "$PY" -m bertdist.gpu_kit.node --kit "$KIT" --out "$OUT" "$@"
