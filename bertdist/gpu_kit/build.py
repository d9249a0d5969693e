"""``make gpu-kit``: write the offline kit for a target image.

    python -m bertdist.gpu_kit.build --image configs/images/gpu-node-cuda13-py312.yaml --out dist/gpu-kit

The kit folder holds ``run.sh`` (the one node command), ``kit.json`` (what is in it and why),
``image.yaml`` (the manifest it was built for), ``wheels/`` (what the image lacks, for its
Python and platform) and ``records/`` (benchmark records built here by the Beam pipeline).
It fails when kit plus repository exceed the size limit of what travels to the node.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from bertdist.gpu_kit import records
from bertdist.gpu_kit.image import ImageManifest, load_image
from bertdist.gpu_kit.requirements import read_lock, resolve
from bertdist.gpu_kit.wheels import download

REPO = Path(__file__).resolve().parents[2]
RUN_SH = Path(__file__).with_name("run.sh")
DEFAULT_IMAGE = REPO / "configs" / "images" / "gpu-node-cuda13-py312.yaml"
DEFAULT_LIMIT_MIB = 48.0
BENCH_SEQS = [64, 128, 512]  # the tiny recipe's, phase 1's and phase 2's
KIT_FORMAT = 1


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file() and not p.is_symlink())


def repository_files(repo: Path, exclude: Path | None = None) -> list[Path]:
    """What travels with the repository: git's tracked and untracked-not-ignored files, or, without
    git, every file outside .git, .venv, build, dist and caches."""
    try:
        out = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             capture_output=True, check=True).stdout.decode()
        files = [repo / f for f in out.split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", "build", "dist", "__pycache__", ".pytest_cache"}
        files = [p for p in repo.rglob("*") if not skip & set(p.relative_to(repo).parts)]
    exclude = exclude.resolve() if exclude else None
    return [p for p in files if p.is_file() and not p.is_symlink()
            and not (exclude and p.resolve().is_relative_to(exclude))]


def _git_rev(repo: Path) -> str:
    try:
        rev = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        return rev.stdout.strip() or "unknown"
    except OSError:
        return "unknown (git not found)"


def relative_vocab(manifest: Path, vocab: Path) -> None:
    """Point the manifest's vocab at the kit's own copy, by a path relative to the manifest: the
    build machine's absolute path means nothing on the node (shard paths are relative already)."""
    data = json.loads(manifest.read_text())
    want = data["vocab"].get("sha256")
    if want and _sha256(vocab) != want:
        raise SystemExit(f"{manifest}: built with vocab sha256 {want}, but the kit's {vocab} is {_sha256(vocab)}")
    data["vocab"]["path"] = os.path.relpath(vocab, manifest.parent)
    tmp = manifest.with_name(manifest.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, manifest)


def write_run_sh(out: Path) -> Path:
    dst = out / "run.sh"
    shutil.copyfile(RUN_SH, dst)
    dst.chmod(dst.stat().st_mode | 0o111)  # executable for its owner's umask, nothing more
    return dst


def build_kit(image: ImageManifest, image_path: Path, out: Path, *, lock: Path, limit_mib: float = DEFAULT_LIMIT_MIB,
              records_from: Path | None = None, log=print) -> dict:
    """Write the kit into ``out`` (emptied first only if it holds an earlier kit); the kit.json dict."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        if not (out / "kit.json").is_file():
            raise SystemExit(f"{out} exists, is not empty and holds no kit.json: not overwriting it "
                             "(choose another --out or empty it)")
        shutil.rmtree(out)
    (out / "wheels").mkdir(parents=True)
    needed = resolve(image, read_lock(lock))
    log(f"[gpu-kit] image {image.name}: {image.python_tag} {image.platform}, {len(image.packages)} packages; "
        f"it lacks {len(needed)} that bertdist's GPU paths import")
    wheels = []
    for n in needed:
        w = download(n, image, out / "wheels")
        wheels.append({"file": f"wheels/{w.name}", "name": n.name, "version": n.version, "why": n.why,
                       "version_from": n.version_from, "bytes": w.stat().st_size, "sha256": _sha256(w)})
        log(f"[gpu-kit]   {w.name} ({w.stat().st_size / 2**20:.2f} MiB): {n.why}")
    if records_from is not None:
        for kind in records.KINDS:
            records.find(records_from, BENCH_SEQS, kind)
        shutil.copytree(records_from, out / "records", ignore=shutil.ignore_patterns("*.tmp"))
        log(f"[gpu-kit] records copied from {records_from} (seq {BENCH_SEQS}, {', '.join(records.KINDS)})")
    else:
        log(f"[gpu-kit] building records at seq {BENCH_SEQS}, {', '.join(records.KINDS)}, from the bundled samples "
            "(Beam, DirectRunner) ...")
        records.build(BENCH_SEQS, out / "records")
    for kind in records.KINDS:
        for manifest in records.find(out / "records", BENCH_SEQS, kind).values():
            relative_vocab(Path(manifest), out / "records" / records.VOCAB_NAME)
    shutil.copyfile(image_path, out / "image.yaml")
    write_run_sh(out)
    kit = {"format": KIT_FORMAT, "image": dataclasses.asdict(image) | {"packages": len(image.packages)},
           "built": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "built_with": {"python": sys.version.split()[0], "bertdist_git": _git_rev(REPO)},
           "wheels": wheels, "records": {"folder": "records", "seqs": BENCH_SEQS, "kinds": list(records.KINDS),
                                         "vocab": f"records/{records.VOCAB_NAME}"}}
    kit_bytes = folder_bytes(out)  # all but kit.json itself, a few KB written last
    repo_bytes = sum(p.stat().st_size for p in repository_files(REPO, exclude=out))
    total_mib = (kit_bytes + repo_bytes) / 2**20
    kit["size"] = {"kit_bytes": kit_bytes, "repository_bytes": repo_bytes, "total_mib": round(total_mib, 2),
                   "limit_mib": limit_mib}
    (out / "kit.json").write_text(json.dumps(kit, indent=1) + "\n")
    log(f"[gpu-kit] {out}: kit {kit_bytes / 2**20:.1f} MiB (wheels {folder_bytes(out / 'wheels') / 2**20:.1f}, "
        f"records {folder_bytes(out / 'records') / 2**20:.1f}) + repository {repo_bytes / 2**20:.1f} MiB = "
        f"{total_mib:.1f} MiB of {limit_mib:g} MiB")
    if total_mib > limit_mib:
        raise SystemExit(f"gpu-kit: kit {kit_bytes / 2**20:.1f} MiB + repository {repo_bytes / 2**20:.1f} MiB = "
                         f"{total_mib:.1f} MiB, over the {limit_mib:g} MiB limit of what travels to the node")
    log(f"[gpu-kit] on the node: bash {os.path.relpath(out / 'run.sh', REPO)} OUTDIR")
    return kit


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--image", default=str(DEFAULT_IMAGE), help="image manifest (YAML)")
    ap.add_argument("--out", default=str(REPO / "dist" / "gpu-kit"), help="kit folder (default dist/gpu-kit)")
    ap.add_argument("--lock", default=str(REPO / "requirements.lock"), help="pinned versions")
    ap.add_argument("--limit-mib", type=float, default=DEFAULT_LIMIT_MIB,
                    help="fail above this size of kit + repository (default 48)")
    ap.add_argument("--records-from", help="copy pre-built records (vocab.txt, records_128/, records_512/) "
                                           "instead of building them")
    args = ap.parse_args(argv)
    image_path = Path(args.image)
    build_kit(load_image(image_path), image_path, Path(args.out), lock=Path(args.lock), limit_mib=args.limit_mib,
              records_from=Path(args.records_from) if args.records_from else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
