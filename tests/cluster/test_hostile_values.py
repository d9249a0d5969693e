"""Every renderer in cluster/ given hostile values (line breaks, $(), backticks, quotes, a leading
'-') at every key it pastes into a script or a command: each case is either refused with a
SubmitError, or its output is valid bash in which the payload sits only inside single quotes,
escapes or comments (and the #SBATCH block stays whole)."""
from __future__ import annotations

import dataclasses
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from cluster import beam, deepspeed_launch, k8s, slurm
from cluster.errors import SubmitError
from cluster.spec import Resources
from cluster.training import TrainingJob

MARK = "PWNED"
PAYLOADS = {
    "newline": f"x\ntouch {MARK}",
    "carriage-return": f"x\rtouch {MARK}",
    "trailing-newline": f"x{MARK}\n",
    "command-substitution": f"$(touch {MARK})",
    "backticks": f"`touch {MARK}`",
    "double-quote": f'x"; touch {MARK}; "',
    "single-quote": f"x'; touch {MARK}; '",
    "semicolon": f"x;touch${{IFS}}{MARK}",
    "leading-dash": f"-oProxyCommand=touch{MARK}",
}
PY = "/opt/bertdist/.venv/bin/python"
WORKDIR = Path("/shared/bertdist")
JOB = TrainingJob(config_path=WORKDIR / "configs/pretrain/tiny.yaml", overrides=("data.micro_batch_size=4",),
                  run_dir=WORKDIR / "runs/tiny", data_paths=(WORKDIR / "data/manifest.json",), name="bertdist-tiny")
GPU2x2 = Resources(nodes=2, gpus_per_node=2)
PLAIN = re.compile(r"[A-Za-z0-9_./:,=@%+-]+")


def active_text(script: str) -> str:
    """What bash would read as code: ``script`` without single-quoted strings, backslash escapes and
    comments (double-quoted text is kept: $() and backticks run there)."""
    out, quote, i = [], None, 0
    while i < len(script):
        c = script[i]
        if quote == "'":
            quote = None if c == "'" else quote
        elif c == "\\":
            i += 1  # the escaped character is literal
        elif quote == '"':
            quote = None if c == '"' else quote
            out.append(c)
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or script[i - 1] in " \t\n;&|"):
            end = script.find("\n", i)
            i = len(script) if end < 0 else end
            continue
        else:
            out.append(c)
        i += 1
    return "".join(out)


def inert(text: str) -> bool:
    """Whether every word of ``text`` that holds the payload is a plain word, which a shell takes
    as it is (no $, backticks, quotes, ';', parentheses or line breaks)."""
    return all(PLAIN.fullmatch(word) for word in text.split() if MARK in word)


def check_shell(text: str) -> None:
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)
    assert inert(active_text(text)), f"the payload would run:\n{text}"


def check_sbatch(script: str, directives: int) -> None:
    """Bash runs no payload, and sbatch (which reads #SBATCH values itself, no shell) sees every
    directive: they all come before the first command."""
    check_shell(script)
    lines = script.splitlines()
    first_code = next(i for i, line in enumerate(lines) if line.strip() and not line.startswith("#"))
    assert sum(line.startswith("#SBATCH ") for line in lines[:first_code]) == directives, script
    assert not any(line.startswith("#SBATCH ") for line in lines[first_code:])


# ---------------------------------------------------------------- SLURM pretraining
def _pretrain(**changes) -> str:
    job_fields = {k: v for k, v in changes.items() if k in {f.name for f in dataclasses.fields(TrainingJob)}}
    res_fields = {k: v for k, v in changes.items() if k in {f.name for f in dataclasses.fields(Resources)}}
    rest = {k: v for k, v in changes.items() if k not in job_fields and k not in res_fields}
    job = dataclasses.replace(JOB, **job_fields)
    res = dataclasses.replace(GPU2x2, **res_fields)
    return slurm.render_pretrain_script(job, res, python=rest.get("python", PY),
                                        workdir=rest.get("workdir", WORKDIR), nccl_ifname=rest.get("nccl_ifname"))


PRETRAIN_SITES = {
    "config path": lambda p: _pretrain(config_path=WORKDIR / f"configs/{p}.yaml"),
    "run dir": lambda p: _pretrain(run_dir=WORKDIR / "runs" / p),
    "override": lambda p: _pretrain(overrides=(f"notes={p}",)),
    "name": lambda p: _pretrain(name=p),
    "partition": lambda p: _pretrain(partition=p),
    "account": lambda p: _pretrain(account=p),
    "time": lambda p: _pretrain(time=p),
    "env value": lambda p: _pretrain(extra_env=(("FOO", p),)),
    "env name": lambda p: _pretrain(extra_env=((p, "1"),)),
    "nccl ifname": lambda p: _pretrain(nccl_ifname=p),
    "python": lambda p: _pretrain(python=p),
    "workdir": lambda p: _pretrain(workdir=WORKDIR / p),
}
PRETRAIN_DIRECTIVES = len([line for line in _pretrain().splitlines() if line.startswith("#SBATCH ")])


@pytest.mark.parametrize("payload", PAYLOADS.values(), ids=PAYLOADS.keys())
@pytest.mark.parametrize("site", PRETRAIN_SITES)
def test_slurm_pretrain_script(site, payload):
    try:
        script = PRETRAIN_SITES[site](payload)
    except SubmitError:
        return
    extra = 1 if site in ("partition", "account", "time") else 0
    check_sbatch(script, PRETRAIN_DIRECTIVES + extra)


# ---------------------------------------------------------------- SLURM data job
def _data(config="wiki", name="bertdist-data", log_dir="/shared/data/jobs", flink="jm:8081", partition=None):
    from bertdist.cli.submit import data_command

    cfg = WORKDIR / f"configs/data/{config}.yaml"
    args = beam.runner_args(beam.RunnerOptions("flink", flink_master=flink))
    return slurm.render_data_script(cfg, data_command(PY, cfg, ["num_shards=4"], args), name=name,
                                    log_dir=Path(log_dir), cpus=4, partition=partition, workdir=WORKDIR)


DATA_SITES = {
    "config path": lambda p: _data(config=p),
    "name": lambda p: _data(name=p),
    "log dir": lambda p: _data(log_dir=f"/shared/{p}"),
    "runner option": lambda p: _data(flink=p),
    "partition": lambda p: _data(partition=p),
}
DATA_DIRECTIVES = len([line for line in _data().splitlines() if line.startswith("#SBATCH ")])


@pytest.mark.parametrize("payload", PAYLOADS.values(), ids=PAYLOADS.keys())
@pytest.mark.parametrize("site", DATA_SITES)
def test_slurm_data_script(site, payload):
    try:
        script = DATA_SITES[site](payload)
    except SubmitError:
        return
    check_sbatch(script, DATA_DIRECTIVES + (site == "partition"))


# ---------------------------------------------------------------- DeepSpeed
def _deepspeed(launcher, hosts=("n0", "n1"), env=(), arg="data.micro_batch_size=4", workdir=WORKDIR):
    res = dataclasses.replace(GPU2x2, extra_env=tuple(env))
    return deepspeed_launch.deepspeed_launch(
        ["-m", "bertdist.cli.main", "pretrain", "--resume", "auto", str(JOB.config_path), arg], res, list(hosts),
        hostfile_path=Path("/shared/jobs/h"), env_file_path=Path("/shared/jobs/e"), launcher=launcher,
        deepspeed_bin="/opt/venv/bin/deepspeed", workdir=workdir)


DEEPSPEED_SITES = {
    "first host": lambda launcher, p: _deepspeed(launcher, hosts=(p, "n1")),
    "second host": lambda launcher, p: _deepspeed(launcher, hosts=("n0", p)),
    "env value": lambda launcher, p: _deepspeed(launcher, env=[("FOO", p)]),
    "program argument": lambda launcher, p: _deepspeed(launcher, arg=p),
    "workdir": lambda launcher, p: _deepspeed(launcher, workdir=WORKDIR / p),
}


@pytest.mark.parametrize("payload", PAYLOADS.values(), ids=PAYLOADS.keys())
@pytest.mark.parametrize("site", DEEPSPEED_SITES)
@pytest.mark.parametrize("launcher", ["pdsh", "ssh"])
def test_deepspeed_launch(launcher, site, payload):
    try:
        launch = DEEPSPEED_SITES[site](launcher, payload)
    except SubmitError:
        return
    for line in launch.hostfile.splitlines():
        host, slots = line.split()
        assert not host.startswith("-") and MARK not in host and slots.startswith("slots=")
    for host, argv in launch.commands:
        assert not host.startswith("-") and MARK not in host
        if launcher == "ssh":
            assert argv[:4] == ["ssh", "-o", "BatchMode=yes", host]
            check_shell(argv[4])  # what the remote shell runs
            if site == "env value":  # values stay in the env file, off the command line `ps` shows
                assert MARK not in argv[4], argv[4]
        else:
            # DeepSpeed's pdsh runner pastes the environment, arguments and working directory unquoted
            # into the remote shell command: each must be a plain word
            assert inert(launch.env_file) and all(PLAIN.fullmatch(a) for a in argv[2:])
    if launcher == "ssh":
        check_shell(launch.env_file)  # each node's shell sources it


@pytest.mark.parametrize("payload", PAYLOADS.values(), ids=PAYLOADS.keys())
def test_deepspeed_ssh_env_file_sources_hostile_values_as_data(tmp_path, payload):
    """The ssh launcher's env file, sourced by bash as each node's command does: the value arrives
    exactly as given and nothing in it runs (or it is refused)."""
    try:
        launch = _deepspeed("ssh", env=[("FOO", payload)])
    except SubmitError:
        return
    envfile = tmp_path / "env"
    envfile.write_text(launch.env_file)
    remote = launch.commands[0][1][4]
    assert MARK not in remote, remote
    out = subprocess.run(["bash", "-c", 'set -a && . ./env && set +a && exec printf %s "$FOO"'], cwd=tmp_path,
                         capture_output=True, text=True, check=True).stdout
    assert out == payload
    assert not (tmp_path / MARK).exists() and not list(tmp_path.glob(f"*{MARK}*"))


def test_pdsh_refusal_points_to_the_ssh_launcher_and_hides_secrets():
    with pytest.raises(SubmitError, match=r"--env FOO '\$\(id\)'.*--ds-launcher ssh"):
        _deepspeed("pdsh", env=[("FOO", "$(id)")])
    with pytest.raises(SubmitError) as e:
        _deepspeed("pdsh", env=[("HF_TOKEN", "hf_$ecret")])
    assert "hf_$ecret" not in str(e.value) and "HF_TOKEN" in str(e.value)
    assert _deepspeed("ssh", env=[("FOO", "$(id)")]).commands  # the ssh launcher quotes it
    # a secret-named variable never goes through pdsh, even with a plain value: `ps` would show it
    with pytest.raises(SubmitError, match=r"--env WANDB_API_KEY: .*`ps` shows it.*--ds-launcher ssh") as e:
        _deepspeed("pdsh", env=[("WANDB_API_KEY", "abc123")])
    assert "abc123" not in str(e.value)
    assert _deepspeed("ssh", env=[("WANDB_API_KEY", "abc123")]).commands


def test_hosts_are_refused_with_a_leading_dash_or_a_trailing_newline():
    for bad in ("-lroot", "-oProxyCommand=id", "n0\nn1", "n0;id", "n0 n1", "$(id)"):
        with pytest.raises(SubmitError, match="is not a host name or address"):
            deepspeed_launch.parse_hosts([bad])
    assert deepspeed_launch.parse_hosts("node-1,10.0.0.2,fe80::1,[::1]") == ["node-1", "10.0.0.2", "fe80::1", "[::1]"]
    with pytest.raises(SubmitError, match="is not a host name or address"):
        _deepspeed("ssh", hosts=("n0", "n1\n"))  # a list of hosts is checked as given


# ---------------------------------------------------------------- Kubernetes
def _manifest(**opts) -> str:
    env = opts.pop("env", ())
    res = dataclasses.replace(GPU2x2, extra_env=tuple(env))
    job = dataclasses.replace(JOB, **{k: opts.pop(k) for k in ("config_path", "run_dir", "name") if k in opts})
    manifest = k8s.render_pytorchjob(job, res, k8s.K8sOptions(image=opts.pop("image", "img:1"), **opts),
                                     workdir=WORKDIR)
    k8s.validate_pytorchjob(manifest)
    text = k8s.to_yaml(manifest)
    assert yaml.safe_load(text) == manifest  # YAML carries every value as data, however it looks
    for spec in manifest["spec"]["pytorchReplicaSpecs"].values():
        c, = spec["template"]["spec"]["containers"]
        assert c["command"][:3] == ["python", "-m", "torch.distributed.run"]  # an argv: no shell reads it
    return text


K8S_SITES = {
    "image": lambda p: _manifest(image=p),
    "namespace": lambda p: _manifest(namespace=p),
    "run dir": lambda p: _manifest(run_dir=WORKDIR / "runs" / p),
    "config path": lambda p: _manifest(config_path=WORKDIR / f"configs/{p}.yaml"),
    "env value": lambda p: _manifest(env=[("FOO", p)]),
    "name": lambda p: _manifest(name=p),
}


@pytest.mark.parametrize("payload", PAYLOADS.values(), ids=PAYLOADS.keys())
@pytest.mark.parametrize("site", K8S_SITES)
def test_k8s_manifest(site, payload):
    try:
        K8S_SITES[site](payload)
    except SubmitError:
        pass
