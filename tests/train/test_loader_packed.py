"""The loader on packed records: cu_seqlens follow the documents, dynamic masking at 30% never
touches a document's [CLS]/[SEP] or padding, random replacements avoid special ids, and a model
that does not attend within documents (BERT's) is refused."""
from __future__ import annotations

import numpy as np
import pytest

from bertdist.config import ConfigError
from bertdist.model.config import IGNORE_INDEX
from bertdist.train.config import LoaderConfig
from bertdist.train.loader import LoaderState, PretrainingLoader, open_training_records


def _loader(packed_records, tokenizer, continuation=None, **cfg):
    source = open_training_records(str(packed_records), str(tokenizer), 1024)
    c = LoaderConfig(train_manifest=str(packed_records), vocab_file=str(tokenizer), max_seq_length=1024,
                     micro_batch_size=4, global_batch_size=8, prefetch_steps=0, **cfg)
    return PretrainingLoader(source, c, rank=0, world_size=1, grad_accum=2, document_attention=True,
                             continuation=continuation), source


def test_bert_on_packed_records_is_refused_naming_the_format(packed_records, small_bpe_tokenizer):
    source = open_training_records(str(packed_records), str(small_bpe_tokenizer), 1024)
    c = LoaderConfig(train_manifest=str(packed_records), vocab_file=str(small_bpe_tokenizer), max_seq_length=1024,
                     micro_batch_size=4, global_batch_size=4)
    with pytest.raises(ConfigError, match=r"are packed \(records.packing.*document_lengths; format_version 2\).*"
                                          r"BERT's learned absolute positions"):
        PretrainingLoader(source, c, rank=0, world_size=1, grad_accum=1)


def test_cu_seqlens_follow_the_documents_and_masking_respects_them(packed_records, small_bpe_tokenizer):
    loader, source = _loader(packed_records, small_bpe_tokenizer)
    sp = source.manifest["special_token_ids"]
    specials = set(source.manifest["vocab"]["special_ids"])
    assert loader.mask_prob == 0.3 and loader.max_predictions == 308
    state, masked, budget, random_ids, segments = LoaderState(), 0, 0, [], 0
    for _ in range(3):
        for mb in loader.micro_batches(state):
            ids, labels = mb["input_ids"].numpy(), mb["labels"].numpy()
            original = np.where(labels != IGNORE_INDEX, labels, ids)
            att = mb["attention_mask"].numpy().astype(bool)
            flat = original.reshape(-1)[mb["token_index"].numpy()]  # the packed tokens, row by row
            cu = mb["cu_seqlens"].numpy()
            assert cu.dtype == np.int32 and cu[0] == 0 and cu[-1] == flat.size
            # every row boundary is a segment boundary; every segment is one framed document
            assert set(np.cumsum(att.sum(1)).tolist()) <= set(cu.tolist())
            for s, e in zip(cu[:-1], cu[1:]):
                doc = flat[s:e]
                assert doc[0] == sp["cls"] and doc[-1] == sp["sep"] and e - s >= 3
                assert not np.isin(doc[1:-1], [sp["cls"], sp["sep"], sp["pad"]]).any()
            assert int(mb["max_seqlen"]) == int(np.diff(cu).max()) <= 1024
            segments += len(cu) - 1
            # no label on a [CLS], [SEP] or padding position
            chosen = labels != IGNORE_INDEX
            assert not (chosen & ~att).any() and not np.isin(original[chosen], [sp["cls"], sp["sep"], sp["pad"]]).any()
            assert not (mb["token_type_ids"].numpy() != 0).any() and "next_sentence_label" not in mb
            masked += int(chosen.sum())
            budget += int(np.minimum(308, np.rint(att.sum(1) * 0.3)).sum())
            replaced = chosen & (ids != sp["mask"]) & (ids != original)
            random_ids += ids[replaced].tolist()
        state = loader.advance(state)
    assert masked == budget  # token masking fills each row's 30% budget exactly
    assert len(random_ids) > 100 and not set(random_ids) & specials
    assert segments > 24  # more documents than rows: packed


def test_the_prediction_cap_follows_a_changed_rate(packed_records, small_bpe_tokenizer):
    assert _loader(packed_records, small_bpe_tokenizer, mask_prob=0.4)[0].max_predictions == 410  # ceil(409.6)
    assert _loader(packed_records, small_bpe_tokenizer, mask_prob=0.4,
                   max_predictions_per_seq=100)[0].max_predictions == 100
    assert _loader(packed_records, small_bpe_tokenizer, mask_prob=0.3)[0].max_predictions == 308  # the manifest's


def test_whole_word_masking_of_byte_level_bpe_rows_masks_whole_words(packed_records, small_bpe_tokenizer):
    """The byte-level BPE's word starts ('Ġ') give the loader its words: every word of a packed
    row is predicted whole or not at all. Without the table, whole-word masking is refused."""
    from bertdist.data import continuation_mask

    with pytest.raises(ConfigError, match="needs word boundaries.*word starts such as a byte-level BPE's.*"
                                          "tokenizer.json"):
        _loader(packed_records, small_bpe_tokenizer, masking_mode="whole_word")
    table = continuation_mask(small_bpe_tokenizer)
    assert table is not None and 0 < table.mean() < 1
    loader, source = _loader(packed_records, small_bpe_tokenizer, continuation=table, masking_mode="whole_word")
    sp = source.manifest["special_token_ids"]
    words_seen = several = 0
    for mb in loader.micro_batches(LoaderState()):
        ids, labels = mb["input_ids"].numpy(), mb["labels"].numpy()
        original = np.where(labels != IGNORE_INDEX, labels, ids)
        chosen = labels != IGNORE_INDEX
        maskable = mb["attention_mask"].numpy().astype(bool) & ~np.isin(original, [sp["cls"], sp["sep"], sp["pad"]])
        for r in range(ids.shape[0]):
            prev = np.concatenate([[False], maskable[r, :-1]])
            word = np.cumsum(maskable[r] & (~table[original[r]] | ~prev))  # a start opens the next word
            for k in range(1, word[-1] + 1):
                w = np.flatnonzero(maskable[r] & (word == k))
                assert chosen[r, w].all() or not chosen[r, w].any(), (r, w)
                words_seen += 1
                several += len(w) > 1 and chosen[r, w].all()
    assert words_seen > 500 and several > 20  # multi-token words were masked whole


def test_the_trainer_opens_records_of_a_tokenizer_json(packed_records, small_bpe_tokenizer, tmp_path):
    from bertdist.config import load_config
    from bertdist.data import RecordsError
    from bertdist.train.config import TrainConfig
    from bertdist.train.trainer import _open_data
    from tests.conftest import REPO, SAMPLES, train_bpe_tokenizer

    def config(vocab):
        return load_config(TrainConfig, REPO / "configs" / "pretrain" / "tiny.yaml",
                           [f"data.train_manifest={packed_records}", f"data.vocab_file={vocab}",
                            "data.max_seq_length=1024", "model.max_position_embeddings=1024"])

    records, cfg, continuation = _open_data(config(small_bpe_tokenizer))
    assert cfg.model.vocab_size == records.manifest["vocab"]["size"] == 2005 and continuation is not None
    other = train_bpe_tokenizer(tmp_path / "tokenizer.json", SAMPLES / "books" / "chesterton-thursday.txt")
    with pytest.raises(RecordsError, match="records were built with vocab sha256"):
        _open_data(config(other))
