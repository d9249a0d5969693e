"""Beam's external worker pool (``worker_pool_main``) bound to one address instead of all of them.

The pool has no authentication: whoever reaches its port can have it start workers, which
pip-install and run the code a job stages. Beam's own main always listens on every interface;
this one listens on ``--host`` (default 127.0.0.1) and refuses worker ids that are not plain
names, since a worker's folder is named after its id.

    bertdist-beam-pool --service_port=P --container_executable=BOOT [--host=ADDR]

Like ``beam_worker_boot.py``, this file imports only the standard library, grpc and apache_beam,
and is copied into the worker environment (``cluster/beam_portable.py``).
"""
from __future__ import annotations

import argparse
import atexit
import logging
import re
import sys
import threading

WORKER_ID = re.compile(r"[\w-]+", re.ASCII)


def grpc_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def _servicer_class():
    from apache_beam.portability.api import beam_fn_api_pb2
    from apache_beam.runners.worker.worker_pool_main import BeamFnExternalWorkerPoolServicer

    class CheckedWorkerPool(BeamFnExternalWorkerPoolServicer):
        def StartWorker(self, request, context):
            if not WORKER_ID.fullmatch(request.worker_id):
                return beam_fn_api_pb2.StartWorkerResponse(
                    error=f"worker id {request.worker_id!r} refused: only letters, digits, '_' and '-'")
            return super().StartWorker(request, context)

    return CheckedWorkerPool


def serve(host: str, port: int, container_executable: str):
    """Start the pool on ``host:port``; returns (bound port, grpc server)."""
    import grpc
    from apache_beam.portability.api import beam_fn_api_pb2_grpc
    from apache_beam.runners.worker.worker_pool_main import kill_process_gracefully
    from apache_beam.utils import thread_pool_executor

    server = grpc.server(thread_pool_executor.shared_unbounded_instance(),
                         options=[("grpc.http2.max_pings_without_data", 0), ("grpc.http2.max_ping_strikes", 0)])
    bound = server.add_insecure_port(grpc_address(host, port))
    if not bound:
        raise SystemExit(f"worker pool: cannot listen on {grpc_address(host, port)}")
    pool = _servicer_class()(use_process=True, container_executable=container_executable,
                             data_buffer_time_limit_ms=-1)
    beam_fn_api_pb2_grpc.add_BeamFnExternalWorkerPoolServicer_to_server(pool, server)
    server.start()
    atexit.register(lambda: [kill_process_gracefully(p) for p in pool._worker_processes.values()])
    return bound, server


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--service_port", type=int, required=True)
    ap.add_argument("--container_executable", required=True)
    ap.add_argument("--host", default="127.0.0.1",
                    help="address to listen on (default 127.0.0.1: this machine only); the pool has no "
                         "authentication, so whoever reaches it can run staged code")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    port, server = serve(args.host, args.service_port, args.container_executable)
    logging.info("worker pool listening on %s", grpc_address(args.host, port))
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        server.stop(0)


if __name__ == "__main__":
    main(sys.argv[1:])
