"""Start the control plane: the job store, Ray (embedded or `--address`), the scheduler, uvicorn.

`run_server(...)` is what `unbroken serve` calls. `BackgroundServer` runs any app on a free
127.0.0.1 port in a thread (tests and benchmarks use it with a store-only app).
"""

from __future__ import annotations

import errno
import getpass
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn

from service import auth
from service.store import JobStore
from workers.ports import free_port

log = logging.getLogger(__name__)

DEFAULT_PORT = 8420


def default_db_url() -> str:
    return f"sqlite:///{auth.unbroken_home() / 'unbroken.db'}"


def normalize_db_url(url: str) -> str:
    """SQLite paths become absolute: supervisors run in other processes with other working dirs."""
    if url.startswith("sqlite:///") and not url.startswith("sqlite:////"):
        path = url[len("sqlite:///"):]
        if path and path != ":memory:":
            return "sqlite:///" + str(Path(path).expanduser().resolve())
    return url


def ensure_admin_token(store: JobStore, url: str, token_path: Path | None = None) -> tuple[str, Path]:
    """Reuse the token file's admin token if this store knows it; else mint one and write the file."""
    path = token_path or auth.token_file_path()
    current = auth.read_token_file(path)
    if current is not None:
        who = store.principal_for_token(current["token"])
        if who is not None and who.is_admin:
            auth.write_token_file(url, current["token"], path)
            return current["token"], path
    token = store.create_token(getpass.getuser() or "admin", "admin", label="local admin (unbroken serve)")
    auth.write_token_file(url, token, path)
    return token, path


class BackgroundServer:
    """uvicorn serving `app` on 127.0.0.1 in a daemon thread; stop() ends it."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int | None = None) -> None:
        self.host = host
        self.port = port or free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(app, host=host, port=self.port, log_level="warning", access_log=False, lifespan="off")
        )
        self.thread = threading.Thread(target=self.server.run, name="unbroken-api", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the API server did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    db: str | None = None
    address: str | None = None  # a Ray cluster; None starts an embedded one
    num_cpus: int | None = None  # the embedded cluster's CPUs
    no_ray: bool = False  # store only: accept and serve jobs, never run them
    dashboard: bool = False
    namespace: str = "unbroken"
    quota_jobs: int | None = None
    quota_workers: int | None = None
    max_body_bytes: int = 1 << 20
    tls_cert: str | None = None  # PEM certificate (chain); with tls_key the server speaks HTTPS only
    tls_key: str | None = None


def check_tls(cert: str | None, key: str | None) -> None:
    """Both or neither, and readable files: else a ValueError naming the option and the fix."""
    if (cert is None) != (key is None):
        raise ValueError("--tls-cert and --tls-key go together: pass both (PEM certificate and its private key) "
                         "or neither")
    for opt, path in (("--tls-cert", cert), ("--tls-key", key)):
        if path is not None and not Path(path).is_file():
            raise ValueError(f"{opt} {path!r} is not a readable file; pass the PEM file's path")
    if cert is not None and key is not None:
        import ssl

        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
        except (ssl.SSLError, OSError) as e:
            raise ValueError(f"--tls-cert {cert!r} and --tls-key {key!r} do not load as a PEM certificate and "
                             f"its private key ({e}); check the files and that the key matches") from e


def connect_ray(opts: ServeOptions) -> None:
    import ray

    if opts.address:
        ray.init(address=opts.address, namespace=opts.namespace, log_to_driver=False)
        return
    # The embedded cluster is this machine's alone: every Ray address on loopback (before Ray reads its
    # constants) and node death seen in seconds, as in service.local_cluster (which sets both).
    from service.local_cluster import FAST_FAILURE_DETECTION

    # Never a plain ray.init(): it could attach to someone else's cluster on this machine.
    kwargs: dict[str, Any] = {"address": "local", "namespace": opts.namespace, "include_dashboard": opts.dashboard,
                              "_system_config": dict(FAST_FAILURE_DETECTION)}
    if opts.dashboard:
        kwargs["dashboard_host"] = "127.0.0.1"
    if opts.num_cpus is not None:
        kwargs["num_cpus"] = opts.num_cpus
    ray.init(**kwargs)


class PortInUseError(RuntimeError):
    """`unbroken serve` on a port something else listens on."""


def listen_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port for uvicorn, or PortInUseError naming the port and the fix."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is no obstacle
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise PortInUseError(
                f"port {port} on {host} is already in use (another `unbroken serve`? its URL is in "
                f"{auth.token_file_path()}); stop that one, or pass --port with a free port"
            ) from e
        raise PortInUseError(f"cannot listen on {host}:{port}: {e.strerror}; pass another --host or --port") from e
    return sock


def run_server(opts: ServeOptions) -> None:
    """Serve until interrupted; the scheduler and an embedded Ray stop with the server.

    The port is taken first: on a busy port nothing is written (no store, no token file) and
    PortInUseError says so."""
    from api.app import create_app
    from service.scheduler import Quota, QuotaPolicy, Scheduler

    check_tls(opts.tls_cert, opts.tls_key)
    sock = listen_socket(opts.host, opts.port)
    db = normalize_db_url(opts.db or os.environ.get("UNBROKEN_DB") or default_db_url())
    store = JobStore(db)
    url = f"{'https' if opts.tls_cert else 'http'}://{opts.host}:{opts.port}"
    _, token_path = ensure_admin_token(store, url)
    scheduler = None
    if not opts.no_ray:
        connect_ray(opts)
        quotas = QuotaPolicy(default=Quota(opts.quota_jobs, opts.quota_workers))
        scheduler = Scheduler(store, store_url=db, namespace=opts.namespace, quotas=quotas)
        scheduler.start()
    app = create_app(store, scheduler, max_body_bytes=opts.max_body_bytes)
    mode = "store only (no Ray)" if scheduler is None else f"Ray {'at ' + opts.address if opts.address else 'embedded'}"
    if scheduler is not None and not scheduler.leading:
        mode += "; another server leads the scheduler (this one takes over if it stops)"
    print(f"unbroken API on {url} (docs: {url}/docs); store {db}; {mode}; admin token in {token_path}", flush=True)
    try:
        config = uvicorn.Config(app, host=opts.host, port=opts.port, log_level="warning", access_log=False,
                                lifespan="off", ssl_certfile=opts.tls_cert, ssl_keyfile=opts.tls_key)
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        if scheduler is not None:
            scheduler.stop()
            import ray

            if ray.is_initialized():
                ray.shutdown()
        store.close()
