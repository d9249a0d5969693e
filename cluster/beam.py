"""Beam runner options for `bertdist submit data`: where the data pipeline runs.

direct   - this node's cores (DirectRunner, multi-processing); used inside the SLURM data job
dataflow - Google Cloud Dataflow (project, region, gs:// temp location)
flink    - a Flink cluster (JobManager address), portable runner
spark    - a Spark cluster (master URL), portable runner
"""
from __future__ import annotations

from dataclasses import dataclass

from cluster.errors import SubmitError

RUNNERS = ("direct", "dataflow", "flink", "spark")


@dataclass(frozen=True)
class RunnerOptions:
    runner: str
    workers: int = 0  # direct: processes; flink/spark: parallelism; dataflow: max workers (0 = runner default)
    project: str | None = None
    region: str | None = None
    temp_location: str | None = None
    job_name: str | None = None
    flink_master: str | None = None
    spark_master: str | None = None
    environment_type: str | None = None  # portable runners: DOCKER, PROCESS, EXTERNAL, LOOPBACK
    sdk_container_image: str | None = None


def runner_args(o: RunnerOptions) -> list[str]:
    """Beam pipeline arguments for ``o``; a missing required option is a SubmitError naming it."""
    if o.runner not in RUNNERS:
        raise SubmitError(f"--runner must be one of {list(RUNNERS)}, got {o.runner!r}")
    if o.workers < 0:
        raise SubmitError(f"--workers must be >= 0, got {o.workers}")
    args: list[str] = []
    if o.runner == "direct":
        args += ["--runner=DirectRunner", "--direct_running_mode=multi_processing"]
        if o.workers:
            args.append(f"--direct_num_workers={o.workers}")
        return args
    if o.runner == "dataflow":
        missing = [n for n, v in (("--project", o.project), ("--region", o.region),
                                  ("--temp-location", o.temp_location)) if not v]
        if missing:
            raise SubmitError(f"--runner dataflow needs {', '.join(missing)}")
        if not o.temp_location.startswith("gs://"):
            raise SubmitError(f"--temp-location {o.temp_location!r}: Dataflow needs a gs:// path")
        args += ["--runner=DataflowRunner", f"--project={o.project}", f"--region={o.region}",
                 f"--temp_location={o.temp_location}"]
        if o.job_name:
            args.append(f"--job_name={o.job_name}")
        if o.workers:
            args.append(f"--max_num_workers={o.workers}")
        if o.sdk_container_image:
            args.append(f"--sdk_container_image={o.sdk_container_image}")
        else:
            # Workers need bertdist's code: ship the package as an sdist built from setup.py.
            args.append("--setup_file=./setup.py")
        return args
    if o.runner == "flink":
        if not o.flink_master:
            raise SubmitError("--runner flink needs --flink-master host:port (the Flink JobManager REST address)")
        args += ["--runner=FlinkRunner", f"--flink_master={o.flink_master}"]
    else:
        if not o.spark_master:
            raise SubmitError("--runner spark needs --spark-master spark://host:7077")
        if not o.spark_master.startswith(("spark://", "local")):
            raise SubmitError(f"--spark-master {o.spark_master!r}: expected spark://host:port")
        args += ["--runner=SparkRunner", f"--spark_master_url={o.spark_master}"]
    if o.workers:
        args.append(f"--parallelism={o.workers}")
    env_type = o.environment_type or ("DOCKER" if o.sdk_container_image else "LOOPBACK")
    args.append(f"--environment_type={env_type}")
    if o.sdk_container_image:
        args.append(f"--sdk_container_image={o.sdk_container_image}")
    return args
