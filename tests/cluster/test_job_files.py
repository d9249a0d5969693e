"""Job files: owner-only modes whatever the umask, names that stay under jobs/, secrets kept out of
Kubernetes manifests, and the CLI refusing line breaks in paths with the key and the value."""
from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from bertdist.cli.main import main
from cluster import k8s, submit
from cluster.errors import SubmitError
from cluster.spec import Resources
from cluster.training import TrainingJob

WORKDIR = Path("/shared/bertdist")
JOB = TrainingJob(config_path=WORKDIR / "configs/pretrain/tiny.yaml", overrides=(), run_dir=WORKDIR / "runs/tiny",
                  data_paths=(), name="bertdist-tiny")


@pytest.fixture(params=[0o022, 0o077], ids=["umask022", "umask077"])
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _request(tmp_path, scheduler, **kw) -> submit.LaunchRequest:
    argv = ["python", "-m", "cluster.probe", "--out", str(tmp_path)]
    return submit.LaunchRequest(scheduler=scheduler, name=kw.pop("name", "probe"), run_dir=tmp_path, label="probe",
                                program_argv=argv, program_module=argv[1:], resources=kw.pop("resources", Resources()),
                                python="python", say=lambda _: None, **kw)


def test_slurm_script_and_record_are_owner_only(tmp_path, monkeypatch, umask):
    from cluster import slurm_client

    monkeypatch.setattr(slurm_client, "sbatch", lambda path, extra_args=None: "42")
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "42.json").write_text("{}")  # an older record, world-readable: replaced, not kept
    (tmp_path / "jobs" / "42.json").chmod(0o644)
    submit.launch(_request(tmp_path, "slurm", resources=Resources(extra_env=(("WANDB_API_KEY", "s3cret"),))))
    script, = (tmp_path / "jobs").glob("probe-*.sbatch")
    assert _mode(script) == 0o700 & ~umask
    assert _mode(tmp_path / "jobs" / "42.json") == 0o600 & ~umask
    assert not list((tmp_path / "jobs").glob(".*.tmp"))


def test_deepspeed_hostfile_and_env_file_are_owner_only(tmp_path, monkeypatch, umask):
    class Done:
        def __init__(self, argv):
            pass

        def wait(self):
            return 0

    monkeypatch.setattr(submit.subprocess, "Popen", Done)
    submit.launch(_request(tmp_path, "deepspeed", deepspeed=submit.DeepSpeedHosts("n0"),
                           resources=Resources(extra_env=(("FOO", "bar"),))))
    for name in ("probe.hostfile", "probe.deepspeed_env"):
        assert _mode(tmp_path / "jobs" / name) == 0o600 & ~umask


SECRET = "hf_Zq9 s3cr3t'value$(id)"


def test_deepspeed_ssh_keeps_env_values_off_the_command_line(tmp_path, monkeypatch, umask):
    """`ps` on a node shows the ssh and deepspeed command lines: the values go into the 0600 env
    file in the job folder, which each node's command sources."""
    started = []

    class Done:
        def __init__(self, argv):
            started.append(argv)

        def wait(self):
            return 0

    monkeypatch.setattr(submit.subprocess, "Popen", Done)
    submit.launch(_request(tmp_path, "deepspeed", deepspeed=submit.DeepSpeedHosts("n0,n1", "ssh"),
                           resources=Resources(nodes=2, extra_env=(("HF_TOKEN", SECRET),))))
    monkeypatch.undo()  # subprocess.Popen again, for bash below
    envfile = tmp_path / "jobs" / "probe.deepspeed_env"
    assert len(started) == 2
    for argv in started:
        assert not any(SECRET in a or "hf_Zq9" in a for a in argv), argv
        assert f"set -a && . {envfile} && set +a && exec " in argv[4]
    assert _mode(envfile) == 0o600 & ~umask
    assert "HF_TOKEN='hf_Zq9 s3cr3t'" in envfile.read_text()
    # what a node's shell makes of the file: the value exactly, exported, nothing run
    out = subprocess.run(["bash", "-c", f"set -a && . {envfile} && set +a && exec env"], cwd=tmp_path,
                         capture_output=True, text=True, check=True).stdout
    assert f"HF_TOKEN={SECRET}\n" in out


def test_deepspeed_ssh_dry_run_prints_no_value_in_the_commands(tmp_path, capsys):
    rc = main(["submit", "probe", "--out", str(tmp_path), "--scheduler", "deepspeed", "--hosts", "n0,n1",
               "--nodes", "2", "--ds-launcher", "ssh", "--env", f"HF_TOKEN={SECRET}", "--dry-run"])
    out = capsys.readouterr().out
    commands = out.split("# commands\n", 1)[1]
    assert rc == 0 and commands.count("ssh -o BatchMode=yes") == 2
    assert "hf_Zq9" not in out, out  # neither in the commands nor in the env file as printed
    assert "HF_TOKEN='<hidden>'" in out


@pytest.mark.parametrize("name", ["../../evil", "a/b", "..", "-x", "job\n", "a b", "$(id)", "x..y"])
def test_job_names_that_would_leave_jobs_or_break_a_line_are_refused(tmp_path, name):
    with pytest.raises(SubmitError, match=r"--name .*: a job name may hold only"):
        submit.launch(_request(tmp_path, "slurm", name=name, dry_run=True))


def test_cli_refuses_a_name_with_a_slash(tmp_path, capsys):
    rc = main(["submit", "probe", "--out", str(tmp_path), "--name", "../../evil", "--dry-run"])
    assert rc == 2 and "--name '../../evil'" in capsys.readouterr().err


# ---------------------------------------------------------------- Kubernetes secrets
def test_env_secret_renders_a_secret_key_ref_and_no_value():
    from cluster.spec import parse_env_secrets

    opts = k8s.K8sOptions(image="img", env_secrets=parse_env_secrets(["HF_TOKEN=hf-token/token"]))
    manifest = k8s.render_pytorchjob(JOB, Resources(), opts, workdir=WORKDIR)
    k8s.validate_pytorchjob(manifest)
    env = manifest["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}} in env
    assert all("value" not in e for e in env if e["name"] == "HF_TOKEN")


@pytest.mark.parametrize("name", ["HF_TOKEN", "WANDB_API_KEY", "db_password", "AWS_SECRET_ACCESS_KEY", "GCP_CREDENTIALS"])
def test_plain_env_with_a_secret_name_is_refused_for_k8s_and_not_echoed(name):
    res = Resources(extra_env=((name, "s3cret-value"),))
    with pytest.raises(SubmitError, match=f"--env {name}=.*--env-secret {name}=SECRET_NAME/KEY") as e:
        k8s.render_pytorchjob(JOB, res, k8s.K8sOptions(image="img"), workdir=WORKDIR)
    assert "s3cret-value" not in str(e.value)


@pytest.mark.parametrize("item", ["HF_TOKEN=hf-token", "HF_TOKEN=Bad_Name/k", "HF_TOKEN=s/", "1X=s/k", "X=s/k\n"])
def test_bad_env_secret_forms(item):
    from cluster.spec import parse_env_secrets

    with pytest.raises(SubmitError, match="--env-secret"):
        parse_env_secrets([item])


def test_env_secret_is_for_k8s_only(tmp_path, capsys):
    rc = main(["submit", "probe", "--out", str(tmp_path), "--env-secret", "T=s/k", "--dry-run"])
    assert rc == 2 and "--scheduler k8s only" in capsys.readouterr().err


# ---------------------------------------------------------------- line breaks on the command line
@pytest.fixture
def pseudo_label_inputs(tmp_path, monkeypatch):
    (tmp_path / "teacher").mkdir()
    (tmp_path / "teacher" / "vocab.txt").write_text("[PAD]\n")
    (tmp_path / "squad").mkdir()
    (tmp_path / "u.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("scheduler", [["--scheduler", "slurm"], ["--scheduler", "deepspeed", "--hosts", "n0"]])
def test_pseudo_label_out_with_a_newline_is_refused_naming_the_key(pseudo_label_inputs, capsys, scheduler):
    rc = main(["submit", "pseudo-label", "squad", "--teacher", "teacher", "--data", "squad", "--unlabeled", "u.json",
               "--out", "labels\ntouch PWNED", "--dry-run", *scheduler])
    err = capsys.readouterr().err
    assert rc == 2 and "--out 'labels\\ntouch PWNED'" in err, err


def test_env_name_with_a_trailing_newline_is_refused():
    with pytest.raises(SubmitError, match=r"--env 'FOO\\n': not a valid environment variable name"):
        Resources(extra_env=(("FOO\n", "1"),)).validate()
    with pytest.raises(SubmitError, match="is not a SLURM time"):
        Resources(time="10\n").validate()


def test_a_dry_run_prints_no_secret_value(tmp_path, capsys):
    from bertdist.redaction import hide_secret_values

    rc = main(["submit", "probe", "--out", str(tmp_path), "--scheduler", "slurm", "--nodes", "1",
               "--env", f"WANDB_API_KEY={SECRET}", "--env", "NCCL_DEBUG=INFO", "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0 and SECRET not in out and "NCCL_DEBUG" in out and "WANDB_API_KEY='<hidden>'" in out

    text = "export NCCL_DEBUG=WARN\nexport HF_TOKEN='hf_abc123'\nAWS_SECRET_ACCESS_KEY=xyz\nPATH=/bin\n"
    assert hide_secret_values(text) == ("export NCCL_DEBUG=WARN\nexport HF_TOKEN='<hidden>'\n"
                                        "AWS_SECRET_ACCESS_KEY='<hidden>'\nPATH=/bin\n")
