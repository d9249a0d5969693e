"""The pretraining data loader: pipeline records -> padded, masked, rank-sharded batches.

Order. One global order per epoch that does not depend on the world size:
the shards are permuted (seeded by ``seed, epoch``), cut into windows of
``shuffle_window_shards`` shards, and the rows of each window are permuted
(seeded by ``seed, epoch, window``). Global batch ``b`` is the next
``global_batch_size`` rows of that stream; rank ``r`` of ``W`` takes the
``r``-th ``1/W`` of it, as ``accum`` micro-batches. So every rank gets a
disjoint, equal share, every rank runs ``rows // global_batch`` steps per
epoch (the remainder, fewer than one global batch, is reported and falls in a
different place next epoch), and the position survives a change of world
size.

State. ``(epoch, position)``, the number of rows of the epoch's stream already
consumed, is all a resume needs: the masking RNG of each micro-batch is
derived from ``(seed, epoch, position, rank slice)``, so batches are neither
replayed nor skipped, and masks after a resume equal the uninterrupted run's.

Packing. Each batch also carries what the unpadded encoder and the sparse MLM head would
otherwise read back from the device: ``token_index`` (the flat position in [B * S] of each real
token), ``cu_seqlens`` (int32 [B + 1]), ``max_seqlen`` (a 0-d host tensor; ``batch_to_device``
hands it to the model as an int) and ``masked_positions`` (the flat positions with a label,
ascending). The loader knows them when it collates; computed on the device they cost host syncs.

Packed records (``records.packing`` in the manifest: several documents a row, each framed
[CLS] ... [SEP], their lengths in the ``document_lengths`` column). ``cu_seqlens`` are the
boundaries of the attention segments, in packed-token order: one segment per row for ordinary
records, one per document for packed ones; ``max_seqlen`` is the longest segment, and positions
restart at every segment (the model derives them from ``cu_seqlens``). Only a model that attends
within each segment may train on packed rows: the loader refuses them unless it is told so
(``document_attention=True``), since BERT's model (learned positions over the whole row,
attention over the whole row) would mix documents. Dynamic masking never picks a [CLS], [SEP] or
padding position, and a random replacement of a tokenizer.json or packed build draws from the
vocabulary without its special tokens (``vocab.special_ids``); records of a WordPiece vocab.txt
keep BERT's draw over the whole vocabulary, so their masks are unchanged.

Memory: one or two windows of shards are held as flat numpy arrays (the
columns of the parquet shards, zero-copy where possible).
"""
from __future__ import annotations

import dataclasses
import queue
import threading
from typing import Any, Iterator, Protocol

import numpy as np
import torch

from bertdist.config import ConfigError
from bertdist.data.masking import default_max_predictions, resolve_masking_mode
from bertdist.data.records import DOCUMENT_LENGTHS
from bertdist.model.config import IGNORE_INDEX
from bertdist.train.config import LoaderConfig
from bertdist.train.masking import SpecialIds, dynamic_mask, pad_rows, special_ids_from_manifest, static_labels


class RecordSource(Protocol):
    """What ``bertdist.data.open_records`` returns (see the record contract)."""

    manifest: dict
    shards: list  # [(path, rows)]
    num_rows: int

    def read_shard(self, i: int): ...


@dataclasses.dataclass
class LoaderState:
    epoch: int = 0
    position: int = 0  # rows of this epoch's global stream already consumed

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LoaderState":
        return cls(int(d["epoch"]), int(d["position"]))


def open_training_records(manifest_path: str, vocab_file: str, max_seq_length: int, split: str = "train",
                          verify: bool = True) -> RecordSource:
    """The data pipeline's reader, checked against the vocab and sequence length this run expects.

    Missing, truncated or altered shards and a vocab / max_seq_length mismatch raise
    ``bertdist.data.RecordsError`` naming the file.
    """
    from bertdist.data import open_records, vocab_sha256

    return open_records(manifest_path, expect_vocab_sha256=vocab_sha256(vocab_file),
                        expect_max_seq_length=max_seq_length, verify=verify, split=split)


class _Window:
    """The rows of one window of shards as flat arrays (rows in window order: shard by shard)."""

    def __init__(self, tables: list):
        import pyarrow as pa

        def flat_list(name: str) -> tuple[np.ndarray, np.ndarray]:
            arrs = [t.column(name).combine_chunks() for t in tables]
            offsets, values, base = [], [], 0
            for a in arrs:
                if isinstance(a, pa.ChunkedArray):
                    a = a.combine_chunks()
                off = a.offsets.to_numpy().astype(np.int64)
                vals = a.values.to_numpy(zero_copy_only=False)
                offsets.append(off[:-1] - off[0] + base)
                values.append(vals[off[0]:off[-1]])
                base += int(off[-1] - off[0])
            return np.concatenate(values) if values else np.zeros(0, np.uint16), np.concatenate(offsets)

        self.tokens, self.tok_start = flat_list("input_ids")
        self.tok_len = np.diff(np.append(self.tok_start, len(self.tokens)))
        self.num_a = np.concatenate([t.column("num_a_tokens").to_numpy() for t in tables]).astype(np.int64)
        self.nsp = np.concatenate([t.column("next_sentence_label").to_numpy() for t in tables]).astype(np.int64)
        self.mpos, self.mpos_start = flat_list("masked_lm_positions")
        self.mids, _ = flat_list("masked_lm_ids")
        self.mpos_len = np.diff(np.append(self.mpos_start, len(self.mpos)))
        self.rows = len(self.tok_start)
        self.packed = bool(tables) and DOCUMENT_LENGTHS in tables[0].column_names
        if self.packed:  # each row's document lengths: doc_lens[doc_start[r] : doc_start[r] + doc_count[r]]
            self.doc_lens, self.doc_start = flat_list(DOCUMENT_LENGTHS)
            self.doc_lens = self.doc_lens.astype(np.int64)
            self.doc_count = np.diff(np.append(self.doc_start, len(self.doc_lens)))
            per_row = np.add.reduceat(self.doc_lens, self.doc_start) if len(self.doc_lens) else np.zeros(0, np.int64)
            if self.doc_count.min(initial=1) < 1 or not np.array_equal(per_row, self.tok_len):
                bad = int(np.flatnonzero((self.doc_count < 1) | (per_row != self.tok_len))[0])
                raise ValueError(f"packed row {bad}: document_lengths add up to {int(per_row[bad])}, the row holds "
                                 f"{int(self.tok_len[bad])} tokens")

    def document_lengths(self, rows: np.ndarray) -> np.ndarray:
        """The lengths of the documents of ``rows``, row by row in that order."""
        counts = self.doc_count[rows]
        starts = np.repeat(self.doc_start[rows] - np.cumsum(counts) + counts, counts)
        return self.doc_lens[starts + np.arange(int(counts.sum()))]


def records_masking_mode(cfg: LoaderConfig, fmt: dict) -> str:
    """The dynamic masking mode: the config's (masking_mode, or whole_word_mask), else the
    manifest's records (masking_mode, or whole_word_mask for records that predate it)."""
    mode = resolve_masking_mode(cfg.masking_mode, cfg.whole_word_mask, "data.")
    if mode is None:
        mode = fmt.get("masking_mode") or ("whole_word" if fmt.get("whole_word_mask") else "token")
    return mode


class PretrainingLoader:
    """Yields, per optimizer step, this rank's ``accum`` micro-batches (dicts of int64 tensors)."""

    def __init__(self, source: RecordSource, cfg: LoaderConfig, *, rank: int, world_size: int, grad_accum: int,
                 continuation: np.ndarray | None = None, mask_seed: int | None = None,
                 pin_device: torch.device | None = None, document_attention: bool = False):
        """``continuation``: bool[V] "##" table (``bertdist.data.continuation_mask``), for whole-word masking.
        ``pin_device``: a CUDA device the batches are bound for; they are then collated into pinned
        (page-locked) memory, in the prefetch thread, so ``.to(device, non_blocking=True)`` is a real
        asynchronous copy (from pageable memory it is not).
        ``document_attention``: the model attends within each ``cu_seqlens`` segment and restarts
        positions there (ModernBERT); packed records are refused without it."""
        self.source, self.cfg, self.rank, self.world = source, cfg, rank, world_size
        self.pin_device = pin_device if pin_device is not None and pin_device.type == "cuda" else None
        self.accum, self.micro = grad_accum, cfg.micro_batch_size
        self.global_batch = cfg.micro_batch_size * grad_accum * world_size
        fmt = source.manifest["records"]
        where = getattr(source, "manifest_path", "the manifest")
        if int(fmt["max_seq_length"]) != cfg.max_seq_length:
            raise ConfigError(f"data.max_seq_length is {cfg.max_seq_length} but the records of {where} were built "
                              f"with max_seq_length {fmt['max_seq_length']}; use matching shards or change the config")
        if cfg.masking == "static" and fmt["masking"] == "dynamic":
            raise ConfigError(f"data.masking=static but the records of {where} are unmasked (masking: dynamic)")
        if cfg.masking == "dynamic" and fmt["masking"] == "static":
            # their input_ids already hold [MASK] and random ids: masking them again would train on those
            raise ConfigError(f"data.masking=dynamic but the records of {where} are already masked (masking: static); "
                              "build unmasked records (masking: dynamic) or set data.masking to auto or static")
        self.packed = bool((fmt.get("packing") or {}).get("documents"))
        if self.packed and not document_attention:
            raise ConfigError(
                f"the records of {where} are packed (records.packing: several documents a row, each [CLS] ... "
                f"[SEP], column {DOCUMENT_LENGTHS}; format_version {source.manifest.get('format_version')}), and this "
                "model does not attend within documents: BERT's learned absolute positions would run across "
                "the documents of a row and its attention would mix them. Train a model with per-document "
                "attention (ModernBERT) on them, or build unpacked records (pack_documents: false)")
        self.dynamic = cfg.masking == "dynamic" or fmt["masking"] == "dynamic"
        built_prob = float(fmt.get("masked_lm_prob", 0.15))
        self.mask_prob = cfg.mask_prob if cfg.mask_prob is not None else built_prob
        # unset: the manifest's, which was made for the build's rate; at another rate the cap follows
        # that rate (ceil(rate x length): 30% of 8,192 would otherwise be cut to a 15% build's cap)
        if cfg.max_predictions_per_seq is not None:
            self.max_predictions = cfg.max_predictions_per_seq
        elif self.mask_prob != built_prob:
            self.max_predictions = default_max_predictions(self.mask_prob, cfg.max_seq_length)
        else:
            self.max_predictions = int(fmt.get("max_predictions_per_seq", 20))
        self.vocab_size = int(source.manifest["vocab"]["size"])
        # random replacements: the vocabulary without its special tokens, for builds that list them
        # (tokenizer.json: ModernBERT's has dozens); a WordPiece vocab.txt's draw over all ids, as BERT
        special_ids = source.manifest["vocab"].get("special_ids")
        self.replace_ids = None
        if special_ids is not None or self.packed:
            from bertdist.data.tokenizer_file import replacement_ids

            self.replace_ids = replacement_ids(
                self.vocab_size, set(special_ids or ()) | set(source.manifest["special_token_ids"].values()))
        self.special = special_ids_from_manifest(source.manifest["special_token_ids"])
        self.masking_mode = records_masking_mode(cfg, fmt)
        if self.masking_mode != "token" and self.dynamic and continuation is None:
            vocab = source.manifest["vocab"]
            raise ConfigError(f"masking_mode {self.masking_mode!r} needs word boundaries (the vocab's continuation "
                              f"table: '##' pieces, or word starts such as a byte-level BPE's 'Ġ'), and none was given for the records of {where} (vocab "
                              f"{vocab.get('kind', 'wordpiece')} {vocab.get('path')}, word boundaries: "
                              f"{vocab.get('word_boundaries', True)}); set data.masking_mode: token")
        self.continuation = continuation if self.masking_mode != "token" else None
        # None in the config: the manifest's split (BERT's 80/10/10 for records that predate the keys)
        self.mask_replace_prob = float(cfg.mask_replace_prob if cfg.mask_replace_prob is not None
                                       else fmt.get("mask_replace_prob", 0.8))
        self.random_replace_prob = float(cfg.random_replace_prob if cfg.random_replace_prob is not None
                                         else fmt.get("random_replace_prob", 0.1))
        self.has_nsp = fmt.get("objective", "nsp") in ("nsp", "sop")
        self.seed = cfg.seed if mask_seed is None else mask_seed
        self.shard_rows = np.array([int(r) for _, r in source.shards], dtype=np.int64)
        self.num_rows = int(self.shard_rows.sum())
        if self.num_rows < self.global_batch:
            raise ConfigError(f"the records of {where} hold {self.num_rows} sequences, fewer than one global batch "
                              f"({self.global_batch}); build more data or lower data.global_batch_size")
        self.steps_per_epoch = self.num_rows // self.global_batch
        self.dropped_per_epoch = self.num_rows - self.steps_per_epoch * self.global_batch
        self._windows: dict[tuple[int, int], _Window] = {}
        self._epoch_plan: tuple[int, list, np.ndarray] | None = None

    # ----- order -------------------------------------------------------------------------
    def _plan(self, epoch: int) -> tuple[list[np.ndarray], np.ndarray]:
        """(shard ids per window, cumulative row counts of windows) for ``epoch``."""
        if self._epoch_plan is None or self._epoch_plan[0] != epoch:
            perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.shard_rows))
            w = self.cfg.shuffle_window_shards
            windows = [perm[i:i + w] for i in range(0, len(perm), w)]
            bounds = np.cumsum([0] + [int(self.shard_rows[ws].sum()) for ws in windows])
            self._epoch_plan = (epoch, windows, bounds)
        return self._epoch_plan[1], self._epoch_plan[2]

    def _window(self, epoch: int, wi: int) -> tuple[_Window, np.ndarray]:
        windows, _ = self._plan(epoch)
        key = (epoch, wi)
        if key not in self._windows:
            for old in [k for k in self._windows if k[0] != epoch or k[1] < wi - 1]:
                del self._windows[old]  # keep at most the previous and the current window
            self._windows[key] = _Window([self.source.read_shard(int(s)) for s in windows[wi]])
        win = self._windows[key]
        perm = np.random.default_rng([self.seed, epoch, wi]).permutation(win.rows)
        return win, perm

    def _rows(self, epoch: int, start: int, count: int) -> list[tuple[_Window, np.ndarray]]:
        """The window rows at stream positions [start, start + count), grouped by window."""
        _, bounds = self._plan(epoch)
        out, pos, end = [], start, start + count
        while pos < end:
            wi = int(np.searchsorted(bounds, pos, side="right") - 1)
            stop = min(end, int(bounds[wi + 1]))
            win, perm = self._window(epoch, wi)
            out.append((win, perm[pos - bounds[wi]: stop - bounds[wi]]))
            pos = stop
        return out

    # ----- collation ---------------------------------------------------------------------
    def collate(self, parts: list[tuple[_Window, np.ndarray]], rng: np.random.Generator) -> dict[str, torch.Tensor]:
        s_max = self.cfg.max_seq_length
        lens = np.concatenate([w.tok_len[r] for w, r in parts])
        if lens.max() > s_max:
            raise ValueError(f"a record holds {lens.max()} tokens, more than max_seq_length {s_max}")
        m = self.cfg.pad_to_multiple_of
        width = min(s_max, int(-(-lens.max() // m) * m))
        ids = np.concatenate([pad_rows(w.tokens, w.tok_start[r], w.tok_len[r], width, self.special.pad)
                              for w, r in parts]) if len(parts) > 1 else \
            pad_rows(parts[0][0].tokens, parts[0][0].tok_start[parts[0][1]], lens, width, self.special.pad)
        num_a = np.concatenate([w.num_a[r] for w, r in parts])
        cols = np.arange(width)
        attention = (cols[None, :] < lens[:, None]).astype(np.int64)
        token_type = ((cols[None, :] >= num_a[:, None]) & (attention == 1)).astype(np.int64)
        if self.dynamic:
            ids, labels = dynamic_mask(ids, lens, self.special, self.vocab_size, rng, self.mask_prob,
                                       self.max_predictions, self.continuation, mode=self.masking_mode,
                                       mask_replace_prob=self.mask_replace_prob,
                                       random_replace_prob=self.random_replace_prob, replace_ids=self.replace_ids)
        else:
            labels = np.concatenate([
                static_labels((len(r), width), w.mpos, w.mids, w.mpos_start[r], w.mpos_len[r]) for w, r in parts
            ])
        batch = {
            "input_ids": torch.from_numpy(ids),
            "attention_mask": torch.from_numpy(attention),
            "token_type_ids": torch.from_numpy(token_type),
            "labels": torch.from_numpy(labels),
            **packing(attention, lens, labels,
                      np.concatenate([w.document_lengths(r) for w, r in parts]) if self.packed else None),
        }
        if self.has_nsp:
            nsp = np.concatenate([w.nsp[r] for w, r in parts])
            if (nsp < 0).any():
                raise ValueError("records mix next_sentence_label -1 with an nsp/sop objective")
            batch["next_sentence_label"] = torch.from_numpy(nsp)
        return batch

    def micro_batches(self, state: LoaderState) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches of the global batch that starts at ``state``."""
        share = self.global_batch // self.world
        base = state.position + self.rank * share
        out = []
        for i in range(self.accum):
            start = base + i * self.micro
            rng = np.random.default_rng([self.seed, state.epoch, start, 1])
            out.append(self.collate(self._rows(state.epoch, start, self.micro), rng))
        return out

    def advance(self, state: LoaderState) -> LoaderState:
        pos = state.position + self.global_batch
        if pos + self.global_batch > self.num_rows:
            return LoaderState(state.epoch + 1, 0)
        return LoaderState(state.epoch, pos)

    def steps(self, state: LoaderState) -> Iterator[tuple[list[dict[str, torch.Tensor]], LoaderState]]:
        """Endless: (micro-batches of the step at ``state``, the state after that step)."""
        if self.cfg.prefetch_steps <= 0:
            yield from self._produce(state)
        yield from _prefetch(self._produce(state), self.cfg.prefetch_steps)

    def _produce(self, state: LoaderState):
        if self.pin_device is not None:
            # This runs in the prefetch thread, whose current device would be cuda:0: pinning there
            # would create a context on GPU 0 for every rank of the node.
            torch.cuda.set_device(self.pin_device)
        while True:
            nxt = self.advance(state)
            batches = self.micro_batches(state)
            yield (pin_batches(batches) if self.pin_device is not None else batches), nxt
            state = nxt


# Batch entries the model takes as host ints; ``batch_to_device`` reads them from their host tensor.
HOST_INTS = ("max_seqlen",)


def packing(attention: np.ndarray, lens: np.ndarray, labels: np.ndarray,
            segments: np.ndarray | None = None) -> dict[str, torch.Tensor]:
    """The packing of a right-padded [B, S] batch whose rows hold ``lens`` real tokens (see the
    module docstring). ``segments``: the attention segments' lengths in packed-token order (the
    documents of packed rows; they add up to ``lens``), None for one segment a row."""
    seg = lens if segments is None else segments
    if segments is not None and int(segments.sum()) != int(lens.sum()):
        raise ValueError(f"the segments hold {int(segments.sum())} tokens, the rows {int(lens.sum())}")
    cu = np.concatenate([[0], np.cumsum(seg)]).astype(np.int32)
    return {
        "token_index": torch.from_numpy(np.flatnonzero(attention.reshape(-1)).astype(np.int64)),
        "cu_seqlens": torch.from_numpy(cu),
        "max_seqlen": torch.tensor(int(seg.max()) if len(seg) else 0, dtype=torch.int64),
        "masked_positions": torch.from_numpy(np.flatnonzero(labels.reshape(-1) != IGNORE_INDEX).astype(np.int64)),
    }


def batch_to_device(mb: dict[str, torch.Tensor], device: torch.device) -> dict:
    """The batch as the model takes it on ``device``: tensors copied asynchronously, ``HOST_INTS``
    read from their host tensors (no device sync)."""
    return {k: int(v) if k in HOST_INTS else v.to(device, non_blocking=True) for k, v in mb.items()}


def pin_batches(batches: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """The same batches in pinned host memory (for asynchronous host-to-GPU copies)."""
    return [{k: v.pin_memory() for k, v in mb.items()} for mb in batches]


def _prefetch(gen, depth: int):
    """Run ``gen`` in a background thread, ``depth`` items ahead; exceptions re-raise in the consumer."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def work():
        try:
            for item in gen:
                while not stop.is_set():
                    try:
                        q.put(("item", item), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            q.put(("error", e))

    t = threading.Thread(target=work, daemon=True, name="bertdist-loader")
    t.start()
    try:
        while True:
            kind, item = q.get()
            if kind == "error":
                raise item
            yield item
    finally:
        # Stop and join the worker: a thread still collating while the interpreter shuts down can
        # abort the process.
        stop.set()
        while t.is_alive():
            try:
                q.get_nowait()
            except queue.Empty:
                pass
            t.join(timeout=0.05)


def eval_batches(source: RecordSource, cfg: LoaderConfig, continuation: np.ndarray | None, *, rank: int, world_size: int,
                 micro_batch_size: int, max_sequences: int, seed: int,
                 document_attention: bool = False) -> list[dict[str, torch.Tensor]]:
    """This rank's share of the held-out set (file order), masked with fixed seeded masks.

    The first ``max_sequences`` rows are cut into micro-batches; batch ``i`` goes to rank
    ``i % world_size`` and is masked with the RNG seeded by ``(seed, i)``, so the masks do not
    depend on the world size. Built once and reused at every evaluation of a run.
    """
    ecfg = dataclasses.replace(cfg, micro_batch_size=1, global_batch_size=1, prefetch_steps=0)
    loader = PretrainingLoader(source, ecfg, rank=0, world_size=1, grad_accum=1, continuation=continuation,
                               mask_seed=seed, document_attention=document_attention)
    total = min(max_sequences, loader.num_rows)
    tables, have = [], 0
    for i in range(len(source.shards)):
        if have >= total:
            break
        tables.append(source.read_shard(i))
        have += tables[-1].num_rows
    win = _Window(tables)
    out = []
    for bi, start in enumerate(range(0, total, micro_batch_size)):
        if bi % world_size != rank:
            continue
        rows = np.arange(start, min(total, start + micro_batch_size))
        out.append(loader.collate([(win, rows)], np.random.default_rng([seed, bi])))
    return out


__all__ = ["HOST_INTS", "LoaderState", "PretrainingLoader", "RecordSource", "SpecialIds", "batch_to_device",
           "eval_batches", "open_training_records", "packing"]
