"""A fine-tuned task model as a Hugging Face directory (``<Family>For<Task>`` of its backbone's
family: ``BertFor<Task>``, ``ElectraFor<Task>`` or ``ModernBertFor<Task>``, with its label names)
and the tokenizer it was fine-tuned with (the WordPiece vocab, or the checkpoint's tokenizer.json)."""
from __future__ import annotations

import json
from pathlib import Path

from bertdist.export.encoders import family_of
from bertdist.export.tokenizer import write_checkpoint_tokenizer


def write_task_model(out_dir: Path, model, runner, w, cfg) -> Path:
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().float().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    family = family_of(w.config)
    conf = family.hf_config(w.config, [family.hf_architecture(runner.kind)])
    conf.update(family.task_config(model))
    if runner.kind == "regression":
        conf.update(num_labels=1, problem_type="regression")
    elif runner.label_names:
        conf.update(id2label={str(i): n for i, n in enumerate(runner.label_names)},
                    label2id={n: i for i, n in enumerate(runner.label_names)})
    (out / "config.json").write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")
    vocab = cfg.vocab_file or w.vocab_file
    lower = cfg.do_lower_case if cfg.do_lower_case is not None else w.do_lower_case
    write_checkpoint_tokenizer(out, w, vocab, lower, w.config.max_position_embeddings)
    return out
