"""DeepSpeed multi-node launch without a scheduler: a hostfile plus the `deepspeed` command.

Two ways to start it:
  pdsh - one `deepspeed` command on the first node; DeepSpeed reaches the others with pdsh
         (over ssh) and forwards the variables in the env file (DS_ENV_FILE). DeepSpeed pastes
         the variables, the arguments and the working directory unquoted into the remote shell
         command, so each must be a plain word (safe_values.PDSH_SAFE).
  ssh  - one `deepspeed --no_ssh --node_rank=i` command per node, which you (or your tooling)
         start on each node, e.g. through ssh; they meet at master_addr:master_port. The variables
         go into the env file as shell-quoted NAME='value' lines (the file is written 0600 on the
         shared filesystem, beside the hostfile) and each node's command sources it, so no value
         is on any command line, where `ps` on a node would show it.
"""
from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from bertdist.redaction import is_secret_name
from cluster.errors import SubmitError
from cluster.launch import job_environment
from cluster.safe_values import env_name, host_name, pdsh_word
from cluster.spec import Resources

LAUNCHERS = ("pdsh", "ssh")


def parse_hosts(hosts: str | Sequence[str]) -> list[str]:
    items = [h.strip() for h in (hosts.split(",") if isinstance(hosts, str) else hosts) if h.strip()]
    if not items:
        raise SubmitError("--hosts is empty: list the nodes, e.g. --hosts node1,node2")
    for h in items:
        host_name(h)
    if len(set(items)) != len(items):
        raise SubmitError(f"--hosts lists a node twice: {items}")
    return items


def render_hostfile(hosts: Sequence[str], slots: int) -> str:
    """DeepSpeed/OpenMPI hostfile: ``<host> slots=<processes on that host>`` per line."""
    if slots < 1:
        raise SubmitError(f"slots per host must be >= 1, got {slots}")
    return "".join(f"{h} slots={slots}\n" for h in hosts)


def _one_line_values(env: dict[str, str]) -> dict[str, str]:
    for k, v in env.items():
        if "\n" in v or "\r" in v:
            raise SubmitError(f"--env {k}: a value with a newline cannot go into the DeepSpeed env file")
    return env


def render_env_file(env: dict[str, str]) -> str:
    """DeepSpeed's env file (KEY=VALUE lines), exported by the pdsh launcher on every node."""
    return "".join(f"{k}={v}\n" for k, v in _one_line_values(env).items())


def render_shell_env_file(env: dict[str, str]) -> str:
    """The ssh launcher's env file: NAME='value' lines (shlex-quoted) that each node's shell sources."""
    for k in env:
        env_name(k, "--env")
    return "".join(f"{k}={shlex.quote(v)}\n" for k, v in _one_line_values(env).items())


def _source_path(path: Path) -> str:
    """``path`` as the shell's ``.`` takes it: a name without '/' would be looked up on PATH."""
    text = str(path)
    return text if "/" in text else f"./{text}"


@dataclass(frozen=True)
class DeepSpeedLaunch:
    hostfile: str
    env_file: str  # written to env_file_path: KEY=VALUE lines (pdsh), NAME='value' shell lines (ssh)
    commands: list[tuple[str, list[str]]]  # (host, argv) to run there; pdsh: one entry for the first host

    def shell_lines(self) -> list[str]:
        """The commands as shell lines (pdsh: one, run on the first host; ssh: one per node)."""
        return [shlex.join(argv) for _, argv in self.commands]


def _check_pdsh(env: dict[str, str], program: Sequence[str], workdir: str) -> None:
    """What DeepSpeed's pdsh runner pastes unquoted into the command every node's shell runs."""
    for k, v in env.items():
        if is_secret_name(k):  # the runner puts every value on pdsh's command line: `ps` shows it on every node
            raise SubmitError(f"--env {k}: with --ds-launcher pdsh its value would be on pdsh's command line, where "
                              "`ps` shows it on every node; use --ds-launcher ssh, which passes values in a 0600 "
                              "file, or let the job read the secret from a file")
        pdsh_word(f"--env {k}", v, name=k)
    for arg in program[1:]:
        pdsh_word("program argument", arg)
    pdsh_word("working directory", workdir)


def deepspeed_launch(
    program: Sequence[str],
    res: Resources,
    hosts: Sequence[str],
    *,
    hostfile_path: Path,
    env_file_path: Path,
    launcher: str = "pdsh",
    master_port: int = 29500,
    workdir: Path | None = None,
    deepspeed_bin: str | None = None,
    nccl_ifname: str | None = None,
) -> DeepSpeedLaunch:
    """``program`` is ``["-m", module, *args]`` (the form after ``deepspeed --module``)."""
    res.validate()
    if launcher not in LAUNCHERS:
        raise SubmitError(f"--ds-launcher must be one of {list(LAUNCHERS)}, got {launcher!r}")
    if len(hosts) != res.nodes:
        raise SubmitError(f"--nodes {res.nodes} but --hosts lists {len(hosts)} host(s): {list(hosts)}")
    if not (program and program[0] == "-m" and len(program) >= 2):
        raise SubmitError("internal: the DeepSpeed program must be of the form ['-m', module, ...]")
    if not 1 <= master_port <= 65535:
        raise SubmitError(f"--master-port {master_port} is not a TCP port")
    for h in hosts:
        host_name(h)
    ds = deepspeed_bin or str(Path(sys.executable).with_name("deepspeed"))
    env = job_environment(res, nccl_ifname=nccl_ifname)
    base = [
        ds,
        f"--hostfile={hostfile_path}",
        f"--master_addr={hosts[0]}",
        f"--master_port={master_port}",
        # Ranks come from the environment (LOCAL_RANK), not a --local_rank argument.
        "--no_local_rank",
    ]
    tail = ["--module", *program[1:]]
    wd = str(workdir or Path.cwd())
    if launcher == "pdsh":
        _check_pdsh(env, program, wd)
        argv = [*base, "--launcher=pdsh", f"--num_nodes={res.nodes}", f"--num_gpus={res.procs}", *tail]
        commands = [(hosts[0], ["env", f"DS_ENV_FILE={env_file_path}", *argv])]
        env_file = render_env_file(env)
    else:
        # The values stay in the env file (0600, on the shared filesystem): each node's shell
        # exports what it sources, so no value is on the ssh or deepspeed command line.
        env_file = render_shell_env_file(env)
        commands = []
        source = shlex.quote(_source_path(env_file_path))
        for rank, host in enumerate(hosts):
            node_argv = [*base, "--no_ssh", f"--node_rank={rank}", *tail]
            remote = f"cd {shlex.quote(wd)} && set -a && . {source} && set +a && exec {shlex.join(node_argv)}"
            commands.append((host, ["ssh", "-o", "BatchMode=yes", host, remote]))
    return DeepSpeedLaunch(render_hostfile(hosts, res.procs), env_file, commands)
