"""DeepSpeed pretraining (`bertdist pretrain`): config, loader, optimizers, schedules, checkpoints, trainer.

Entry points: ``load_train_config(yaml, overrides)`` and ``run_pretraining(cfg, resume=None|"auto"|path)``.
Heavy imports (deepspeed) happen inside ``run_pretraining``.
"""
from bertdist.train.config import TrainConfig, check_batch_sizes, load_train_config, train_config_from_dict


def run_pretraining(cfg, resume=None, overwrite=False):
    from bertdist.train.trainer import run_pretraining as _run

    return _run(cfg, resume, overwrite)


__all__ = ["TrainConfig", "check_batch_sizes", "load_train_config", "run_pretraining", "train_config_from_dict"]
