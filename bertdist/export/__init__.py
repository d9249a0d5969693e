"""Hand-off to and from Hugging Face: HF model directories (hf.py), the tokenizer files
(tokenizer.py), DeepSpeed checkpoint consolidation (deepspeed_ckpt.py) and the one
entry that loads weights from any of our sources (sources.py)."""
from bertdist.export.hf import (
    ExportError,
    HFCheckpoint,
    from_hf_state_dict,
    is_hf_dir,
    read_hf_dir,
    to_hf_state_dict,
    write_hf_dir,
)
from bertdist.export.tokenizer import bert_tokenizer, infer_do_lower_case, read_vocab, vocab_sha256

__all__ = [
    "ExportError",
    "HFCheckpoint",
    "bert_tokenizer",
    "from_hf_state_dict",
    "infer_do_lower_case",
    "is_hf_dir",
    "read_hf_dir",
    "read_vocab",
    "to_hf_state_dict",
    "vocab_sha256",
    "write_hf_dir",
]
