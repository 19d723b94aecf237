"""``vllm serve MODEL --quantization minite`` as a user runs it: a real OpenAI-compatible server
on the loopback interface answers ``/v1/completions`` (started and always stopped by the test)."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

STARTUP_TIMEOUT_S = 240


def _vllm_cli() -> list[str]:
    """The venv's own ``vllm`` console script (scripts/setup.sh makes it runnable)."""
    vllm = os.path.join(os.path.dirname(sys.executable), "vllm")
    assert os.path.exists(vllm), f"no vllm console script next to {sys.executable}"
    return [vllm]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_until_healthy(proc: subprocess.Popen, url: str, log) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"vllm serve exited with {proc.returncode}:\n{_tail(log)}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    raise AssertionError(f"vllm serve not healthy after {STARTUP_TIMEOUT_S} s:\n{_tail(log)}")


def _stop(proc: subprocess.Popen) -> None:
    """Stop the server and the engine processes it started (its own process group)."""
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(log) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-4000:]


def test_vllm_serve_answers_completions(tiny_dense_dir, tmp_path):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [*_vllm_cli(), "serve", str(tiny_dense_dir), "--quantization", "minite",
           "--enforce-eager", "--dtype", "bfloat16", "--max-model-len", "256",
           "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    with open(tmp_path / "serve.log", "w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ),
                                start_new_session=True)  # fmt: skip
        try:
            _wait_until_healthy(proc, url, log)
            body = {"model": str(tiny_dense_dir), "prompt": "Hello world", "max_tokens": 8,
                    "temperature": 0, "logprobs": 1}  # fmt: skip
            request = urllib.request.Request(
                f"{url}/v1/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=120) as r:
                answer = json.loads(r.read())
        finally:
            _stop(proc)
        choice = answer["choices"][0]
        assert answer["usage"]["completion_tokens"] == 8
        assert all(math.isfinite(lp) for lp in choice["logprobs"]["token_logprobs"])
        log.seek(0)
        assert "quantization=minite" in log.read()
