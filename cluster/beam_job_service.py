"""A local Beam job service (the portable job API) that runs each job on ``--direct_num_workers``
SDK workers: Beam's own ``local_job_service_main`` runs every job on one worker, whatever the
job asks, so a build through it would never exercise more than one worker.

    python -m cluster.beam_job_service --port P [--staging_dir DIR]

Everything else is Beam's LocalJobServicer: artifact staging, provision and artifact retrieval
for the workers, job state and messages. Started and stopped by ``cluster/beam_portable.py``.
"""
from __future__ import annotations

import argparse
import logging
import signal
import threading

from apache_beam.options.pipeline_options import DirectOptions
from apache_beam.portability.api import beam_job_api_pb2
from apache_beam.runners.portability import local_job_service
from apache_beam.runners.portability.fn_api_runner import fn_runner


class ParallelBeamJob(local_job_service.BeamJob):
    """A job whose runner asks the environment (the external worker pool) for
    ``direct_num_workers`` workers and splits every stage's input between them."""

    def _invoke_runner(self):
        self.set_state(beam_job_api_pb2.JobState.RUNNING)
        options = self.pipeline_options()
        runner = fn_runner.FnApiRunner(provision_info=self._provision_info)
        # the count FnApiRunner.run_pipeline takes from the same option; run_via_runner_api, the
        # job service's entry, keeps its default of 1
        # (the option comes through the job's options Struct as a string or a float)
        runner._num_workers = max(1, int(float(options.view_as(DirectOptions).direct_num_workers or 1)))
        return runner.run_via_runner_api(self._pipeline_proto, options)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=0, help="the job API's port (0: any free one, printed)")
    ap.add_argument("--staging_dir", default=None, help="where staged artifacts go (default: a temp dir)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    servicer = local_job_service.LocalJobServicer(args.staging_dir, beam_job_type=ParallelBeamJob)
    port = servicer.start_grpc_server(args.port)
    logging.info("Listening for beam jobs on port %d", port)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    servicer.stop()


if __name__ == "__main__":
    main()
