"""A fine-tuned task model as a Hugging Face directory (``BertFor<Task>``, or ``ElectraFor<Task>`` on
an ELECTRA backbone, with its label names)."""
from __future__ import annotations

import json
from pathlib import Path

from bertdist.export.hf import hf_config_dict
from bertdist.export.tokenizer import write_tokenizer_files
from bertdist.finetune.heads import hf_architecture


def write_task_model(out_dir: Path, model, runner, w, cfg) -> Path:
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().float().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    conf = hf_config_dict(w.config, [hf_architecture(runner.kind, w.config)])
    if runner.kind == "regression":
        conf.update(num_labels=1, problem_type="regression")
    elif runner.label_names:
        conf.update(id2label={str(i): n for i, n in enumerate(runner.label_names)},
                    label2id={n: i for i, n in enumerate(runner.label_names)})
    (out / "config.json").write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")
    vocab = cfg.vocab_file or w.vocab_file
    lower = cfg.do_lower_case if cfg.do_lower_case is not None else w.do_lower_case
    write_tokenizer_files(out, vocab, bool(lower), w.config.max_position_embeddings)
    return out
