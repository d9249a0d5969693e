"""SQuAD v1.1 / v2.0: reading the JSON, document-stride windows, and n-best span decoding.

A context longer than the window is cut into overlapping windows
(``doc_stride`` tokens of overlap); each window is one model input. At
prediction time every window proposes its ``n_best`` start and end positions;
valid spans (inside the context, end >= start, at most ``max_answer_length``
tokens) are scored start + end logit, and the best over all windows wins. For
v2.0 the no-answer score is the smallest [CLS] start + end over the windows; the
question gets no answer when that beats the best span by more than
``null_threshold``.
"""
from __future__ import annotations

import collections
import dataclasses
import json
from pathlib import Path

import numpy as np

from bertdist.finetune.errors import DataError, not_utf8


@dataclasses.dataclass
class SquadExample:
    qid: str
    question: str
    context: str
    answers: list[tuple[str, int]]  # (text, char start); empty for unanswerable (v2.0)
    is_impossible: bool


def read_squad(path: str | Path, limit_articles: tuple[int, int] | None = None) -> tuple[list[SquadExample], str]:
    """Examples and the version string; each answer must be the context's text at answer_start."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON ({e})") from None
    except UnicodeDecodeError as e:
        raise not_utf8(path, e) from None
    if not isinstance(data, dict) or not isinstance(data.get("data"), list):
        raise DataError(f"{path}: not a SQuAD file (no top-level 'data' list)")
    version = str(data.get("version", "1.1"))
    articles = data["data"]
    if limit_articles is not None:
        articles = articles[limit_articles[0]:limit_articles[1]]
    try:
        return _examples(path, articles), version
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        if isinstance(e, DataError):
            raise
        what = f"missing key {e}" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
        raise DataError(f"{path}: not a SQuAD file: an article, paragraph, question or answer is malformed "
                        f"({what})") from None


def _examples(path: Path, articles: list) -> list[SquadExample]:
    out = []
    for a in articles:
        for p in a.get("paragraphs", []):
            ctx = p["context"]
            for q in p["qas"]:
                impossible = bool(q.get("is_impossible", False))
                answers = []
                for ans in ([] if impossible else q.get("answers", [])):
                    text, start = ans["text"], int(ans["answer_start"])
                    if ctx[start:start + len(text)] != text:
                        raise DataError(
                            f"{path}: question {q['id']}: answer {text!r} does not match the context at "
                            f"answer_start {start} (context there: {ctx[start:start + len(text)]!r})"
                        )
                    answers.append((text, start))
                if not impossible and not answers:
                    raise DataError(f"{path}: question {q['id']} has no answers and is not marked is_impossible")
                out.append(SquadExample(q["id"], q["question"], ctx, answers, impossible))
    return out


@dataclasses.dataclass
class SquadFeatures:
    inputs: list[dict]  # per window: input_ids, token_type_ids, attention_mask (+ start/end positions)
    example_index: list[int]  # window -> example
    offsets: list[list[tuple[int, int] | None]]  # window token -> context char span (None outside context)


def make_features(examples: list[SquadExample], tokenizer, max_seq_length: int, doc_stride: int,
                  max_query_length: int, train: bool) -> SquadFeatures:
    questions, longest = [], 0
    for e in examples:  # long questions are cut to max_query_length tokens, as in BERT's run_squad
        q_ids = tokenizer(e.question, add_special_tokens=False)["input_ids"]
        questions.append(tokenizer.decode(q_ids[:max_query_length]) if len(q_ids) > max_query_length else e.question)
        longest = max(longest, min(len(q_ids), max_query_length))
    room = max_seq_length - longest - 3  # [CLS] question [SEP] context [SEP]
    if examples and not 0 < doc_stride < room:
        # windows overlap by doc_stride tokens, so each must leave room for new context
        raise DataError(f"doc_stride={doc_stride} must be positive and below the context's room in a window: "
                        f"max_seq_length ({max_seq_length}) - the longest question ({longest} tokens, at most "
                        f"max_query_length {max_query_length}) - 3 = {room}")
    enc = tokenizer(
        questions, [e.context for e in examples], truncation="only_second", max_length=max_seq_length,
        stride=doc_stride, return_overflowing_tokens=True, return_offsets_mapping=True,
    )
    inputs, ex_index, offsets = [], [], []
    for i in range(len(enc["input_ids"])):
        ei = enc["overflow_to_sample_mapping"][i]
        seq_ids = enc.sequence_ids(i)
        offs = [tuple(o) if s == 1 else None for o, s in zip(enc["offset_mapping"][i], seq_ids)]
        feat = {"input_ids": enc["input_ids"][i], "token_type_ids": enc["token_type_ids"][i],
                "attention_mask": enc["attention_mask"][i]}
        if train:
            ex = examples[ei]
            start_pos = end_pos = 0  # [CLS]: no answer in this window
            if ex.answers:
                text, cs = ex.answers[0]
                ce = cs + len(text)
                ctx_tokens = [j for j, o in enumerate(offs) if o is not None]
                if offs[ctx_tokens[0]][0] <= cs and offs[ctx_tokens[-1]][1] >= ce:
                    start_pos = next(j for j in ctx_tokens if offs[j][1] > cs)
                    end_pos = next(j for j in reversed(ctx_tokens) if offs[j][0] < ce)
            feat["start_positions"], feat["end_positions"] = start_pos, end_pos
        inputs.append(feat)
        ex_index.append(ei)
        offsets.append(offs)
    return SquadFeatures(inputs, ex_index, offsets)


def decode_predictions(
    examples: list[SquadExample], feats: SquadFeatures, start_logits: list[np.ndarray], end_logits: list[np.ndarray],
    n_best: int = 20, max_answer_length: int = 30, version_2: bool = False, null_threshold: float = 0.0,
) -> tuple[dict[str, str], dict[str, list[dict]]]:
    """Best answer text per question id, and the n-best list (text, score) for each."""
    by_example = collections.defaultdict(list)
    for fi, ei in enumerate(feats.example_index):
        by_example[ei].append(fi)
    preds, nbest_out = {}, {}
    for ei, ex in enumerate(examples):
        cands, null_score = [], None
        for fi in by_example.get(ei, []):
            s, e, offs = start_logits[fi], end_logits[fi], feats.offsets[fi]
            cls = float(s[0] + e[0])
            null_score = cls if null_score is None else min(null_score, cls)
            for a in np.argsort(s)[::-1][:n_best]:
                for b in np.argsort(e)[::-1][:n_best]:
                    if a >= len(offs) or b >= len(offs) or offs[a] is None or offs[b] is None:
                        continue
                    if b < a or b - a + 1 > max_answer_length:
                        continue
                    cands.append((float(s[a] + e[b]), offs[a][0], offs[b][1]))
        cands.sort(key=lambda c: -c[0])
        seen, nbest = set(), []
        for score, cs, ce in cands:
            text = ex.context[cs:ce].strip()  # a byte-level BPE token's span starts at the space before it
            if text in seen:
                continue
            seen.add(text)
            nbest.append({"text": text, "score": score})
            if len(nbest) >= n_best:
                break
        if version_2 and null_score is not None:
            nbest.append({"text": "", "score": null_score})
            nbest.sort(key=lambda c: -c["score"])
        best_span = next((c for c in nbest if c["text"]), None)
        if best_span is None:
            answer = ""
        elif version_2 and null_score is not None and null_score - best_span["score"] > null_threshold:
            answer = ""
        else:
            answer = best_span["text"]
        preds[ex.qid] = answer
        nbest_out[ex.qid] = nbest
    return preds, nbest_out
