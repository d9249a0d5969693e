"""Boot of one Beam SDK worker started by an external worker pool (``worker_pool_main
--container_executable``): Beam's container contract, as the Python SDK container's own boot
keeps it, run from a plain virtual environment instead of a container image.

1. fetch the job's provision info (pipeline options, staged artifacts) from the runner;
2. fetch the staged artifacts and install the job's packages into this worker's own folder:
   ``requirements.txt`` (--requirements_file), the files of ``extra_packages.txt``
   (--extra_package, in their order, without their dependencies: the environment holds those)
   and ``workflow.tar.gz`` (--setup_file);
3. run the SDK harness with that folder, and nothing else of the job's, on its path.

So the job's code reaches the worker only by staging. This file imports only the standard
library, grpc and apache_beam: the worker environment holds no project code, and this file is
copied into it (``cluster/beam_portable.py``), so no checkout is on the worker's path.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# the staged names that Beam's stager gives these files (apache_beam/runners/portability/stager.py)
REQUIREMENTS_FILE, EXTRA_PACKAGES_FILE, WORKFLOW_TARBALL_FILE = "requirements.txt", "extra_packages.txt", "workflow.tar.gz"
WORKER_DIR_ENV = "BERTDIST_BEAM_WORKER_DIR"  # where the workers' folders go (default: the temp dir)
# A worker's folder is named after its id and deleted at start: the id must stay one plain name.
WORKER_ID = re.compile(r"[\w-]+", re.ASCII)


def log(msg: str) -> None:
    print(f"[beam worker boot] {msg}", file=sys.stderr, flush=True)


def provision_info(endpoint: str, metadata):
    import grpc
    from apache_beam.portability.api import beam_provision_api_pb2, beam_provision_api_pb2_grpc

    with grpc.insecure_channel(endpoint) as channel:
        stub = beam_provision_api_pb2_grpc.ProvisionServiceStub(channel)
        return stub.GetProvisionInfo(beam_provision_api_pb2.GetProvisionInfoRequest(), metadata=metadata).info


def fetch_artifacts(endpoint: str, dependencies, dest: Path, metadata) -> list[str]:
    """Write every staged file into ``dest`` under its staged name; returns the names."""
    import grpc
    from apache_beam.portability import common_urns
    from apache_beam.portability.api import beam_artifact_api_pb2, beam_artifact_api_pb2_grpc, beam_runner_api_pb2

    dest.mkdir(parents=True, exist_ok=True)
    names = []
    with grpc.insecure_channel(endpoint, options=[("grpc.max_receive_message_length", -1)]) as channel:
        stub = beam_artifact_api_pb2_grpc.ArtifactRetrievalServiceStub(channel)
        resolved = stub.ResolveArtifacts(beam_artifact_api_pb2.ResolveArtifactsRequest(artifacts=dependencies),
                                         metadata=metadata).replacements
        for dep in resolved:
            if dep.role_urn != common_urns.artifact_roles.STAGING_TO.urn:
                log(f"artifact with role {dep.role_urn} ignored (only staged files are installed)")
                continue
            name = os.path.basename(beam_runner_api_pb2.ArtifactStagingToRolePayload.FromString(dep.role_payload).staged_name)
            with open(dest / name, "wb") as f:
                for chunk in stub.GetArtifact(beam_artifact_api_pb2.GetArtifactRequest(artifact=dep), metadata=metadata):
                    f.write(chunk.data)
            names.append(name)
    return names


def pip_install(site: Path, *args: str) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--target", str(site), *args]
    log("running " + " ".join(cmd))
    subprocess.run(cmd, check=True, stdout=sys.stderr)


def install(names: list[str], staged: Path, site: Path) -> list[str]:
    """Install the job's packages into ``site``; returns what was installed."""
    site.mkdir(parents=True, exist_ok=True)
    done = []
    if REQUIREMENTS_FILE in names and (staged / REQUIREMENTS_FILE).read_text().strip():
        pip_install(site, "-r", str(staged / REQUIREMENTS_FILE))
        done.append(REQUIREMENTS_FILE)
    if EXTRA_PACKAGES_FILE in names:
        packages = [line.strip() for line in (staged / EXTRA_PACKAGES_FILE).read_text().splitlines() if line.strip()]
        missing = [p for p in packages if p not in names]
        if missing:
            raise FileNotFoundError(f"{EXTRA_PACKAGES_FILE} names {missing}, which were not staged (staged: {names})")
        if packages:
            pip_install(site, "--no-deps", *(str(staged / p) for p in packages))
            done += packages
    if WORKFLOW_TARBALL_FILE in names:
        pip_install(site, "--no-deps", "--no-build-isolation", str(staged / WORKFLOW_TARBALL_FILE))
        done.append(WORKFLOW_TARBALL_FILE)
    return done


def worker_id(value: str) -> str:
    if not WORKER_ID.fullmatch(value):
        raise SystemExit(f"[beam worker boot] --id {value!r} refused: a worker id may hold only letters, digits, "
                         "'_' and '-' (it names the worker's folder, which is deleted at start)")
    return value


def main(argv=None) -> None:
    os.dup2(2, 1)  # the pool pipes stdout and never reads it: a full pipe would stall this worker
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name in ("id", "logging_endpoint", "artifact_endpoint", "provision_endpoint", "control_endpoint"):
        ap.add_argument(f"--{name}", required=True)
    args, _ = ap.parse_known_args(argv)
    worker_id(args.id)
    from apache_beam.portability.api import endpoints_pb2
    from google.protobuf import json_format, text_format

    root = Path(os.environ.get(WORKER_DIR_ENV) or tempfile.gettempdir())
    workdir = root / f"worker-{args.id}"
    shutil.rmtree(workdir, ignore_errors=True)  # a worker id is reused only by a restarted pool
    metadata = [("worker_id", args.id)]
    info = provision_info(args.provision_endpoint, metadata)
    staged = workdir / "artifacts"
    names = fetch_artifacts(args.artifact_endpoint, info.dependencies, staged, metadata)
    site = workdir / "packages"
    installed = install(names, staged, site)
    log(f"worker {args.id}: installed {installed or 'nothing'} into {site} (staged: {sorted(names)})")

    def descriptor(url: str) -> str:
        return text_format.MessageToString(endpoints_pb2.ApiServiceDescriptor(url=url))

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(site), WORKER_ID=args.id, SEMI_PERSISTENT_DIRECTORY=str(workdir),
               PIPELINE_OPTIONS=json.dumps(json_format.MessageToDict(info.pipeline_options)),
               LOGGING_API_SERVICE_DESCRIPTOR=descriptor(args.logging_endpoint),
               CONTROL_API_SERVICE_DESCRIPTOR=descriptor(args.control_endpoint))
    if info.HasField("status_endpoint"):
        env["STATUS_API_SERVICE_DESCRIPTOR"] = text_format.MessageToString(info.status_endpoint)
    os.chdir(workdir)  # not the pool's folder: nothing but the installed packages is importable
    os.execve(sys.executable, [sys.executable, "-m", "apache_beam.runners.worker.sdk_worker_main"], env)


if __name__ == "__main__":
    main()
