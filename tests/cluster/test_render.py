"""Rendering: golden files for the SLURM script, DeepSpeed hostfile/commands and the PyTorchJob,
plus semantic checks (bash syntax, sbatch directives, DeepSpeed's own parsers, the PyTorchJob
schema, Beam's own option parser) and the bad-input errors."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from cluster import beam, deepspeed_launch, k8s, local, slurm
from cluster.errors import SubmitError
from cluster.spec import Resources, gpus_per_node_from_total
from cluster.training import TrainingJob, read_training_job

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("BERTDIST_UPDATE_GOLDEN") == "1"
PY = "/opt/bertdist/.venv/bin/python"
WORKDIR = Path("/shared/bertdist")

JOB = TrainingJob(
    config_path=WORKDIR / "configs/pretrain/bert-large.yaml",
    overrides=("data.micro_batch_size=16",),
    run_dir=Path("/shared/runs/bert-large-p1"),
    data_paths=(Path("/shared/data/wiki-128/manifest.json"), Path("/shared/data/vocab.txt")),
    name="bertdist-bert-large",
    global_batch=4096,
    micro_batch=16,
)
GPU4x8 = Resources(nodes=4, gpus_per_node=8, cpus_per_task=6, partition="gpu", time="2-00:00:00", account="nlp")


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if UPDATE:
        path.write_text(text)
    assert path.exists(), f"golden file {path} missing; render it with BERTDIST_UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"{name} differs from its golden file (BERTDIST_UPDATE_GOLDEN=1 to accept)"


def _directives(script: str) -> dict[str, str]:
    out = {}
    for line in script.splitlines():
        if line.startswith("#SBATCH "):
            opt = line.split(None, 1)[1]
            k, _, v = opt.partition("=")
            out[k] = v
    return out


def _assert_pretrain_cli_parses(argv: list[str]) -> None:
    """The rendered `pretrain ...` arguments mean what we intend to bertdist's own parser."""
    from bertdist.cli.main import build_parser

    args = build_parser().parse_args(argv)
    assert args.command == "pretrain" and args.resume == "auto" and args.config == str(JOB.config_path)
    assert args.overrides == list(JOB.overrides)


# ---------------------------------------------------------------- SLURM
def test_slurm_pretrain_script_golden_and_semantics():
    script = slurm.render_pretrain_script(JOB, GPU4x8, python=PY, workdir=WORKDIR, nccl_ifname="ib0")
    check_golden("slurm_pretrain_4x8.sbatch", script)
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)  # valid bash
    d = _directives(script)
    assert d["--nodes"] == "4" and d["--ntasks-per-node"] == "8" and d["--gpus-per-node"] == "8"
    assert d["--cpus-per-task"] == "6" and d["--partition"] == "gpu" and d["--account"] == "nlp"
    assert d["--time"] == "2-00:00:00"
    assert "--requeue" in d and d["--signal"] == "B:TERM@120" and d["--open-mode"] == "append"
    assert d["--output"] == "/shared/runs/bert-large-p1/jobs/%x-%j.out"
    # rendezvous from the node list; ranks from SLURM's per-task variables
    assert 'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in script
    assert "RANK=$SLURM_PROCID" in script and "LOCAL_RANK=$SLURM_LOCALID" in script
    assert "WORLD_SIZE=$SLURM_NTASKS" in script
    assert "export NCCL_SOCKET_IFNAME=ib0" in script and "export NCCL_DEBUG=WARN" in script
    # the job re-reads the same config file (no copy), resumes automatically, passes overrides through
    srun = script[script.index("\nsrun ") + 1:script.index("&\nstep_pid")]
    argv = shlex.split(srun.replace("\\\n", " "))
    tail = argv[argv.index(PY):]
    assert tail == [PY, "-m", "bertdist.cli.main", "pretrain", "--resume", "auto", str(JOB.config_path),
                    "data.micro_batch_size=16"]
    _assert_pretrain_cli_parses(tail[3:])
    assert "trap on_term TERM" in script and 'scontrol requeue "$SLURM_JOB_ID"' in script
    # SIGTERM reaches the training tasks through scancel, never through srun (which would kill them)
    assert 'scancel --signal=TERM "$SLURM_JOB_ID"' in script and "kill -TERM" not in script


def test_slurm_torchrun_launcher_one_agent_per_node():
    res = Resources(nodes=2, gpus_per_node=4, launcher="torchrun", cpus_per_task=4)
    script = slurm.render_pretrain_script(JOB, res, python=PY, workdir=WORKDIR)
    check_golden("slurm_pretrain_2x4_torchrun.sbatch", script)
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    d = _directives(script)
    assert d["--ntasks-per-node"] == "1" and d["--cpus-per-task"] == "16"
    assert "--rdzv_backend=c10d" in script and '--rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT"' in script
    assert f"{PY} -m bertdist.cli.main pretrain" in script


def test_slurm_data_script():
    from bertdist.cli.submit import data_command

    cmd = data_command(PY, Path("/shared/bertdist/configs/data/wiki.yaml"), ["num_shards=64"],
                       beam.runner_args(beam.RunnerOptions("direct", workers=32)))
    script = slurm.render_data_script(Path("/shared/bertdist/configs/data/wiki.yaml"), cmd, name="bertdist-data-wiki",
                                      log_dir=Path("/shared/data/jobs"), cpus=32, partition="cpu", workdir=WORKDIR)
    check_golden("slurm_data_wiki.sbatch", script)
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    d = _directives(script)
    assert d["--nodes"] == "1" and d["--ntasks"] == "1" and d["--cpus-per-task"] == "32"
    assert "--direct_num_workers=32" in script
    assert "data build --config /shared/bertdist/configs/data/wiki.yaml --set num_shards=64 --runner=DirectRunner" in script


# ---------------------------------------------------------------- DeepSpeed
def _ds_parse(argv):
    from deepspeed.launcher.runner import parse_args

    return parse_args(argv)


def test_deepspeed_pdsh_hostfile_and_command(tmp_path):
    from deepspeed.launcher.runner import _parse_hostfile

    res = Resources(nodes=2, gpus_per_node=8)
    launch = deepspeed_launch.deepspeed_launch(
        JOB.command(launcher_module=True), res, ["gpu-a", "gpu-b"],
        hostfile_path=Path("/shared/runs/x/jobs/h"), env_file_path=Path("/shared/runs/x/jobs/e"),
        deepspeed_bin="/opt/bertdist/.venv/bin/deepspeed", workdir=WORKDIR)
    check_golden("deepspeed_2x8.hostfile", launch.hostfile)
    check_golden("deepspeed_2x8_pdsh.txt", launch.env_file + "\n".join(launch.shell_lines()) + "\n")
    assert dict(_parse_hostfile(launch.hostfile.splitlines())) == {"gpu-a": 8, "gpu-b": 8}
    (host, argv), = launch.commands
    assert host == "gpu-a" and argv[0] == "env" and argv[1] == "DS_ENV_FILE=/shared/runs/x/jobs/e"
    a = _ds_parse(argv[3:])  # DeepSpeed's own argument parser accepts the command
    assert a.launcher == "pdsh" and a.num_nodes == 2 and a.num_gpus == 8 and a.master_addr == "gpu-a"
    assert a.module and a.no_local_rank and a.user_script == "bertdist.cli.main"
    assert a.user_args == ["pretrain", "--resume", "auto", str(JOB.config_path), "data.micro_batch_size=16"]
    _assert_pretrain_cli_parses(a.user_args)
    assert "NCCL_DEBUG=WARN" in launch.env_file.splitlines()


def test_deepspeed_ssh_per_node_commands():
    res = Resources(nodes=3, gpus_per_node=4)
    launch = deepspeed_launch.deepspeed_launch(
        JOB.command(launcher_module=True), res, ["n0", "n1", "n2"], launcher="ssh",
        hostfile_path=Path("/h"), env_file_path=Path("/e"), deepspeed_bin="deepspeed", workdir=WORKDIR)
    assert [h for h, _ in launch.commands] == ["n0", "n1", "n2"]
    for rank, (host, argv) in enumerate(launch.commands):
        assert argv[:4] == ["ssh", "-o", "BatchMode=yes", host]
        remote = shlex.split(argv[4])
        assert remote[:3] == ["cd", str(WORKDIR), "&&"]
        ds = remote[remote.index("deepspeed") + 1:]
        a = _ds_parse(ds)
        assert a.no_ssh and a.node_rank == rank and a.master_addr == "n0" and a.hostfile == "/h"
        # the environment comes from the env file, which the node's shell sources: not the command line
        assert remote[3:remote.index("deepspeed")] == ["set", "-a", "&&", ".", "/e", "&&", "set", "+a", "&&", "exec"]
        assert "NCCL_DEBUG=WARN" not in argv[4]
    assert "NCCL_DEBUG=WARN" in launch.env_file.splitlines()


# ---------------------------------------------------------------- Kubernetes
def _k8s_job(tmp_path) -> TrainingJob:
    return TrainingJob(config_path=WORKDIR / "configs/pretrain/bert-large.yaml", overrides=(),
                       run_dir=Path("/shared/runs/bert-large-p1"),
                       data_paths=(Path("/shared/data/wiki-128/manifest.json"),),
                       name="bertdist-bert-large", global_batch=4096, micro_batch=16)


def test_k8s_pytorchjob_golden_schema_and_semantics(tmp_path):
    job = _k8s_job(tmp_path)
    res = Resources(nodes=4, gpus_per_node=8, cpus_per_task=6)
    manifest = k8s.render_pytorchjob(job, res, k8s.K8sOptions(image="registry.local/bertdist:0.1", namespace="nlp"),
                                     workdir=WORKDIR)
    k8s.validate_pytorchjob(manifest)
    check_golden("k8s_pytorchjob_4x8.yaml", k8s.to_yaml(manifest))
    specs = manifest["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1 and specs["Worker"]["replicas"] == 3
    assert manifest["spec"]["nprocPerNode"] == "8"
    for rs in specs.values():
        assert rs["restartPolicy"] == "OnFailure"
        pod = rs["template"]["spec"]
        c, = pod["containers"]
        assert c["name"] == "pytorch" and c["resources"]["limits"]["nvidia.com/gpu"] == 8
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        assert mounts["/dev/shm"] == "dshm" and mounts["/shared/runs/bert-large-p1"] == "runs"
        assert mounts["/shared/data/wiki-128"] == "data"
        vols = {v["name"]: v for v in pod["volumes"]}
        assert vols["dshm"]["emptyDir"]["medium"] == "Memory"
        assert vols["runs"]["persistentVolumeClaim"]["claimName"] == "bertdist-runs"
        assert c["command"][-5:] == ["bertdist.cli.main", "pretrain", "--resume", "auto", str(job.config_path)]


def test_k8s_schema_rejects_broken_manifests(tmp_path):
    job = _k8s_job(tmp_path)
    good = k8s.render_pytorchjob(job, Resources(nodes=2, gpus_per_node=1), k8s.K8sOptions(image="img"), workdir=WORKDIR)
    import copy

    cases = []
    m = copy.deepcopy(good); m["spec"]["pytorchReplicaSpecs"]["Master"]["replicas"] = 2; cases.append(m)
    m = copy.deepcopy(good); m["spec"]["pytorchReplicaSpecs"]["Worker"]["restartPolicy"] = "Sometimes"; cases.append(m)
    m = copy.deepcopy(good); m["spec"]["pytorchReplicaSpecs"]["Chief"] = m["spec"]["pytorchReplicaSpecs"].pop("Worker"); cases.append(m)
    m = copy.deepcopy(good); m["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["name"] = "trainer"; cases.append(m)
    m = copy.deepcopy(good); m["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["volumeMount"] = []; cases.append(m)
    m = copy.deepcopy(good); m["apiVersion"] = "kubeflow.org/v2"; cases.append(m)
    m = copy.deepcopy(good); m["metadata"]["name"] = "Bad_Name"; cases.append(m)
    for bad in cases:
        with pytest.raises(SubmitError, match="does not match the schema"):
            k8s.validate_pytorchjob(bad)


def test_k8s_config_must_be_on_a_mounted_volume():
    job = TrainingJob(config_path=Path("/home/me/tiny.yaml"), overrides=(), run_dir=Path("/shared/runs/t"),
                      data_paths=(), name="t")
    with pytest.raises(SubmitError, match="on none of the volumes"):
        k8s.render_pytorchjob(job, Resources(), k8s.K8sOptions(image="img"), workdir=WORKDIR)
    with pytest.raises(SubmitError, match="--image is required"):
        k8s.render_pytorchjob(job, Resources(), k8s.K8sOptions(image=""), workdir=WORKDIR)


# ---------------------------------------------------------------- local, Beam
def test_local_command():
    prog = JOB.command(launcher_module=True)
    assert local.local_command(prog, Resources(), python=PY) == [PY, *prog]
    cmd = local.local_command(prog, Resources(procs_per_node=2), python=PY)
    assert cmd[:5] == [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    with pytest.raises(SubmitError, match="--nodes must be 1"):
        local.local_command(prog, Resources(nodes=2), python=PY)


@pytest.mark.parametrize("opts", [
    beam.RunnerOptions("direct", workers=4),
    beam.RunnerOptions("dataflow", workers=50, project="p", region="europe-west4", temp_location="gs://b/tmp", job_name="wiki"),
    beam.RunnerOptions("flink", workers=16, flink_master="flink-jm:8081"),
    beam.RunnerOptions("spark", workers=16, spark_master="spark://spark-master:7077", sdk_container_image="img:1"),
])
def test_beam_runner_args_parse_with_beam(opts):
    from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions

    args = beam.runner_args(opts)
    po = PipelineOptions(args)
    known = po.get_all_options(drop_default=True, retain_unknown_options=True)
    assert po.view_as(StandardOptions).runner.lower().startswith(opts.runner)
    # every rendered flag is one Beam knows (unknown ones would be kept verbatim as extra keys)
    for a in args:
        key = a[2:].split("=", 1)[0]
        assert key in known, f"{a} is not a Beam option"


def test_beam_runner_errors():
    with pytest.raises(SubmitError, match="--project, --region, --temp-location"):
        beam.runner_args(beam.RunnerOptions("dataflow"))
    with pytest.raises(SubmitError, match="gs://"):
        beam.runner_args(beam.RunnerOptions("dataflow", project="p", region="r", temp_location="/tmp"))
    with pytest.raises(SubmitError, match="--flink-master"):
        beam.runner_args(beam.RunnerOptions("flink"))


# ---------------------------------------------------------------- bad input
def test_gpu_count_that_does_not_divide():
    with pytest.raises(SubmitError, match=r"--gpus 6 does not divide over --nodes 4 \(6/4 = 1.5"):
        gpus_per_node_from_total(6, 4)
    assert gpus_per_node_from_total(16, 2) == 8
    with pytest.raises(SubmitError, match=r"global batch 4096 does not divide over 24 processes"):
        slurm.render_pretrain_script(JOB, Resources(nodes=3, gpus_per_node=8))
    with pytest.raises(SubmitError, match="not a multiple of the micro batch 16"):
        JOB.check_world_size(512)  # 8 per process < micro 16
    with pytest.raises(SubmitError, match="one process per GPU"):
        Resources(gpus_per_node=8, procs_per_node=4).validate()


def test_bad_resources():
    with pytest.raises(SubmitError, match="is not a SLURM time"):
        Resources(time="2 days").validate()
    with pytest.raises(SubmitError, match="whitespace and quotes"):
        slurm.render_pretrain_script(JOB, Resources(partition="gpu a100"))
    with pytest.raises(SubmitError, match="--hosts lists 1 host"):
        deepspeed_launch.deepspeed_launch(JOB.command(launcher_module=True), Resources(nodes=2), ["a"],
                                          hostfile_path=Path("/h"), env_file_path=Path("/e"))


def test_missing_config_and_data_path(tmp_path):
    with pytest.raises(SubmitError, match="training config not found"):
        read_training_job(tmp_path / "nope.yaml")
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump({"run_dir": str(tmp_path / "run"), "deepspeed": {"zero_stage": 0},
                                   "data": {"train_manifest": str(tmp_path / "missing/manifest.json"),
                                            "vocab_file": str(tmp_path / "vocab.txt"),
                                            "micro_batch_size": 2, "global_batch_size": 8}}))
    (tmp_path / "vocab.txt").write_text("[PAD]\n")
    with pytest.raises(SubmitError, match=r"data path in tiny.yaml does not exist: .*missing/manifest.json"):
        read_training_job(cfg)
    # overrides redirect the lookups, as they will in the job
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards/manifest.json").write_text("{}")
    job = read_training_job(cfg, [f"data.train_manifest={tmp_path / 'shards/manifest.json'}"])
    assert job.run_dir == tmp_path / "run" and job.config_path == cfg
    assert job.command("py")[-1] == f"data.train_manifest={tmp_path / 'shards/manifest.json'}"


def test_sbatch_not_found(tmp_path, monkeypatch):
    from cluster import slurm_client

    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SubmitError, match="sbatch not found on PATH"):
        slurm_client.sbatch(tmp_path / "x.sbatch")


def test_nccl_timeout_dump_has_a_flight_recorder_to_dump():
    """TORCH_NCCL_DUMP_ON_TIMEOUT dumps the flight recorder, which records nothing unless its buffer size is > 0."""
    from cluster.launch import job_environment

    env = job_environment(Resources(nodes=2, gpus_per_node=8))
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert int(env["TORCH_FR_BUFFER_SIZE"]) > 0 and int(env["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0
    assert "TORCH_NCCL_DUMP_ON_TIMEOUT" not in job_environment(Resources(nodes=1))  # CPU jobs: no NCCL
