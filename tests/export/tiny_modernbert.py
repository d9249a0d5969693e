"""A tiny ModernBERT for tests: a byte-level BPE ``tokenizer.json`` trained here on a few sentences
(as ModernBERT's own tokenizer is: byte-level BPE, ``[CLS] A [SEP] B [SEP]``) and a randomly
initialised ``transformers.ModernBertForMaskedLM`` saved beside it. Nothing is downloaded."""
from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]  # ids 0..4
CORPUS = [
    "a great film", "the movie was lovely", "this story is truly good", "a fine and fun film",
    "it is a very good movie", "the film was great fun", "quite a lovely story", "truly fine",
    "a dull film", "the movie was awful", "this story is truly bad", "a boring and poor film",
    "it is a very bad movie", "the film was not good", "quite a dull story", "truly awful",
    "The man is cooking dinner in the afternoon.", "A woman is reading a book near the river.",
    "In 1921, the old farmer from the village paints the fence.", "Who wrote the letter? When did it happen?",
    "John Smith lives in Paris and works for Acme Corp in London.", "Mary visited Berlin with Peter.",
]


def write_bpe_tokenizer(out: Path, vocab_size: int = 300, max_length: int = 128) -> Path:
    """tokenizer.json (byte-level BPE with the [CLS]/[SEP] template) + tokenizer_config.json in ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length, "cls_token": "[CLS]",
        "sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]", "mask_token": "[MASK]",
        "model_input_names": ["input_ids", "attention_mask"]}, indent=2))
    return out


def write_hf_modernbert(out: Path, seed: int = 0, **config) -> Path:
    """A randomly initialised tiny ``ModernBertForMaskedLM`` saved by transformers, with the BPE tokenizer."""
    import torch
    import transformers

    write_bpe_tokenizer(out)
    n = len(json.loads((out / "tokenizer.json").read_text())["model"]["vocab"])
    torch.manual_seed(seed)
    conf = transformers.ModernBertConfig(**{
        "vocab_size": n + (-n) % 8, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
        "num_attention_heads": 2, "max_position_embeddings": 128, "local_attention": 16, "pad_token_id": 0,
        "bos_token_id": 2, "eos_token_id": 3, "cls_token_id": 2, "sep_token_id": 3, **config})
    transformers.ModernBertForMaskedLM(conf).save_pretrained(out)
    return out
