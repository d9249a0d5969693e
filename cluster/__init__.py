"""Cluster job submission: renders SLURM batch scripts, DeepSpeed hostfiles and
launcher commands, Kubernetes PyTorchJob manifests and local launch commands
from the *same* training config file a local run uses (the job re-reads that
file; nothing here writes a second copy of it).

Modules:
  spec       - the resources a job asks for (nodes, GPUs, partition, ...) and their checks
  training   - what a job needs to know about a training config (run dir, data, batch)
  launch     - the per-process command and the NCCL / threading environment
  slurm      - SLURM batch script rendering, sbatch submission, squeue/scontrol/sacct queries
  deepspeed_launch - hostfile + `deepspeed` launcher command (pdsh or per-node ssh)
  k8s        - Kubeflow PyTorchJob manifest + validation against schemas/pytorchjob.v1.json
  local      - the same launch on this machine (torchrun --standalone)
  beam       - Beam runner options for data jobs (Direct, Dataflow, Flink, Spark)
  safe_values   - checks for values pasted into scripts and commands (names, hosts, pdsh words)
  private_files - job files written owner-only (0600, scripts 0700)
"""
from cluster.errors import SubmitError

__all__ = ["SubmitError"]
