"""A real `h3trt serve` process for the server's tests: started on a free port with its own data folder, waited for,
stopped by signal; its log kept for the failure message."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

SMALL = {"size": "128x32", "steps": 2}  # the cheapest clip H3 allows: 5 s at 128x32, one DiT evaluation
ENDED = ("completed", "failed", "cancelled")


STARTED: list = []  # every Server of this test process, so a failed test leaves none running (stop_started)


def stop_started(since: int = 0) -> None:
    """Kill the servers started after the first `since` that still run (a test that failed before stopping its own:
    a server left behind would hold the CPU for the tests after it)."""
    for srv in STARTED[since:]:
        if srv.proc is not None and srv.proc.poll() is None:
            srv.kill()
    del STARTED[since:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, data_dir: Path, *args: str, api_key: str | None = None, port: int | None = None):
        self.data_dir, self.api_key = Path(data_dir), api_key
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = ["--data-dir", str(data_dir), "--port", str(self.port), *args,
                     *(("--api-key", api_key) if api_key else ())]
        self.log_path = Path(data_dir).with_name(Path(data_dir).name + ".log")
        self.proc = None
        STARTED.append(self)
        self.start()

    def start(self) -> "Server":
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "h3trt.cli", "serve", *self.args], stdout=log,
                                     stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        log.close()
        return self

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def http(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=60, **kwargs)

    def openai(self):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "unused", max_retries=0, timeout=60)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait(self, path: str = "/ready", timeout: float = 240) -> None:
        """Until `path` answers 200 (the server listening for /health, a group serving for /ready)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"h3trt serve exited {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                if httpx.get(self.url + path, timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"{path} not 200 within {timeout} s:\n{self.log()[-4000:]}")

    def job(self, job_id: str) -> dict:
        with self.http() as c:
            r = c.get(f"/v1/videos/{job_id}")
        assert r.status_code == 200, r.text
        return r.json()

    def wait_job(self, job_id: str, until=ENDED, timeout: float = 240) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if job["status"] in until:
                return job
            time.sleep(0.2)
        raise AssertionError(f"{job_id} still {job['status']} after {timeout} s:\n{self.log()[-4000:]}")

    def create(self, **fields) -> dict:
        with self.http() as c:
            r = c.post("/v1/videos", json={**SMALL, **fields})
        assert r.status_code == 200, r.text
        return r.json()

    def signal(self, sig=signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 120) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        """kill -9 the server process (its worker ranks die with it: PR_SET_PDEATHSIG)."""
        self.proc.kill()
        self.proc.wait()


def png(path: Path, seed: int, size=(128, 32)) -> Path:
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(path)
    return path


def ffprobe(path: Path) -> dict:
    """What ffprobe (Debian's ffmpeg, installed by .ci/run) reads of an MP4: its streams' codecs and the duration."""
    import json

    out = subprocess.run(["ffprobe", "-v", "error", "-show_entries", "stream=codec_name,width,height,sample_rate,"
                          "channels:format=duration", "-of", "json", str(path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)
