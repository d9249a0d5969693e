"""data_pipeline.beam.dedup: exact and near duplicates removed under TestPipeline, one kept per
cluster by a stable rule, counted, sampled, whatever the input order; and a build's shards with
duplicates do not depend on the input order or the worker count."""
from __future__ import annotations

import json
import random
import subprocess
import sys

import apache_beam as beam
import pytest
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.util import assert_that, equal_to

from data_pipeline import dedup
from data_pipeline.beam.dedup import Deduplicate
from data_pipeline.config import DedupConfig
from tests.conftest import REPO
from tests.data_pipeline.beam._util import OPTS

VOCAB = ("river bridge winter flood morning committee account hall grey old long agreed repair before arrived "
         "discussion town market bell tower stone road field harvest mill baker sheep church lane").split()


def prose(r: random.Random, sentences: int) -> str:
    return " ".join(" ".join(r.choice(VOCAB) for _ in range(r.randint(8, 16))).capitalize() + "."
                    for _ in range(sentences))


def edited(r: random.Random, text: str, fraction: float) -> str:
    words = text.split()
    for i in r.sample(range(len(words)), int(len(words) * fraction)):
        words[i] = r.choice(VOCAB) + "x"
    return " ".join(words)


def corpus(seed: int = 0) -> tuple[list[tuple[str, str]], set[str]]:
    """Unique documents, exact copies (case and spacing changed), and near copies (1% of words
    edited); returns the documents and the ids the stable rule (smallest id) keeps."""
    r = random.Random(seed)
    base = {f"doc{i:02d}": prose(r, 30) for i in range(12)}
    docs = dict(base)
    docs["doc01copy"] = base["doc01"].upper().replace(" ", "  ")  # exact: same normalized words
    docs["doc00b"] = base["doc00"] + "\n"
    docs["near02"] = edited(r, base["doc02"], 0.01)
    docs["near03"] = edited(r, base["doc03"], 0.01)
    docs["near03b"] = edited(r, base["doc03"], 0.01)
    docs["far04"] = edited(r, base["doc04"], 0.025)  # Jaccard 0.79 (seeds 0 and 3): near the threshold, below it
    keep = set(base) | {"far04"}  # each cluster keeps its smallest id: the base document
    assert jaccard(docs["doc04"], docs["far04"]) < 0.8
    return sorted(docs.items()), keep


def jaccard(a: str, b: str) -> float:
    sa, sb = (set(dedup.ngram_hashes(dedup.word_hashes(t), 5).tolist()) for t in (a, b))
    return len(sa & sb) / len(sa | sb)


def test_duplicates_removed_and_counted(tmp_path):
    docs, keep = corpus()
    r = random.Random(1)
    r.shuffle(docs)
    with TestPipeline(options=beam.options.pipeline_options.PipelineOptions(OPTS)) as p:
        out = p | beam.Create(docs) | Deduplicate("0-test", DedupConfig(), str(tmp_path))
        assert_that(out | beam.Keys(), equal_to(sorted(keep)))
    counters = {c.key.metric.name: c.committed for c in p.result.metrics().query()["counters"]}
    assert counters["dedup:0-test:exact_documents_removed"] == 2 and counters["dedup:0-test:exact_clusters"] == 2
    assert counters["dedup:0-test:near_documents_removed"] == 3 and counters["dedup:0-test:near_clusters"] == 2
    assert counters["dedup:0-test:near_words_removed"] > 3 * 200
    # far04 shares a band with doc04 and its estimate (0.72) is near the threshold: the exact check keeps it
    assert counters["dedup:0-test:candidates_rejected_on_exact_check"] == 1
    sample = json.loads((tmp_path / "dedup" / "0-test.json").read_text())
    kinds = sorted((row["kind"], row["removed"]) for row in sample["pairs"])
    assert [k for k, _ in kinds] == ["exact", "exact", "near", "near", "near"]
    assert {row["removed"] for row in sample["pairs"]}.isdisjoint(keep)
    assert all(row["kept"] in keep and row["kept_text"] for row in sample["pairs"] if row["kind"] == "near")
    assert all(row["removed_source"] == row["kept_source"] == "0-test" for row in sample["pairs"])


def test_exact_only_and_off():
    docs, _ = corpus()
    with TestPipeline(options=beam.options.pipeline_options.PipelineOptions(OPTS)) as p:
        exact = p | "A" >> beam.Create(docs) | "ExactOnly" >> Deduplicate("0", DedupConfig(near=False))
        assert_that(exact | "CountA" >> beam.combiners.Count.Globally(), equal_to([len(docs) - 2]), label="exact")
        off = p | "B" >> beam.Create(docs) | "Off" >> Deduplicate("1", DedupConfig(enabled=False))
        assert_that(off | "CountB" >> beam.combiners.Count.Globally(), equal_to([len(docs)]), label="off")


def two_sources(seed: int = 5) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Source A, and source B that repeats two of A's documents (one exactly, under an id that
    sorts before A's, one 1% edited) and one of its own, beside documents of its own."""
    r = random.Random(seed)
    a = {f"a{i}": prose(r, 30) for i in range(6)}
    b = {f"b{i}": prose(r, 30) for i in range(4)}
    b["0copy"] = a["a1"].lower()  # an exact copy whose id sorts first: the source order still wins
    b["0near"] = edited(r, a["a2"], 0.01)
    b["b0again"] = b["b0"] + " "
    return sorted(a.items()), sorted(b.items())


def test_duplicates_across_sources_are_removed_from_the_later_source(tmp_path):
    a, b = two_sources()
    r = random.Random(2)
    ra, rb = list(a), list(b)
    r.shuffle(ra)
    r.shuffle(rb)
    with TestPipeline(options=beam.options.pipeline_options.PipelineOptions(OPTS)) as p:
        pa, pb = p | "A" >> beam.Create(ra), p | "B" >> beam.Create(rb)
        ka, kb = (pa, pb) | "AB" >> Deduplicate(["0-a", "1-b"], DedupConfig(), str(tmp_path))
        assert_that(ka | "KA" >> beam.Keys(), equal_to([k for k, _ in a]), label="a_kept")
        assert_that(kb | "KB" >> beam.Keys(), equal_to(["b0", "b1", "b2", "b3"]), label="b_kept")
        # listed the other way round, the same clusters keep B's copies
        kb2, ka2 = (pb, pa) | "BA" >> Deduplicate(["0-b2", "1-a2"], DedupConfig())
        assert_that(kb2 | "KB2" >> beam.Keys(), equal_to(["0copy", "0near", "b0", "b1", "b2", "b3"]), label="b2")
        assert_that(ka2 | "KA2" >> beam.Keys(), equal_to(["a0", "a3", "a4", "a5"]), label="a2")
    counters = {c.key.metric.name: c.committed for c in p.result.metrics().query()["counters"]}
    assert counters["dedup:1-b:exact_documents_removed"] == 2  # 0copy (across) and b0again (within)
    assert counters["dedup:1-b:near_documents_removed"] == 1 and counters["dedup:1-b:near_words_removed"] > 200
    assert counters["dedup:1-b:cross_source_documents_removed"] == 2
    assert counters["dedup:0-a:exact_clusters"] == 1 and counters["dedup:0-a:near_clusters"] == 1
    assert "dedup:0-a:exact_documents_removed" not in counters and "dedup:0-a:cross_source_documents_removed" not in counters
    assert counters["dedup:1-a2:cross_source_documents_removed"] == 2
    sample = json.loads((tmp_path / "dedup" / "1-b.json").read_text())["pairs"]
    got = sorted((row["kind"], row["removed_source"], row["removed"], row["kept_source"], row["kept"]) for row in sample)
    assert got == [("exact", "1-b", "0copy", "0-a", "a1"), ("exact", "1-b", "b0again", "1-b", "b0"),
                   ("near", "1-b", "0near", "0-a", "a2")]
    assert json.loads((tmp_path / "dedup" / "0-a.json").read_text())["pairs"] == []


def test_sources_are_grouped_by_their_dedup_settings():
    """The build's wiring: dedup off for one source keeps its copies; a source with another
    threshold is deduplicated only within itself; the others across each other."""
    from data_pipeline.config import BuildConfig, InputConfig
    from data_pipeline.pipeline import deduplicate

    a, b = two_sources()
    cfg = BuildConfig(inputs=[InputConfig("jsonl", "a"), InputConfig("jsonl", "b", dedup=DedupConfig(enabled=False)),
                              InputConfig("jsonl", "c", dedup=DedupConfig(threshold=0.9)), InputConfig("jsonl", "d")])
    assert cfg.dedup_groups() == [[0, 3], [2]]
    with TestPipeline(options=beam.options.pipeline_options.PipelineOptions(OPTS)) as p:
        docs = [p | f"Create{i}" >> beam.Create(rows) for i, rows in enumerate((a, b, b, b))]
        kept = deduplicate(docs, cfg)
        assert kept[1] is docs[1]
        for i, want in ((0, [k for k, _ in a]), (2, ["0copy", "0near", "b0", "b1", "b2", "b3"]),
                        (3, ["b0", "b1", "b2", "b3"])):
            assert_that(kept[i] | f"Keys{i}" >> beam.Keys(), equal_to(want), label=f"kept{i}")


def _build(out, jsonls, vocab, workers: int) -> tuple[dict[str, bytes], dict]:
    """``bertdist data build`` of JSON-lines files (one source each) whose documents are named by their "id"."""
    config = out.parent / f"{out.name}.yaml"
    config.write_text(json.dumps({"inputs": [{"kind": "jsonl", "path": str(j), "id_field": "id"} for j in jsonls],
                                  "max_seq_length": 64, "dupe_factor": 1, "num_shards": 2, "heldout_fraction": 0.1}))
    mode = "in_memory" if workers == 1 else "multi_processing"
    cmd = [sys.executable, "-m", "bertdist.cli.main", "data", "build", "--config", str(config), "--vocab", str(vocab),
           "--output", str(out), "--runner=DirectRunner", f"--direct_running_mode={mode}",
           f"--direct_num_workers={workers}"]
    subprocess.run(cmd, check=True, cwd=REPO, capture_output=True)
    man = json.loads((out / "manifest.json").read_text())
    shards = {e["path"].rsplit("/", 1)[-1]: (out / e["path"]).read_bytes()
              for s in man["splits"].values() for e in s["shards"]}
    return shards, man


def test_the_kept_documents_and_the_sample_do_not_depend_on_input_order(tmp_path):
    docs, keep = corpus(3)
    outs = []
    for seed in (1, 2, 3):
        rows = list(docs)
        random.Random(seed).shuffle(rows)
        report = tmp_path / str(seed)
        with TestPipeline(options=beam.options.pipeline_options.PipelineOptions(OPTS)) as p:
            out = p | beam.Create(rows) | Deduplicate("0-test", DedupConfig(), str(report))
            assert_that(out, equal_to([d for d in docs if d[0] in keep]))
        outs.append((report / "dedup" / "0-test.json").read_bytes())
    assert outs[0] == outs[1] == outs[2]


@pytest.mark.slow
def test_shards_with_duplicates_do_not_depend_on_input_order_or_worker_count(tmp_path, small_vocab):
    """Two sources, the second repeating documents of the first (exactly and 1% edited) beside
    duplicates within each: the same shards for shuffled input and for 1 or 2 workers."""
    docs, keep = corpus(3)
    a, b = two_sources()
    second = b + [("x" + k, v) for k, v in docs if k in ("doc05", "doc06")]  # more cross-source copies
    for name, seed in (("a", None), ("b", 7)):
        for i, rows in enumerate((docs + a, second)):
            rows = list(rows)
            if seed is not None:
                random.Random(seed + i).shuffle(rows)
            (tmp_path / name).mkdir(exist_ok=True)
            with open(tmp_path / name / f"docs{i}.jsonl", "w") as f:  # same file names: ids carry them
                for doc_id, text in rows:
                    f.write(json.dumps({"id": doc_id, "text": text}) + "\n")
    files = lambda name: [tmp_path / name / f"docs{i}.jsonl" for i in range(2)]  # noqa: E731
    sa, man = _build(tmp_path / "out_a", files("a"), small_vocab, 1)
    sb, _ = _build(tmp_path / "out_b", files("b"), small_vocab, 2)
    assert sa == sb
    d0, d1 = man["dedup"]["sources"]["0-jsonl"], man["dedup"]["sources"]["1-jsonl"]
    assert d0["exact_documents_removed"] == 2 and d0["near_documents_removed"] == 3
    assert d0["cross_source_documents_removed"] == 0 and d0["exact_clusters"] == 5  # 2 within, 3 across
    assert d1["exact_clusters"] == 1 and d1["near_clusters"] == 0  # clusters count where the kept copy is
    # 1-jsonl: "0copy" and "b0again" exact, "0near" near, its copies of doc05 and doc06 exact
    assert d1["exact_documents_removed"] == 4 and d1["near_documents_removed"] == 1
    assert d1["cross_source_documents_removed"] == 4 and man["dedup"]["cross_source_documents_removed"] == 4
    assert d0["deduplicated_with"] == d1["deduplicated_with"] == ["0-jsonl", "1-jsonl"]
    assert man["counts"]["documents"] == len(keep) + len(a) + 4
    pairs = [json.loads(line) for line in (tmp_path / "out_a" / man["dedup"]["removed_pairs_sample"]).open()]
    assert len(pairs) == 10 and {p["removed"].rsplit(":", 1)[1] for p in pairs}.isdisjoint(keep)
    assert sorted(p["removed"].rsplit(":", 1)[1] for p in pairs if p["kept_source"] != p["removed_source"]) == [
        "0copy", "0near", "xdoc05", "xdoc06"]
