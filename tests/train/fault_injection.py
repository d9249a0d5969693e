"""Run `bertdist pretrain` in this process with a real fault injected (used by the tests).

    python tests/train/fault_injection.py --kill-after-step N  -- <pretrain args>
    python tests/train/fault_injection.py --kill-in-save TAG   -- <pretrain args>

--kill-after-step: rank 0 SIGKILLs itself right after optimizer step N (a crash between checkpoints).
--kill-in-save: rank 0 SIGKILLs itself in the middle of writing checkpoint TAG, after half of the
first file DeepSpeed writes has reached the disk (a crash mid-save).
--nan-loss-on-rank R [--nan-loss-from-call K]: rank R's training loss is NaN from its K-th forward.
Works as a plain process or as a torchrun script.
"""
from __future__ import annotations

import argparse
import os
import signal


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--kill-after-step", type=int)
    p.add_argument("--kill-in-save")
    p.add_argument("--nan-loss-on-rank", type=int, help="this rank's training loss becomes NaN ...")
    p.add_argument("--nan-loss-from-call", type=int, default=1, help="... from this training forward on")
    args, rest = p.parse_known_args()
    if rest and rest[0] == "--":
        rest = rest[1:]
    rank = int(os.environ.get("RANK", "0"))
    if args.kill_after_step is not None and rank == 0:
        from bertdist.train import metrics

        orig = metrics.RunLogger.record

        def record(self, kind, step, values, tensorboard=True):
            orig(self, kind, step, values, tensorboard)
            if kind == "train" and step >= args.kill_after_step:
                os.kill(os.getpid(), signal.SIGKILL)

        metrics.RunLogger.record = record
    if args.kill_in_save and rank == 0:
        import torch

        orig_save = torch.save

        def save(obj, f, *a, **kw):
            if isinstance(f, (str, os.PathLike)) and f"/.staging/{args.kill_in_save}/" in os.fspath(f):
                import io

                buf = io.BytesIO()
                orig_save(obj, buf, *a, **kw)
                data = buf.getvalue()
                with open(f, "wb") as fh:
                    fh.write(data[: len(data) // 2])
                    fh.flush()
                    os.fsync(fh.fileno())
                os.kill(os.getpid(), signal.SIGKILL)
            return orig_save(obj, f, *a, **kw)

        torch.save = save
    if args.nan_loss_on_rank == rank:
        from bertdist.model import bert

        orig_forward = bert.BertForPreTraining.forward
        calls = [0]

        def forward(self, *a, **kw):
            out = orig_forward(self, *a, **kw)
            if self.training:
                calls[0] += 1
                if calls[0] >= args.nan_loss_from_call and out.loss is not None:
                    out.loss = out.loss * float("nan")
            return out

        bert.BertForPreTraining.forward = forward
    from bertdist.cli.pretrain import main as pretrain_main

    return pretrain_main(rest)


if __name__ == "__main__":
    from bertdist.cli.main import end_program

    end_program(main())
