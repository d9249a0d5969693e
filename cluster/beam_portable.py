"""A local Beam job service with an external SDK worker pool: the data build through Beam's
portable job API, as Dataflow, Flink and Spark run it, on one machine.

- the job service (``cluster/beam_job_service.py``: Beam's local job service, running each job on
  ``--direct_num_workers`` SDK workers) runs from the launcher's environment;
- the worker pool (``worker_pool_main``) runs from an environment of its own
  (``build/beam-worker-env``: apache-beam and the data pipeline's runtime dependencies at the
  versions of requirements.lock, no project code); each worker boots through
  ``cluster/beam_worker_boot.py`` (copied into that environment), which installs the packages
  that the job stages and nothing else;
- the job stages bertdist as a wheel (``--extra_package``) holding the data pipeline's native
  modules (``BERTDIST_EXTENSIONS=data pip wheel --no-deps --no-build-isolation .``), or as the
  sdist that Beam makes of ``--setup_file ./setup.py``, which each worker builds and installs
  (the environment holds the build requirements; the pool sets ``BERTDIST_EXTENSIONS=data``).

    python -m cluster.beam_portable up      # prints the Beam flags for `bertdist data build`
    python -m cluster.beam_portable down

``up`` builds the worker environment (once; reused while requirements.lock and the boot script
are unchanged) and the wheel, starts both services in the background and records them in
``build/beam-portable/services.json``; ``down`` stops them (each with its workers).

Neither service authenticates its callers, and the worker pool runs whatever code a job stages:
both listen on this machine only (the pool on 127.0.0.1) unless ``up --host ADDR`` or
``--bind-all`` opens the pool to a network.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BOOT_SCRIPT = Path(__file__).resolve().parent / "beam_worker_boot.py"
POOL_SCRIPT = Path(__file__).resolve().parent / "beam_worker_pool.py"
DEFAULT_ENV = REPO / "build" / "beam-worker-env"
DEFAULT_DIR = REPO / "build" / "beam-portable"
BOOT_NAME = "bertdist-beam-boot"  # the boot's name inside the worker environment's bin/
POOL_NAME = "bertdist-beam-pool"  # the pool's main, beside it
LOCAL_HOST = "127.0.0.1"

# What the data pipeline imports on a worker (besides the standard library); pinned from
# requirements.lock, their own dependencies constrained by it too. A missing one fails the
# portable-runner test with the worker's ImportError.
WORKER_REQUIREMENTS = ("apache-beam", "pyarrow", "numpy", "blingfire", "tokenizers", "pyyaml", "mwparserfromhell",
                       "charset-normalizer")


# What a worker needs to build bertdist from a --setup_file tarball (pip install
# --no-build-isolation: the environment holds the build backend): pybind11 from requirements.lock,
# setuptools at the launcher's version (lock files do not pin it; 70.1 and later build wheels
# without the ``wheel`` package). The compiler is the machine's.
BUILD_REQUIREMENTS = ("pybind11",)
LAUNCHER_BUILD_REQUIREMENTS = ("setuptools",)


class PortableRunnerError(RuntimeError):
    pass


def pinned(names=WORKER_REQUIREMENTS, lock: Path = REPO / "requirements.lock") -> list[str]:
    """``name==version`` for each name, from the lock file; a name it lacks is an error."""
    pins = {}
    for line in lock.read_text().splitlines():
        name, sep, version = line.strip().partition("==")
        if sep:
            pins[name.lower().replace("_", "-")] = f"{name}=={version.split(';')[0].strip()}"
    missing = [n for n in names if n.lower() not in pins]
    if missing:
        raise PortableRunnerError(f"{lock} pins none of {missing}")
    return [pins[n.lower()] for n in names]


def build_pins() -> list[str]:
    """The worker environment's build requirements (BUILD_REQUIREMENTS, LAUNCHER_BUILD_REQUIREMENTS)."""
    from importlib.metadata import version

    return pinned(BUILD_REQUIREMENTS) + [f"{n}=={version(n)}" for n in LAUNCHER_BUILD_REQUIREMENTS]


def worker_env(path: Path = DEFAULT_ENV, *, python: str = sys.executable) -> Path:
    """The worker pool's own virtual environment at ``path`` (made or reused); returns it.

    Reused when it was made from the same pins, lock file, boot script and Python; otherwise made
    again from scratch. pip reaches the same indexes and local wheels as for .venv (pip.conf)."""
    lock = REPO / "requirements.lock"
    key = hashlib.sha256("\n".join([*pinned(), *build_pins(), lock.read_text(), BOOT_SCRIPT.read_text(),
                                    POOL_SCRIPT.read_text(), sys.version]).encode()).hexdigest()
    stamp = path / ".bertdist-worker-env"
    if stamp.is_file() and stamp.read_text() == key:
        return path
    shutil.rmtree(path, ignore_errors=True)
    subprocess.run([python, "-m", "venv", str(path)], check=True)
    env_python = str(path / "bin" / "python")
    subprocess.run([env_python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                    "--constraint", str(lock), *pinned(), *build_pins()], check=True)
    install_scripts(path, env_python)
    stamp.write_text(key)
    return path


def install_scripts(env: Path, env_python: str) -> None:
    """Copy the worker boot and the pool's main into ``env``'s bin/, run by ``env_python``."""
    from cluster.private_files import write_file

    for source, name in ((BOOT_SCRIPT, BOOT_NAME), (POOL_SCRIPT, POOL_NAME)):
        write_file(env / "bin" / name, f"#!{env_python}\n" + source.read_text(), 0o755)


def build_wheel(out_dir: Path) -> Path:
    """bertdist as a wheel with the data pipeline's native modules (not the torch extensions:
    workers never import torch), built from this checkout by the launcher's environment."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("bertdist-*.whl"):
        old.unlink()
    env = {**os.environ, "BERTDIST_EXTENSIONS": "data"}
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(out_dir), str(REPO)], check=True, env=env, cwd=REPO)
    wheels = sorted(out_dir.glob("bertdist-*.whl"))
    if len(wheels) != 1:
        raise PortableRunnerError(f"pip wheel left {len(wheels)} bertdist wheels in {out_dir}: {wheels}")
    return wheels[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reach(host: str) -> str:
    """The address to check a service on: ``host``, or loopback for a wildcard bind."""
    return LOCAL_HOST if host in ("0.0.0.0", "::", "[::]") else host.strip("[]")


def _wait_listening(port: int, proc: subprocess.Popen, log: Path, what: str, timeout: float,
                    host: str = LOCAL_HOST) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise PortableRunnerError(f"{what} exited with {proc.returncode} before listening on port {port}; "
                                      f"its log {log}:\n{log.read_text()[-3000:]}")
        addr = _reach(host)
        with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET) as s:
            if s.connect_ex((addr, port)) == 0:
                return
        time.sleep(0.2)
    raise PortableRunnerError(f"{what} not listening on port {port} after {timeout:.0f} s; its log {log}:\n"
                              f"{log.read_text()[-3000:]}")


def _stop_group(pid: int, timeout: float = 10.0) -> None:
    """SIGTERM the process group that ``pid`` leads (a service and the workers it started),
    SIGKILL what is left after ``timeout`` seconds."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@dataclass
class LocalPortableRunner:
    """A job service and an external worker pool on this machine.

    ``start()`` launches both (each leads its own process group) and waits until they listen;
    ``stop()`` ends both groups. ``pipeline_args(wheel, workers)`` are the Beam flags of a build
    through them. The pool listens on ``pool_host`` only: it runs whatever a caller stages."""

    workdir: Path
    env: Path = DEFAULT_ENV
    job_port: int = 0
    pool_port: int = 0
    job_pid: int = 0
    pool_pid: int = 0
    pool_host: str = LOCAL_HOST

    def start(self, timeout: float = 60.0) -> "LocalPortableRunner":
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.job_port, self.pool_port = self.job_port or _free_port(), self.pool_port or _free_port()
        job_log, pool_log = self.workdir / "job_service.log", self.workdir / "worker_pool.log"
        pool_dir = self.workdir / "workers"
        pool_dir.mkdir(exist_ok=True)
        job = subprocess.Popen(
            [sys.executable, "-m", "cluster.beam_job_service",
             f"--port={self.job_port}", f"--staging_dir={self.workdir / 'artifacts'}"],
            stdout=job_log.open("ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO,
            start_new_session=True)
        self.job_pid = job.pid
        # the pool's environment: its own bin/ first, no PYTHONPATH, and a folder outside any checkout
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        # BERTDIST_EXTENSIONS=data: a --setup_file install builds the data modules only (workers never import torch)
        env.update(PATH=f"{self.env / 'bin'}{os.pathsep}{env.get('PATH', '')}", BERTDIST_BEAM_WORKER_DIR=str(pool_dir),
                   BERTDIST_EXTENSIONS="data")
        pool = subprocess.Popen(
            [str(self.env / "bin" / "python"), str(self.env / "bin" / POOL_NAME), f"--host={self.pool_host}",
             f"--service_port={self.pool_port}", f"--container_executable={self.env / 'bin' / BOOT_NAME}"],
            stdout=pool_log.open("ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=pool_dir, env=env,
            start_new_session=True)
        self.pool_pid = pool.pid
        try:
            _wait_listening(self.job_port, job, job_log, "the job service", timeout)
            _wait_listening(self.pool_port, pool, pool_log, "the worker pool", timeout, self.pool_host)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for pid in (self.pool_pid, self.job_pid):
            if pid:
                _stop_group(pid)
                try:
                    os.waitpid(pid, 0)  # reap it when this process started it
                except ChildProcessError:
                    pass
        self.job_pid = self.pool_pid = 0

    def __enter__(self) -> "LocalPortableRunner":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _pool_address(self) -> str:
        """Where the job service (on this machine) reaches the pool."""
        host = _reach(self.pool_host)
        if host in (LOCAL_HOST, "::1"):
            host = "localhost"
        return f"[{host}]:{self.pool_port}" if ":" in host else f"{host}:{self.pool_port}"

    def pipeline_args(self, wheel: Path | None = None, workers: int = 2, setup_file: Path | None = None) -> list[str]:
        """The Beam flags of a build through these services, staging bertdist either as ``wheel``
        (--extra_package: built once, here) or as ``setup_file`` (--setup_file: the launcher makes
        an sdist, each worker builds and installs it, native modules included)."""
        if (wheel is None) == (setup_file is None):
            raise PortableRunnerError("pipeline_args: stage either a wheel or a setup file")
        staging = f"--extra_package={wheel}" if wheel is not None else f"--setup_file={setup_file}"
        return ["--runner=PortableRunner", f"--job_endpoint=localhost:{self.job_port}",
                "--environment_type=EXTERNAL", f"--environment_config={self._pool_address()}",
                f"--direct_num_workers={workers}", staging]


def _up(args) -> int:
    state = args.dir / "services.json"
    if state.exists():
        print(f"{state} exists: `python -m cluster.beam_portable down --dir {args.dir}` first", file=sys.stderr)
        return 1
    env = worker_env(args.env)
    wheel = build_wheel(args.dir / "wheel")
    runner = LocalPortableRunner(args.dir, env, pool_host=args.host).start()
    state.write_text(json.dumps({"job_pid": runner.job_pid, "pool_pid": runner.pool_pid, "job_port": runner.job_port,
                                 "pool_port": runner.pool_port, "pool_host": runner.pool_host, "env": str(env),
                                 "wheel": str(wheel)}, indent=2))
    print(f"job service on localhost:{runner.job_port} (pid {runner.job_pid}), worker pool on "
          f"{runner.pool_host}:{runner.pool_port} (pid {runner.pool_pid}, environment {env}); logs in {args.dir}",
          file=sys.stderr)
    if runner.pool_host not in (LOCAL_HOST, "::1", "localhost"):
        print(f"warning: the worker pool listens on {runner.pool_host}, without authentication: whoever reaches "
              "that address can make it install and run code", file=sys.stderr)
    print(" ".join(runner.pipeline_args(wheel, args.workers)))
    return 0


def _down(args) -> int:
    state = args.dir / "services.json"
    if not state.exists():
        print(f"nothing to stop: no {state}", file=sys.stderr)
        return 0
    s = json.loads(state.read_text())
    LocalPortableRunner(args.dir, Path(s["env"]), s["job_port"], s["pool_port"], s["job_pid"], s["pool_pid"]).stop()
    state.unlink()
    print(f"stopped the job service (pid {s['job_pid']}) and the worker pool (pid {s['pool_pid']})", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cluster.beam_portable", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="build the worker environment and the wheel, start both services, print the flags")
    up.add_argument("--workers", type=int, default=2, help="SDK workers per job (default 2)")
    up.add_argument("--env", type=Path, default=DEFAULT_ENV, help=f"worker environment (default {DEFAULT_ENV})")
    where = up.add_mutually_exclusive_group()
    where.add_argument("--host", default=LOCAL_HOST, metavar="ADDR",
                       help="address the worker pool listens on (default 127.0.0.1: this machine only). The pool "
                            "has no authentication: whoever reaches it can make it pip-install and run the code a "
                            "job stages. Open it only on a network you trust")
    where.add_argument("--bind-all", dest="host", action="store_const", const="0.0.0.0",
                       help="listen on every interface (same as --host 0.0.0.0), for workers' clients on other "
                            "machines; see --host")
    down = sub.add_parser("down", help="stop both services and their workers")
    for p in (up, down):
        p.add_argument("--dir", type=Path, default=DEFAULT_DIR, help=f"logs, wheel, state (default {DEFAULT_DIR})")
    args = ap.parse_args(argv)
    return _up(args) if args.command == "up" else _down(args)


if __name__ == "__main__":
    sys.exit(main())
