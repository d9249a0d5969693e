"""A minimal real DeepSpeed run of the tiny model (launched by the export tests with 2 CPU processes).

Trains a few MLM steps under the ZeRO stage given on the command line, saves a
DeepSpeed checkpoint with a resolved config beside it, and has every rank dump
what it holds so the test can check the consolidated fp32 weights:
  rank 0: the full module weights as the engine sees them (gathered under ZeRO-3).
Usage: ds_tiny_run.py OUT_DIR STAGE DTYPE(fp32|bf16) VOCAB_FILE
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402

from bertdist.config import to_dict  # noqa: E402
from bertdist.model import IGNORE_INDEX, BertConfig, BertForPreTraining  # noqa: E402


class MLMOnly(torch.nn.Module):
    """Wraps the model the way a trainer might (so the export must strip the prefix)."""

    def __init__(self, cfg):
        super().__init__()
        self.model = BertForPreTraining(cfg, device_type="cpu")

    def forward(self, ids, labels, nsp):
        return self.model(ids, torch.ones_like(ids), torch.zeros_like(ids), labels=labels, next_sentence_label=nsp).loss


def main() -> None:
    out, stage, dtype, vocab = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    cfg = BertConfig.from_preset("tiny", kernels="reference", hidden_dropout_prob=0.0,
                                 attention_probs_dropout_prob=0.0, max_position_embeddings=64)
    model = MLMOnly(cfg)
    ds_cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": dtype == "bf16"},
        "steps_per_print": 1000,
    }
    # Two groups (no weight decay on biases and layer norms), as the trainer builds them.
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if not (n.endswith("bias") or "LayerNorm" in n)], "weight_decay": 0.01},
              {"params": [p for n, p in named if n.endswith("bias") or "LayerNorm" in n], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_cfg)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(3):
        ids = torch.randint(1000, cfg.vocab_size, (2, 16), generator=g)
        labels = torch.full_like(ids, IGNORE_INDEX)
        labels[:, 3] = ids[:, 3]
        loss = engine(ids, labels, torch.zeros(2, dtype=torch.long))
        engine.backward(loss)
        engine.step()
    save_dir = os.path.join(out, "checkpoints")
    engine.save_checkpoint(save_dir, tag="step3")
    # The module weights as the engine holds them (ZeRO-3: gathered from the shards).
    params = [p for _, p in engine.module.named_parameters()]
    with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
        if rank == 0:
            full = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    if rank == 0:
        torch.save(full, os.path.join(out, "module_weights.pt"))
        run_cfg = {"model": to_dict(cfg), "data": {"vocab_file": vocab, "do_lower_case": True},
                   "deepspeed": ds_cfg}
        with open(os.path.join(save_dir, "step3", "config.yaml"), "w") as f:
            yaml.safe_dump(run_cfg, f)
    torch.distributed.barrier()


if __name__ == "__main__":
    from bertdist.cli.main import end_program

    main()
    end_program(0)
