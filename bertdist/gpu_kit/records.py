"""The benchmark's records: built from the bundled samples by the Beam pipeline, one build per
sequence length, beside the vocab they were tokenized with.

The bench reads row lengths from them and the recipe runs train on them. A GPU kit carries a
copy, so that the node needs neither Beam nor blingfire. Layout of a records folder::

    vocab.txt
    records_128/manifest.json (+ shards)            masked once by the build, MLM + NSP (BERT's recipes)
    records_128_unmasked/manifest.json (+ shards)   unmasked, no second objective (recipes with
                                                    ``masking: dynamic``: ELECTRA, MLM 30%, span)
    records_512/...
"""
from __future__ import annotations

from pathlib import Path

SAMPLES = Path(__file__).resolve().parents[2] / "data_pipeline" / "samples"
VOCAB_NAME = "vocab.txt"
VOCAB_SIZE = 8000
MAX_PREDICTIONS = {128: 20, 512: 80}
# Each kind of records: its folder suffix and its build settings. A recipe reads the kind its
# data.masking asks for (the loader refuses masked records under masking: dynamic).
KINDS = {"static": ("", {}), "unmasked": ("_unmasked", {"masking": "dynamic", "objective": "none"})}


def kind_for_masking(masking: str) -> str:
    """The records kind a recipe's ``data.masking`` reads: dynamic needs unmasked records."""
    return "unmasked" if masking == "dynamic" else "static"


def manifest_path(folder: Path, seq: int, kind: str = "static") -> Path:
    return Path(folder) / f"records_{seq}{KINDS[kind][0]}" / "manifest.json"


def build(seqs: list[int], out: Path, samples: Path = SAMPLES,
          kinds: tuple[str, ...] = tuple(KINDS)) -> dict[str, dict[int, str]]:
    """Train the vocab on the books and build records of the books + Wikipedia sample, per kind
    (``KINDS``) and seq: {kind: {seq: manifest path}}."""
    from data_pipeline import build_records
    from data_pipeline.config import InputConfig
    from data_pipeline.tokenization import train_vocab
    from data_pipeline.vocab_corpus import iter_sentences

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = out / VOCAB_NAME
    train_vocab(iter_sentences([InputConfig(kind="books", path=str(samples / "books"))]), vocab,
                vocab_size=VOCAB_SIZE, lowercase=True)
    manifests: dict[str, dict[int, str]] = {kind: {} for kind in kinds}
    for kind in kinds:
        settings = KINDS[kind][1]
        for seq in seqs:
            manifests[kind][seq] = str(build_records([f"wiki:{samples / 'wiki'}", f"books:{samples / 'books'}"],
                              manifest_path(out, seq, kind).parent, vocab, max_seq_length=seq, dupe_factor=1,
                              num_shards=2, heldout_fraction=0.0,
                              max_predictions_per_seq=MAX_PREDICTIONS.get(seq, 20), **settings))
    return manifests


def find(folder: Path, seqs: list[int], kind: str = "static") -> dict[int, str]:
    """Pre-built records of one kind in ``folder`` (a kit's), checked to be complete: {seq: manifest path}."""
    folder = Path(folder)
    if not (folder / VOCAB_NAME).is_file():
        raise FileNotFoundError(f"{folder}: no {VOCAB_NAME} (a records folder holds {VOCAB_NAME} and records_SEQ/)")
    found, missing = {}, []
    for seq in seqs:
        m = manifest_path(folder, seq, kind)
        if m.is_file():
            found[seq] = str(m)
        else:
            missing.append(seq)
    if missing:
        have = sorted(p.parent.name for p in folder.glob("records_*/manifest.json"))
        raise FileNotFoundError(f"{folder}: no {kind} records for seq {missing} (has {have or 'none'})")
    return found
