"""A throwaway PostgreSQL server for the tests: Debian's server binaries (`apt-get install postgresql`; .ci/run does),
a cluster made by initdb in a temporary folder, on a free port and a private socket folder, stopped and removed after.

PostgreSQL refuses to run as root, and CI runs as root: then the cluster is made and run as the `postgres` system
user (runuser; `nobody` where there is none, as on the GPU image with PostgreSQL from a wheel), in a folder that user
owns. Durability is off (fsync): the data is the test's, for seconds.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path

HOW_TO_INSTALL = "install Debian's PostgreSQL server: apt-get install -y postgresql (.ci/run does)"


def _bin_dir() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    if not found:
        raise RuntimeError(f"No PostgreSQL server binaries under /usr/lib/postgresql/*/bin: {HOW_TO_INSTALL}, or "
                           "pass the folder of initdb and pg_ctl.")
    return Path(found[-1]).parent


def _service_user() -> str:
    """The system user a root process runs the server as."""
    import pwd

    try:
        return pwd.getpwnam("postgres").pw_name
    except KeyError:
        return "nobody"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Postgres:
    """One running cluster; `database()` makes a fresh database and returns its SQLAlchemy URL. `bin_dir`: the folder
    of initdb and pg_ctl (default: Debian's newest); scripts/bench_fleet.py starts its store through this too."""

    def __init__(self, bin_dir: Path | None = None):
        self.bin = Path(bin_dir) if bin_dir is not None else _bin_dir()
        self.root = Path(tempfile.mkdtemp(prefix="h3trt-pg-"))
        self.data, self.sockets, self.log = self.root / "data", self.root / "sockets", self.root / "server.log"
        self.sockets.mkdir()
        self.port = _free_port()
        user = _service_user() if os.geteuid() == 0 else None
        self.as_user = ["runuser", "-u", user, "--"] if user else []
        if user:
            shutil.chown(self.root, user)
            shutil.chown(self.sockets, user)
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-sync")
        self.start()
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        """Start the server (again, after `halt`: same port, same data)."""
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60", "start", "-o",
                  f"-p {self.port} -k {self.sockets} -c listen_addresses=127.0.0.1 -c fsync=off "
                  "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200")

    def halt(self) -> None:
        """Stop the server, its connections dropped and its data kept (an outage: `start` brings it back). Fast, not
        immediate: with synchronous_commit off, an immediate stop may lose the last commits."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def _run(self, tool: str, *args: str) -> None:
        out = subprocess.run([*self.as_user, str(self.bin / tool), *args], capture_output=True, text=True,
                             timeout=120, cwd=self.root)
        if out.returncode != 0:
            log = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            raise RuntimeError(f"{tool} failed ({out.returncode}): {out.stderr[-2000:]}{log}")

    def database(self) -> str:
        """A new, empty database of this cluster: its URL."""
        import psycopg

        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(host="127.0.0.1", port=self.port, user="postgres", dbname="postgres",
                             autocommit=True) as c:
            c.execute(f"CREATE DATABASE {name}")
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
