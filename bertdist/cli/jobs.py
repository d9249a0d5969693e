"""`bertdist jobs status|logs|cancel`: SLURM jobs through squeue, scontrol, sacct, scancel and the log files."""
from __future__ import annotations

import sys
import time
from pathlib import Path

from bertdist.cli.errors import exit_2_on
from cluster.errors import SubmitError


def run_status(args) -> int:
    from cluster import slurm_client

    if not args.job_id:
        print(slurm_client.queue(None if args.all else _user()), end="")
        return 0
    info = slurm_client.job_info(args.job_id)
    print(f"job {info.job_id} ({info.name}): {info.state}")
    if info.reason and info.reason != "None":
        print(f"  reason:   {info.reason}")
    print(f"  elapsed:  {info.elapsed}\n  nodes:    {info.nodes or '-'}\n  exit:     {info.exit_code or '-'}")
    print(f"  restarts: {info.restarts}")
    if info.stdout:
        print(f"  log:      {info.stdout}")
    print(f"  (from {info.source})")
    return 0


def _user() -> str:
    import getpass

    return getpass.getuser()


def _log_path(job_id: str) -> Path:
    from cluster import slurm_client

    info = slurm_client.job_info(job_id)
    if not info.stdout:
        raise SubmitError(f"job {job_id}: SLURM does not report its log file ({info.source})")
    # scontrol reports the pattern expanded for the job, except %x/%j in some versions.
    return Path(info.stdout.replace("%x", info.name).replace("%j", info.job_id))


def run_logs(args) -> int:
    path = Path(args.file) if args.file else _log_path(args.job_id)
    deadline = time.monotonic() + 30
    while not path.exists():
        # A pending job has no log yet; with --follow, wait for it to start.
        if not args.follow or time.monotonic() > deadline:
            raise SubmitError(f"log file {path} does not exist (yet): is the job still pending?")
        time.sleep(1)
    with path.open(errors="replace") as f:
        lines = f.readlines()
        sys.stdout.writelines(lines[-args.tail:] if args.tail else lines)
        sys.stdout.flush()
        if not args.follow:
            return 0
        from cluster import slurm_client

        while True:
            line = f.readline()
            if line:
                sys.stdout.write(line)
                sys.stdout.flush()
                continue
            if slurm_client.job_info(args.job_id).finished:
                sys.stdout.writelines(f.readlines())
                return 0
            time.sleep(1)


def run_cancel(args) -> int:
    from cluster import slurm_client

    slurm_client.scancel(args.job_id, signal=args.signal)
    if args.signal:
        print(f"sent SIG{args.signal.removeprefix('SIG')} to the batch script of job {args.job_id} "
              "(a bertdist job script passes it on to the training processes)")
    else:
        print(f"cancelled job {args.job_id}")
    return 0


_guard = exit_2_on("bertdist jobs", SubmitError)


def register(sub) -> None:
    p = sub.add_parser("jobs", help="status, logs and cancellation of submitted SLURM jobs")
    s = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    st = s.add_parser("status", help="one job's state (scontrol, then sacct), or your queue (squeue)")
    st.add_argument("job_id", nargs="?")
    st.add_argument("--all", action="store_true", help="without a job id: every user's jobs")
    st.set_defaults(func=_guard(run_status))
    lg = s.add_parser("logs", help="print a job's log file")
    lg.add_argument("job_id")
    lg.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")
    lg.add_argument("--tail", type=int, default=0, help="only the last N lines")
    lg.add_argument("--file", default=None, help="read this log file instead of the one SLURM reports")
    lg.set_defaults(func=_guard(run_logs))
    ca = s.add_parser("cancel", help="cancel a job, or signal it (e.g. --signal TERM: checkpoint and requeue)")
    ca.add_argument("job_id")
    ca.add_argument("--signal", default=None, help="send this signal instead of cancelling (e.g. TERM)")
    ca.set_defaults(func=_guard(run_cancel))
