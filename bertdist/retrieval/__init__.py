"""Retrieval: ranking metrics and fusion, a BM25 baseline with hard-negative mining, and the
SQuAD passage-retrieval split."""
