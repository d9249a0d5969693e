"""Passage retrieval from SQuAD v1.1: questions against paragraphs, split by article.

The articles, in file order, alternate: articles 0, 2, 4, ... form the train half, 1, 3, 5, ...
the eval half. Alternating (rather than first half / second half) keeps both halves a mix of
the file's topics; splitting by article keeps a paragraph, and every question about its article,
on one side only.

* train: one (question, paragraph) pair per question of the train articles;
* eval: every question of the eval articles is a query against the corpus of all eval
  paragraphs; its one relevant paragraph is the one it was asked about.

Paragraph ids are ``a{article}-p{paragraph}`` with the article's index in the file and the
paragraph's index in its article; question ids are SQuAD's own.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from bertdist.finetune.errors import DataError


@dataclasses.dataclass
class RetrievalSplit:
    train_pairs: list[tuple[str, str]]  # (question, paragraph text)
    train_question_ids: list[str]
    train_paragraph_ids: list[str]  # the paragraph each train pair's text is
    eval_queries: list[str]
    eval_query_ids: list[str]
    eval_relevant: list[set[str]]  # paragraph ids, one per query
    corpus_ids: list[str]  # the eval paragraphs
    corpus: list[str]
    train_articles: list[str]  # titles
    eval_articles: list[str]

    def counts(self) -> dict[str, int]:
        return {"train_articles": len(self.train_articles), "train_pairs": len(self.train_pairs),
                "train_paragraphs": len(set(self.train_paragraph_ids)), "eval_articles": len(self.eval_articles),
                "eval_queries": len(self.eval_queries), "eval_paragraphs": len(self.corpus)}


def paragraph_id(article: int, paragraph: int) -> str:
    return f"a{article}-p{paragraph}"


def load_squad_retrieval(path: str | Path) -> RetrievalSplit:
    """The split of a SQuAD v1.1 JSON file (train-v1.1.json or dev-v1.1.json layout)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found (SQuAD v1.1 JSON, e.g. dev-v1.1.json)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not SQuAD JSON ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("data"), list) or not data["data"]:
        raise DataError(f"{path}: no articles: expected {{\"data\": [{{\"title\", \"paragraphs\": [...]}}, ...]}}")
    split = RetrievalSplit([], [], [], [], [], [], [], [], [], [])
    for a, article in enumerate(data["data"]):
        train = a % 2 == 0
        title = article.get("title", f"article {a}")
        (split.train_articles if train else split.eval_articles).append(title)
        for p, para in enumerate(article.get("paragraphs", [])):
            pid, context = paragraph_id(a, p), para.get("context", "")
            if not context.strip():
                raise DataError(f"{path}: article {a} ({title!r}) paragraph {p} has no context text")
            if not train:
                split.corpus_ids.append(pid)
                split.corpus.append(context)
            for qa in para.get("qas", []):
                question = qa.get("question", "")
                if not question.strip():
                    raise DataError(f"{path}: article {a} paragraph {p} question {qa.get('id')!r} is empty")
                if train:
                    split.train_pairs.append((question, context))
                    split.train_question_ids.append(qa["id"])
                    split.train_paragraph_ids.append(pid)
                else:
                    split.eval_queries.append(question)
                    split.eval_query_ids.append(qa["id"])
                    split.eval_relevant.append({pid})
    if not split.eval_articles:
        raise DataError(f"{path}: one article only: the alternate split needs at least two")
    return split


def write_retrieval_dir(split: RetrievalSplit, out: str | Path) -> dict[str, int]:
    """The split as files the retrieval commands read: ``train.jsonl`` (train half) and
    ``dev.jsonl`` (eval half), rows ``{"query", "positive"}`` for `bertdist finetune embed|rerank`;
    ``corpus.jsonl`` (``{"id", "text"}``, the eval paragraphs) for `bertdist embed`; ``queries.txt``
    (the eval questions, one a line) for `bertdist search --query-file`. Existing files are never
    overwritten."""
    out = Path(out)
    names = ("train.jsonl", "dev.jsonl", "corpus.jsonl", "queries.txt")
    taken = [n for n in names if (out / n).exists()]
    if taken:
        raise DataError(f"{out}: already holds {taken}; choose an empty directory")
    out.mkdir(parents=True, exist_ok=True)
    text = dict(zip(split.corpus_ids, split.corpus))
    rows = {
        "train.jsonl": [{"query": q, "positive": p} for q, p in split.train_pairs],
        "dev.jsonl": [{"query": q, "positive": text[next(iter(rel))]} for q, rel in zip(split.eval_queries, split.eval_relevant)],
        "corpus.jsonl": [{"id": i, "text": t} for i, t in zip(split.corpus_ids, split.corpus)],
    }
    for name, items in rows.items():
        (out / name).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in items), encoding="utf-8")
    # a question is one line: SQuAD has a few with line breaks inside
    (out / "queries.txt").write_text("".join(" ".join(q.split()) + "\n" for q in split.eval_queries), encoding="utf-8")
    return {name: len(items) for name, items in rows.items()} | {"queries.txt": len(split.eval_queries)}
