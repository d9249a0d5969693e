"""Packed-records benchmark (not a test): how fast the build makes packed MLM-only rows.

Workload: ../shared/data's Wikipedia fragment and 14 Gutenberg books, tokenized with a byte-level
BPE tokenizer.json (16,000 tokens, trained here on the books with the ``tokenizers`` library, laid
out as ModernBERT's; its training is not timed), rows of ``--seq`` tokens, 30% dynamic masking.

Two figures, each the median of ``--repeats`` runs:
  - ``pack``: :func:`data_pipeline.packing.pack_documents` alone, over the books cut into short
    documents (50-1,500 words, many a row) in pack groups of ``--group-tokens`` (rows/s, tokens/s
    written);
  - ``build``: the whole ``bertdist data build`` (read, quality filter, dedup, sentences,
    tokenize, pack, shuffle into shards, verify, commit) in this process on the DirectRunner,
    one worker (rows/s and row tokens/s out, from the manifest).

    PYTHONPATH=. .venv/bin/python benchmarks/packing.py [--seq 1024] [--repeats 3] [--markdown out.md]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the repo's data_pipeline package, not benchmarks/data_pipeline.py beside this file
SHARED = Path(os.environ.get("BERTDIST_SHARED_DATA", REPO.parent / "shared" / "data"))


def train_tokenizer(out: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=16_000, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    lines = (line for p in sorted((SHARED / "books").glob("*.txt"))
             for line in p.read_text(encoding="utf-8", errors="replace").splitlines())
    tok.train_from_iterator(lines, trainer)
    tok.add_special_tokens(["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"])
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[(t, tok.token_to_id(t)) for t in ("[CLS]", "[SEP]")])
    tok.save(str(out))
    return out


def build_once(tokenizer: Path, out: Path, seq: int) -> dict:
    from data_pipeline import build_records

    t = time.perf_counter()
    m = build_records([f"wiki:{SHARED / 'wiki'}", f"books:{SHARED / 'books'}"], out, tokenizer, max_seq_length=seq,
                      objective="none", masking="dynamic", masked_lm_prob=0.3, dupe_factor=1, pack_documents=True,
                      num_shards=4)
    wall = time.perf_counter() - t
    man = json.loads(Path(m).read_text())
    c = man["counts"]
    return {"wall_s": wall, "rows": c["instances"], "row_tokens": c["tokens"], "documents": c["documents"],
            "input_tokens": c["input_tokens"], "fill": {s: p["fill"] for s, p in c["packing"].items()},
            "split_documents": sum(p["split_documents"] for p in c["packing"].values())}


def short_document_groups(tokenizer: Path, group_tokens: int) -> list[list]:
    """The 14 books cut into short documents of 50-1,500 words (seeded), as web text comes: many
    documents a row, the hard case for packing. Tokenized, shuffled by placement hash as the build
    orders them, and cut into pack groups of about ``group_tokens`` tokens."""
    import random

    from data_pipeline.negatives import placement_hash
    from data_pipeline.tokenization import TokenizerJsonEncoder

    enc = TokenizerJsonEncoder(str(tokenizer))
    rng = random.Random(0)
    docs = []
    for path in sorted((SHARED / "books").glob("*.txt")):
        words = path.read_text(encoding="utf-8", errors="replace").split()
        i = 0
        while i < len(words):
            n = rng.randint(50, 1500)
            doc_id = f"{path.name}:{i}"
            docs.append((placement_hash(doc_id), enc.encode_document([" ".join(words[i:i + n])])[0]))
            i += n
    docs.sort(key=lambda d: d[0])
    groups, cur, n = [], [], 0
    for _, ids in docs:
        cur.append(ids)
        n += int(ids.shape[0])
        if n >= group_tokens:
            groups.append(cur)
            cur, n = [], 0
    return groups + ([cur] if cur else [])


def pack_once(groups: list[list], seq: int) -> dict:
    from data_pipeline.packing import pack_documents

    t = time.perf_counter()
    rows = tokens = 0
    for i, g in enumerate(groups):
        batch, stats = pack_documents(g, max_seq_length=seq, cls_id=16_001, sep_id=16_002, key_seed=i)
        rows += len(batch)
        tokens += stats.row_tokens
    return {"wall_s": time.perf_counter() - t, "rows": rows, "row_tokens": tokens}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--group-tokens", type=int, default=1 << 20)
    ap.add_argument("--pack-only", action="store_true", help="time pack_documents alone, not the whole build")
    ap.add_argument("--markdown")
    args = ap.parse_args()
    if not SHARED.is_dir():
        print(f"benchmarks/packing.py: {SHARED} not found", file=sys.stderr)
        return 2
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tok = train_tokenizer(tmp / "tokenizer.json")
        builds = [] if args.pack_only else [build_once(tok, tmp / f"out{r}", args.seq) for r in range(args.repeats)]
        groups = short_document_groups(tok, args.group_tokens)
        packs = [pack_once(groups, args.seq) for _ in range(args.repeats)]

    def med(runs, key):
        return statistics.median(r[key] / r["wall_s"] for r in runs)

    def walls(runs, digits):
        return ", ".join(f"{r['wall_s']:.{digits}f}" for r in runs)

    load = os.getloadavg()
    lines = [
        f"# Packed records, seq {args.seq}: {platform.processor() or platform.machine()}, {os.cpu_count()} cores "
        f"(shared with other work: load average {load[0]:.1f} at the end)",
        "",
        f"commit {subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True, cwd=REPO).stdout.strip()}; "
        f"median of {args.repeats} runs",
        "",
        "| stage | rows/s | row tokens/s | wall s (each run) | rows | row tokens |",
        "|---|---:|---:|---|---:|---:|",
        f"| pack_documents alone (the 14 books as {sum(map(len, groups)):,} short documents) | {med(packs, 'rows'):,.0f} | {med(packs, 'row_tokens'):,.0f} | "
        f"{walls(packs, 3)} | {packs[0]['rows']:,} | {packs[0]['row_tokens']:,} |",
    ]
    if builds:
        lines[6:6] = [
            f"| build (wiki + 14 books, DirectRunner, 1 worker) | {med(builds, 'rows'):,.0f} | "
            f"{med(builds, 'row_tokens'):,.0f} | {walls(builds, 1)} | "
            f"{builds[0]['rows']:,} | {builds[0]['row_tokens']:,} |",
        ]
        lines += ["", f"build: {builds[0]['documents']:,} documents, {builds[0]['input_tokens']:,} document tokens, "
                      f"{builds[0]['split_documents']:,} cut into pieces; rows filled {builds[0]['fill']}"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
