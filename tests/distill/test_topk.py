"""Top-k pseudo-labels: the loss against a hand computation and against the full-logit loss, the
storage rules per head, and a SQuAD set with top-k end to end (smaller shards, a student trained
from it, reuse and refusal)."""
import json
import math

import numpy as np
import pytest
import torch

from bertdist.distill import losses
from bertdist.distill.pseudolabel import LabelSetMismatch, effective_top_k, top_k_of
from bertdist.finetune.errors import DataError
from bertdist.model import IGNORE_INDEX


def _log_softmax(xs, t):
    m = max(x / t for x in xs)
    z = m + math.log(sum(math.exp(x / t - m) for x in xs))
    return [x / t - z for x in xs]


S = [[1.0, -0.5, 0.25, 2.0], [0.3, 0.2, -1.0, 0.0]]
T = [[2.0, 0.0, -1.0, 1.5], [-0.5, 1.5, 0.5, 1.0]]


def test_topk_kl_by_hand_renormalises_the_teacher_and_gathers_the_full_student():
    temp, k = 2.0, 2
    vals, idx = top_k_of(np.array(T, dtype=np.float32), "classification", k)
    assert idx.tolist() == [[0, 3], [1, 3]] and vals.tolist() == [[2.0, 1.5], [1.5, 1.0]]
    want = 0.0
    for s_row, t_row, support in zip(S, T, idx.tolist()):
        log_t = _log_softmax([t_row[i] for i in support], temp)  # renormalised over the support
        log_q = _log_softmax(s_row, temp)  # over all 4 outputs
        want += sum(math.exp(lt) * (lt - log_q[i]) for lt, i in zip(log_t, support))
    want = want / 2 * temp ** 2
    got = losses.topk_kl(torch.tensor(S), torch.from_numpy(vals), torch.from_numpy(idx), temp)
    assert got.item() == pytest.approx(want, rel=1e-6)
    # through the classification loss, with the gold term on the labelled row
    gold = torch.tensor([3, IGNORE_INDEX])
    full = losses.classification_loss(torch.tensor(S), torch.from_numpy(vals), gold, temp, 0.5, torch.from_numpy(idx))
    ce = -_log_softmax(S[0], 1.0)[3]
    assert full.item() == pytest.approx(want + 0.5 * ce, rel=1e-6)


def test_k_at_least_the_number_of_outputs_gives_the_full_logit_loss():
    torch.manual_seed(0)
    s, t = torch.randn(3, 5), torch.randn(3, 5)
    vals, idx = top_k_of(t.numpy(), "classification", 5)
    assert losses.topk_kl(s, torch.from_numpy(vals), torch.from_numpy(idx), 2.0).item() == \
        pytest.approx(losses.soft_kl(s, t, 2.0).item(), rel=1e-6, abs=1e-7)
    # tokens: per position, masked
    st, tt = torch.randn(2, 4, 3), torch.randn(2, 4, 3)
    mask = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 0]])
    tk = [top_k_of(x, "token", 3) for x in tt.numpy()]
    v, i = (torch.from_numpy(np.stack(a)) for a in zip(*tk))
    assert losses.token_loss(st, v, mask, None, 1.5, 0.0, i).item() == \
        pytest.approx(losses.token_loss(st, tt, mask, None, 1.5, 0.0).item(), rel=1e-6)


def test_span_topk_over_positions_equals_the_full_loss_when_k_covers_the_sequence():
    torch.manual_seed(1)
    student, teacher = torch.randn(2, 6, 2), torch.randn(2, 6, 2)
    am = torch.tensor([[1] * 6, [1, 1, 1, 1, 0, 0]])  # the second row has 4 real positions
    full = losses.span_loss(student, teacher, am, torch.tensor([1, 2]), torch.tensor([3, IGNORE_INDEX]), 2.0, 0.3)
    # what the shards hold: the row's own positions only (trimmed), top-k over them
    tops = [top_k_of(teacher[b, :int(am[b].sum())].numpy(), "span", 10) for b in range(2)]
    assert tops[0][0].shape == (2, 6) and tops[1][0].shape == (2, 4)  # k' = min(k, S)
    from bertdist.distill.train import _collate_top_k

    feats = [{"teacher": v, "teacher_idx": i, "start_positions": 0, "input_ids": [0] * int(am[b].sum())}
             for b, (v, i) in enumerate(tops)]
    v, i = _collate_top_k(feats, 6)
    assert v.shape == (2, 2, 6) and torch.isinf(v[1, :, 4:]).all()  # unused slots of the short row
    got = losses.span_loss(student, v, am, torch.tensor([1, 2]), torch.tensor([3, IGNORE_INDEX]), 2.0, 0.3, i)
    assert got.item() == pytest.approx(full.item(), rel=1e-6)
    # with k < S the loss differs, and its gradient is finite despite the -inf slots
    tops = [top_k_of(teacher[b, :int(am[b].sum())].numpy(), "span", 3) for b in range(2)]
    v, i = _collate_top_k([{**f, "teacher": a, "teacher_idx": b} for f, (a, b) in zip(feats, tops)], 6)
    st = student.clone().requires_grad_(True)
    cut = losses.span_loss(st, v, am, None, None, 2.0, 0.0, i)
    cut.backward()
    assert cut.item() != pytest.approx(full.item()) and torch.isfinite(st.grad).all()


def test_storage_rules_per_head():
    assert effective_top_k("classification", 3, None, 128) is None
    assert effective_top_k("classification", 3, 3, 128) is None  # k >= C: stored whole
    assert effective_top_k("classification", 10, 3, 128) == 3
    assert effective_top_k("token", 9, 4, 128) == 4
    assert effective_top_k("span", 2, 20, 384) == 20  # over positions, not the 2 outputs
    assert effective_top_k("span", 2, 384, 384) is None
    with pytest.raises(DataError, match="regression head.*leave top_k unset"):
        effective_top_k("regression", 1, 5, 128)
    with pytest.raises(DataError, match="positive integer"):
        effective_top_k("classification", 3, 0, 128)
    v, i = top_k_of(np.arange(12, dtype=np.float32).reshape(4, 3), "token", 2)
    assert v.shape == i.shape == (4, 2) and i[0].tolist() == [2, 1]


# ---------------------------------------------------------------- a SQuAD set with top-k, end to end
@pytest.fixture(scope="module")
def squad(tmp_path_factory):
    from tests.distill import fixtures as fx

    tmp = tmp_path_factory.mktemp("topk")
    vocab = fx.write_vocab(tmp / "vocab.txt")
    data = fx.write_squad(tmp / "squad")
    unl = fx.write_squad_unlabeled(tmp / "unlabeled.json", n=10)
    return tmp, data, unl, fx.teacher(tmp, "squad", data, vocab, steps=4)


def _bytes(d):
    return sum(p.stat().st_size for p in d.glob("shard-*.parquet"))


@pytest.mark.slow  # a tiny teacher and three students: about 13 s
def test_squad_top_k_set_is_smaller_trains_students_and_is_refused_where_it_lacks(tmp_path, squad):
    from bertdist.distill.pseudolabel import load_label_rows, read_manifest
    from bertdist.distill.train import run_distill, run_pseudo_label
    from tests.distill import fixtures as fx

    _, data, unl, teacher = squad
    full, top = tmp_path / "full", tmp_path / "top"
    run_pseudo_label(fx.distill_config("squad", teacher, data, [unl], tmp_path / "r", labels_dir=str(full)))
    m = run_pseudo_label(fx.distill_config("squad", teacher, data, [unl], tmp_path / "r", labels_dir=str(top),
                                           top_k=4))
    assert m["logits"] == "top_k" and m["top_k"] == 4 and m["format"] == "bertdist-pseudo-labels/2"
    assert _bytes(top) < _bytes(full)
    # the stored values are the 4 largest start and end logits of the full set, with their positions
    rows_full = load_label_rows(full, read_manifest(full))
    rows_top = load_label_rows(top, read_manifest(top))
    for a, b in zip(rows_full, rows_top):
        v, i = top_k_of(a["teacher"], "span", 4)
        assert np.array_equal(b["teacher_idx"], i) and np.allclose(b["teacher"], v)
        assert np.allclose(np.take_along_axis(a["teacher"].T, b["teacher_idx"], -1), b["teacher"])
    stamp = {p.name: p.stat().st_mtime_ns for p in top.iterdir()}
    # two students from the one set: k = 4 as stored, and k = 2 cut from it when read
    for i, (k, student) in enumerate(((4, "layers:1"), (2, "layers:2"))):
        r = run_distill(fx.distill_config("squad", teacher, data, [unl], tmp_path / f"s{i}", labels_dir=str(top),
                                          top_k=k, student=student, steps=2))
        assert r["pseudo_labels"]["reused"] and r["pseudo_labels"]["top_k"] == k
        assert r["student"]["train_rows"] == 20 + 16 and (tmp_path / f"s{i}" / "model" / "config.json").is_file()
        assert r["student"]["steps"] == 2 and math.isfinite(r["student"]["score"])
        from safetensors.torch import load_file

        weights = load_file(str(tmp_path / f"s{i}" / "model" / "model.safetensors"))
        assert all(torch.isfinite(w).all() for w in weights.values())  # no NaN from the -inf slots
    assert {p.name: p.stat().st_mtime_ns for p in top.iterdir()} == stamp  # nothing relabelled
    # a run that needs more than the set holds is refused, saying what to do
    for k, need in ((None, "full logits"), (8, "the top 8")):
        cfg = fx.distill_config("squad", teacher, data, [unl], tmp_path / "s9", labels_dir=str(top), top_k=k,
                                student="layers:1", steps=1)
        with pytest.raises(LabelSetMismatch, match=f"top 4 logits only, this run needs {need}.*; set top_k=4"):
            run_distill(cfg)
    # a full set serves a top-k student (cut when read)
    r = run_distill(fx.distill_config("squad", teacher, data, [unl], tmp_path / "s3", labels_dir=str(full),
                                      top_k=3, student="layers:1", steps=1))
    assert r["pseudo_labels"]["reused"] and r["pseudo_labels"]["top_k"] == 3
    # relabelling into the top-k directory with another k is refused instead of mixing shards
    (top / "manifest.json").unlink()
    with pytest.raises(LabelSetMismatch, match="top_k_requested: set has 4, this run has 2"):
        run_pseudo_label(fx.distill_config("squad", teacher, data, [unl], tmp_path / "r", labels_dir=str(top),
                                           top_k=2))


def test_token_rows_of_different_lengths_batch_per_position():
    from bertdist.distill.train import _collate_top_k

    rng = np.random.default_rng(0)
    t_rows = [rng.standard_normal((3, 5)).astype(np.float32), rng.standard_normal((5, 5)).astype(np.float32)]
    feats = [{"input_ids": [1] * len(t), "loss_mask": [1] * len(t), **dict(zip(("teacher", "teacher_idx"),
                                                                                top_k_of(t, "token", 2)))}
             for t in t_rows]
    v, i = _collate_top_k(feats, 5)
    assert v.shape == i.shape == (2, 5, 2) and torch.equal(i[0, 3:], torch.zeros(2, 2, dtype=torch.long))
    student = torch.from_numpy(rng.standard_normal((2, 5, 5)).astype(np.float32))
    mask = torch.tensor([[1, 0, 1, 0, 0], [1, 1, 1, 1, 1]])  # the first row's padding is outside the mask
    got = losses.token_loss(student, v, mask, None, 2.0, 0.0, i)
    per_pos = [losses.topk_kl(student[b, s], v[b, s], i[b, s], 2.0).item()
               for b in range(2) for s in range(5) if mask[b, s]]
    assert got.item() == pytest.approx(sum(per_pos) / len(per_pos), rel=1e-6)
