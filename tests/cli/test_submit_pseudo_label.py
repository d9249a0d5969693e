"""`bertdist submit pseudo-label --dry-run`: the SLURM script for one and two nodes (one torchrun
agent per node, c10d rendezvous at the first node, the `pseudo-label` arguments passed through with
absolute paths, requeue on SIGTERM), and the checks that fail before a job waits in the queue."""
from __future__ import annotations

import re
import shlex
import subprocess

import pytest

from bertdist.cli.main import build_parser, main


@pytest.fixture
def inputs(tmp_path, monkeypatch):
    (tmp_path / "teacher").mkdir()
    (tmp_path / "teacher" / "vocab.txt").write_text("[PAD]\n")
    (tmp_path / "squad").mkdir()
    (tmp_path / "u.json").write_text("{}")
    monkeypatch.chdir(tmp_path)  # relative paths on the command line
    return tmp_path


def _render(capsys, *extra: str) -> str:
    rc = main(["submit", "pseudo-label", "squad", "--teacher", "teacher", "--data", "squad", "--unlabeled", "u.json",
               "--out", "labels", "--set", "top_k=20", "--set", "label_batch_size=64", "--python", "/opt/py",
               "--dry-run", *extra])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return out.out


def _directives(script: str) -> dict[str, str]:
    return dict(line.split(None, 1)[1].partition("=")[::2] for line in script.splitlines() if line.startswith("#SBATCH "))


def _program(script: str) -> list[str]:
    """The pseudo-label argv after `-m` on the srun line's last line, as bash would split it."""
    step = script[script.index("srun --kill-on-bad-exit"):].split(" &\n")[0]
    argv = shlex.split(step.replace("\\\n", " "))
    return argv[argv.index("bertdist.cli.main") + 1:]


@pytest.mark.parametrize("nodes,gpus", [(1, 4), (2, 8)])
def test_script_runs_one_torchrun_agent_per_node_with_the_pseudo_label_arguments(capsys, inputs, nodes, gpus):
    script = _render(capsys, "--nodes", str(nodes), "--gpus-per-node", str(gpus))
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    d = _directives(script)
    assert d["--nodes"] == str(nodes) and d["--gpus-per-node"] == str(gpus) and d["--ntasks-per-node"] == "1"
    assert d["--job-name"] == "bertdist-pseudo-label-squad" and d["--output"] == f"{inputs}/labels/jobs/%x-%j.out"
    assert "--requeue" in d and d["--signal"] == "B:TERM@120" and d["--open-mode"] == "append"
    assert f"export PROCS_PER_NODE={gpus}\n" in script and "WORLD_SIZE=$(( NNODES * PROCS_PER_NODE ))" in script
    assert 'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in script
    assert re.search(r'-m torch\.distributed\.run --nnodes="\$NNODES" --node_rank="\$SLURM_NODEID" '
                     r'--nproc_per_node="\$PROCS_PER_NODE" --rdzv_id="\$SLURM_JOB_ID" --rdzv_backend=c10d '
                     r'--rdzv_endpoint="\$MASTER_ADDR:\$MASTER_PORT"', script)
    assert "scontrol requeue" in script
    argv = _program(script)
    assert argv[:2] == ["pseudo-label", "squad"]
    args = build_parser().parse_args(argv)  # bertdist's own parser reads what the job will run
    assert args.teacher == f"{inputs}/teacher" and args.data == f"{inputs}/squad"
    assert args.unlabeled == [f"{inputs}/u.json"] and args.out == f"{inputs}/labels"
    assert args.set == ["top_k=20", "label_batch_size=64"] and args.config is None


def test_srun_launcher_starts_every_process(capsys, inputs):
    script = _render(capsys, "--nodes", "2", "--gpus-per-node", "4", "--launcher", "srun")
    d = _directives(script)
    assert d["--ntasks-per-node"] == "4" and "torch.distributed.run" not in script
    assert "RANK=$SLURM_PROCID" in script and "/opt/py -m bertdist.cli.main pseudo-label squad" in script


def test_bad_inputs_fail_before_the_queue(capsys, inputs):
    base = ["submit", "pseudo-label", "squad", "--data", "squad", "--unlabeled", "u.json", "--out", "labels",
            "--dry-run"]
    assert main(base + ["--teacher", "squad"]) == 2
    assert "no vocab.txt there" in capsys.readouterr().err
    assert main(base + ["--teacher", "teacher", "--set", "top_kk=3"]) == 2
    assert "unknown key 'top_kk'" in capsys.readouterr().err
    assert main(base[:6] + ["missing.txt"] + base[7:] + ["--teacher", "teacher"]) == 2
    assert f"no such file: {inputs}/missing.txt" in capsys.readouterr().err
