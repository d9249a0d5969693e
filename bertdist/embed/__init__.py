"""Sentence embeddings: pooling heads, contrastive and similarity losses, cross-rank in-batch
negatives, and the readers for their training files."""
