"""`bertdist submit pretrain|probe|data|pseudo-label`: take a recipe from this machine to a cluster.

Scripts, hostfiles and manifests are rendered from the training config itself
(cluster/); the job re-reads that same file. --dry-run prints what would be
submitted and submits nothing.
"""
from __future__ import annotations

import shlex
import sys
from pathlib import Path

from bertdist.cli.errors import exit_2_on
from cluster.errors import SubmitError
from cluster.safe_values import one_line


def _add_resources(p) -> None:
    g = p.add_argument_group("resources")
    from cluster.submit import SCHEDULERS

    g.add_argument("--scheduler", choices=SCHEDULERS, default="slurm")
    g.add_argument("--nodes", type=int, default=1)
    g.add_argument("--gpus-per-node", type=int, default=None, help="GPUs (= training processes) per node")
    g.add_argument("--gpus", type=int, default=None, help="total GPUs, spread evenly over --nodes")
    g.add_argument("--procs-per-node", type=int, default=0,
                   help="processes per node on CPU nodes (default: one per GPU, or 1)")
    g.add_argument("--cpus-per-task", type=int, default=0, help="CPU cores per process (default: scheduler's)")
    g.add_argument("--partition", default=None)
    g.add_argument("--time", default=None, help="time limit, SLURM syntax (e.g. 2-00:00:00)")
    g.add_argument("--account", default=None)
    g.add_argument("--launcher", choices=("srun", "torchrun"), default="srun",
                   help="SLURM: srun starts every process, or one torchrun agent per node")
    g.add_argument("--grace", type=int, default=120,
                   help="seconds between SIGTERM and the time limit / pod kill, to write a checkpoint")
    g.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="extra environment for every process (repeatable; overrides the NCCL defaults). "
                        "Written into the job files (created 0600). --ds-launcher pdsh takes only values of "
                        "letters, digits and _./:,=@%%+- (use --ds-launcher ssh for others) and puts them on "
                        "pdsh's command line, where `ps` on a node shows them; --ds-launcher ssh keeps them in "
                        "the 0600 env file, off every command line; --scheduler k8s "
                        "refuses names containing key/secret/token/password/credential: use --env-secret")
    g.add_argument("--nccl-ifname", default=None, help="NCCL_SOCKET_IFNAME, e.g. ib0 or ^lo,docker")
    g.add_argument("--python", default=sys.executable,
                   help="interpreter on the compute nodes (default: this one, on a shared filesystem)")
    g.add_argument("--name", default=None, help="job name: letters, digits, '.', '_', '-' "
                                                   "(default: bertdist-<config stem>)")
    g.add_argument("--dry-run", action="store_true", help="print what would be submitted; submit nothing")
    d = p.add_argument_group("deepspeed (no scheduler)")
    d.add_argument("--hosts", default=None, help="comma-separated node names, first = master")
    d.add_argument("--ds-launcher", choices=("pdsh", "ssh"), default="pdsh",
                   help="pdsh: DeepSpeed's runner reaches the nodes with pdsh, --env values visible in `ps` "
                        "there; ssh: one command per node, which sources the --env values from a 0600 file "
                        "in the job folder (not visible in `ps`)")
    d.add_argument("--master-port", type=int, default=29500)
    k = p.add_argument_group("kubernetes (Kubeflow PyTorchJob)")
    k.add_argument("--image", default=None, help="container image with bertdist installed")
    k.add_argument("--namespace", default=None)
    k.add_argument("--workdir-pvc", default="bertdist-workdir", help="PVC holding code + configs, mounted at the cwd")
    k.add_argument("--data-pvc", default="bertdist-data", help="PVC holding the shards, mounted at their directory")
    k.add_argument("--run-pvc", default="bertdist-runs", help="PVC for checkpoints and logs, mounted at run_dir")
    k.add_argument("--shm-size", default="16Gi", help="size of the in-memory /dev/shm volume")
    k.add_argument("--env-secret", action="append", default=[], metavar="NAME=SECRET/KEY",
                   help="set NAME from key KEY of the Kubernetes Secret SECRET (valueFrom.secretKeyRef): "
                        "the value never appears in the manifest (repeatable)")


def _resources(args):
    from cluster.spec import Resources, gpus_per_node_from_total, parse_env

    if args.gpus is not None and args.gpus_per_node is not None:
        raise SubmitError("give --gpus (total) or --gpus-per-node, not both")
    gpn = args.gpus_per_node or 0
    if args.gpus is not None:
        gpn = gpus_per_node_from_total(args.gpus, args.nodes)
    return Resources(
        nodes=args.nodes, gpus_per_node=gpn, procs_per_node=args.procs_per_node,
        cpus_per_task=args.cpus_per_task, partition=args.partition, time=args.time,
        account=args.account, launcher=args.launcher, requeue_grace_s=args.grace,
        extra_env=parse_env(args.env),
    ).validate()


def _request(args, *, name: str, run_dir: Path, label: str, program_argv: list[str], program_module: list[str],
             job=None):
    """The launch the command line asks for (cluster.submit does the rest)."""
    from cluster import k8s
    from cluster.spec import parse_env_secrets
    from cluster.submit import DeepSpeedHosts, LaunchRequest

    return LaunchRequest(
        scheduler=args.scheduler, name=name, run_dir=run_dir, label=label, program_argv=program_argv,
        program_module=program_module, resources=_resources(args), python=args.python,
        nccl_ifname=args.nccl_ifname, job=job, dry_run=args.dry_run,
        deepspeed=DeepSpeedHosts(args.hosts, args.ds_launcher, args.master_port) if args.hosts else None,
        k8s=k8s.K8sOptions(image=args.image or "", namespace=args.namespace, workdir_pvc=args.workdir_pvc,
                           data_pvc=args.data_pvc, run_pvc=args.run_pvc, shm_size=args.shm_size,
                           env_secrets=parse_env_secrets(args.env_secret)))


def run_pretrain(args) -> int:
    from cluster.submit import launch
    from cluster.training import read_training_job

    job = read_training_job(args.config, args.overrides, check_data=True, name=args.name)
    return launch(_request(args, name=job.name, run_dir=job.run_dir, label=f"training config {job.config_path}",
                           program_argv=job.command(args.python), program_module=job.command(launcher_module=True),
                           job=job))


def run_probe(args) -> int:
    from cluster.submit import launch

    out = Path(one_line("--out", args.out)).resolve()
    tail = ["cluster.probe", "--out", str(out)]
    return launch(_request(args, name=args.name or "bertdist-probe", run_dir=out, label="launch probe (cluster.probe)",
                           program_argv=[args.python, "-m", *tail], program_module=["-m", *tail]))


def pseudo_label_tail(args) -> list[str]:
    """``bertdist.cli.main pseudo-label ...`` with absolute paths (the job may start elsewhere), after
    checking what the job would otherwise fail on once it leaves the queue."""
    from bertdist.config import ConfigError
    from bertdist.distill.config import load_distill_config

    teacher, data = Path(args.teacher).expanduser().resolve(), Path(args.data).expanduser().resolve()
    if not (teacher / "vocab.txt").is_file():
        raise SubmitError(f"--teacher {args.teacher}: no vocab.txt there; a fine-tuned task model directory "
                          "(`bertdist finetune ... --set save_model=true` writes one under OUT/model)")
    if not data.is_dir():
        raise SubmitError(f"--data {args.data}: not a directory (the task's directory)")
    unlabeled = [Path(u).expanduser().resolve() for u in args.unlabeled]
    missing = [str(u) for u in unlabeled if not u.is_file()]
    if missing:
        raise SubmitError(f"--unlabeled: no such file: {', '.join(missing)}")
    config = Path(args.config).expanduser().resolve() if args.config else None
    if config is not None and not config.is_file():
        raise SubmitError(f"--config {args.config}: no such file")
    try:  # unknown keys and bad values fail here, not in the queue
        load_distill_config(str(config) if config else None, list(args.set))
    except ConfigError as e:
        raise SubmitError(f"{config or 'the distill config'}: {e}") from None
    tail = ["bertdist.cli.main", "pseudo-label", args.task, "--teacher", str(teacher), "--data", str(data),
            "--unlabeled", *map(str, unlabeled), "--out", str(Path(args.out).expanduser().resolve())]
    if config is not None:
        tail += ["--config", str(config)]
    return tail + [x for o in args.set for x in ("--set", o)]


def run_pseudo_label(args) -> int:
    from cluster.submit import launch

    one_line("--out", args.out)
    tail = pseudo_label_tail(args)
    out = Path(args.out).expanduser().resolve()
    return launch(_request(args, name=args.name or f"bertdist-pseudo-label-{args.task}", run_dir=out,
                           label=f"pseudo-labelling {args.task} into {out}",
                           program_argv=[args.python, "-m", *tail], program_module=["-m", *tail]))


_guard = exit_2_on("bertdist submit", SubmitError)


def register(sub) -> None:
    p = sub.add_parser("submit", help="submit a pretraining run, launch probe, data or pseudo-labelling job to a cluster")
    s = p.add_subparsers(dest="what", metavar="WHAT", required=True)
    pt = s.add_parser("pretrain", help="run `bertdist pretrain <config> --resume auto` on a cluster")
    pt.add_argument("config", help="training config YAML (the job re-reads this file)")
    pt.add_argument("overrides", nargs="*", help="dotted overrides passed through, e.g. data.micro_batch_size=16")
    _add_resources(pt)
    pt.set_defaults(func=_guard(run_pretrain))
    pr = s.add_parser("probe", help="check a launch path: every rank joins and all-reduces once")
    pr.add_argument("--out", required=True, help="directory for rank-<r>.json results and job logs")
    _add_resources(pr)
    pr.set_defaults(func=_guard(run_probe))
    da = s.add_parser("data", help="run the Beam data pipeline: one-node SLURM job, or a distributed runner")
    da.add_argument("config", help="data pipeline config YAML (the job re-reads this file)")
    da.add_argument("overrides", nargs="*", help="dotted overrides passed through")
    da.add_argument("--runner", choices=("direct", "dataflow", "flink", "spark"), default="direct")
    da.add_argument("--scheduler", choices=("slurm", "local"), default="slurm",
                    help="where the pipeline driver runs (direct runner: also where the work runs)")
    da.add_argument("--cpus", type=int, default=8, help="direct runner: cores (= worker processes) on the node")
    da.add_argument("--workers", type=int, default=0, help="flink/spark parallelism, dataflow max workers")
    da.add_argument("--partition", default=None)
    da.add_argument("--account", default=None)
    da.add_argument("--time", default=None)
    da.add_argument("--project", default=None, help="dataflow: GCP project")
    da.add_argument("--region", default=None, help="dataflow: GCP region")
    da.add_argument("--temp-location", default=None, help="dataflow: gs:// temp location")
    da.add_argument("--flink-master", default=None, help="flink: JobManager host:port")
    da.add_argument("--spark-master", default=None, help="spark: spark://host:port")
    da.add_argument("--environment-type", default=None, help="portable runners: DOCKER, PROCESS, EXTERNAL, LOOPBACK")
    da.add_argument("--sdk-container-image", default=None)
    da.add_argument("--python", default=sys.executable)
    da.add_argument("--name", default=None)
    da.add_argument("--log-dir", default=None, help="SLURM logs and script (default: <output>/../jobs)")
    da.add_argument("--dry-run", action="store_true")
    da.set_defaults(func=_guard(run_data))
    pl = s.add_parser("pseudo-label", help="run `bertdist pseudo-label` on a cluster: the ranks split the shards, "
                                           "a requeued job labels only the missing ones")
    pl.add_argument("task", help="a GLUE task, stsb, ner, squad or squad2")
    pl.add_argument("--teacher", required=True, help="a fine-tuned task model directory")
    pl.add_argument("--data", required=True, help="the task's directory")
    pl.add_argument("--unlabeled", nargs="+", required=True, metavar="PATH", help="unlabelled text files")
    pl.add_argument("--out", required=True, help="the pseudo-label directory (job logs go to OUT/jobs)")
    pl.add_argument("--config", default=None, help="a YAML from configs/distill/")
    pl.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config field, e.g. --set top_k=20 --set label_batch_size=256")
    _add_resources(pl)
    # one torchrun agent per node, rendezvous at the first node (srun: one task per process)
    pl.set_defaults(func=_guard(run_pseudo_label), launcher="torchrun")


def data_command(python: str, config: Path, overrides: list[str], beam_args: list[str]) -> list[str]:
    """`bertdist data build --config <file> --set k=v ... <Beam options>` (unknown options go to Beam)."""
    sets = [x for o in overrides for x in ("--set", o)]
    return [python, "-m", "bertdist.cli.main", "data", "build", "--config", str(config), *sets, *beam_args]


def run_data(args) -> int:
    from bertdist.config import ConfigError, apply_overrides, load_yaml

    from cluster import beam, local, slurm
    from cluster.spec import Resources
    from cluster.submit import submit_slurm_script

    cfg = Path(args.config).expanduser()
    if not cfg.is_file():
        raise SubmitError(f"data config not found: {cfg}")
    cfg = cfg.resolve()
    try:
        from data_pipeline.config import BuildConfig

        data = apply_overrides(BuildConfig, load_yaml(cfg), args.overrides)
    except ConfigError as e:
        raise SubmitError(f"{cfg}: {e}") from None
    # Local inputs must exist before a job waits in the queue for them (remote URLs are the runner's business).
    for item in data.get("inputs") or []:
        path = str(item.get("path", "")) if isinstance(item, dict) else ""
        if path and "://" not in path and not any(c in path for c in "*?[") and not Path(path).expanduser().exists():
            raise SubmitError(f"input path in {cfg.name} does not exist: {path}")
    vocab = str(data.get("vocab") or "")
    if vocab and "://" not in vocab and not Path(vocab).expanduser().exists():
        raise SubmitError(f"vocab in {cfg.name} does not exist: {vocab}")
    workers = args.cpus if args.runner == "direct" else args.workers
    ropts = beam.RunnerOptions(
        runner=args.runner, workers=workers, project=args.project, region=args.region,
        temp_location=args.temp_location, job_name=args.name, flink_master=args.flink_master,
        spark_master=args.spark_master, environment_type=args.environment_type,
        sdk_container_image=args.sdk_container_image)
    command = data_command(args.python, cfg, args.overrides, beam.runner_args(ropts))
    name = args.name or f"bertdist-data-{cfg.stem}"
    output = Path(str(data.get("output") or "data_out")).expanduser().resolve()
    log_dir = Path(args.log_dir).resolve() if args.log_dir else output.parent / "jobs"
    if args.scheduler == "local" or args.runner != "direct":
        # Distributed runners: this machine only drives the pipeline; the runner does the work.
        if args.dry_run:
            print(shlex.join(command))
            return 0
        return local.run_local(command, Resources())
    script = slurm.render_data_script(cfg, command, name=name, log_dir=log_dir, cpus=args.cpus,
                                      partition=args.partition, account=args.account, time=args.time)
    if args.dry_run:
        print(script, end="")
        return 0
    submit_slurm_script(script, name=name, log_dir=log_dir,
                        record={"scheduler": "slurm", "what": f"data config {cfg}", "output": str(output)})
    return 0
