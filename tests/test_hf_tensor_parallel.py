"""Tensor parallelism through transformers: ``from_pretrained(..., tp_plan="auto")`` on 2 CPU ranks (gloo).

transformers shards q/k/v column-wise, so each rank's attention function sees its own query and KV
heads and each rank's ``SparseCache`` holds and selects over those heads only. The properties checked
against one unsharded process:

* at a budget that covers every token, the greedy tokens of the TP=2 run are the single process's
  (dense, quest, radar, radar+);
* at a small budget, each rank's query heads attend exactly the tokens the same heads attend in the
  single process (the per-step masks are equal) and as many: a head's selection does not depend on the
  TP size. Radar's random features are drawn for all KV heads and each rank keeps its own rows; a rank
  that drew them for its local head indices would select differently on rank 1.

The file is also the worker: the test starts it twice (``RANK`` 0 and 1, as ``torchrun`` would), each
rank writes a JSON report, and each rank's stdout/stderr go to a file quoted in any failure message.
Float64 weights, so the sum order of the all-reduce cannot flip a near-tied selection or token.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

WORLD = 2
HEADS, KV_HEADS = 8, 4  # 4 query / 2 KV heads per rank: rank 1 holds KV heads 2 and 3
PROMPT, NEW_TOKENS, SMALL = 200, 8, 32
FULL = 10_000  # a budget above every length here: every token is attended
RANK_TIMEOUT_S = 60  # a rank waiting on a dead peer fails instead of hanging (gloo's collective timeout)

#: name -> (registry method, its options). "full-*" attend every token, "small-*" attend SMALL.
CASES = {
    "dense": ("dense", {}),
    "full-quest": ("quest", {"budget": FULL, "page_size": 8}),
    "full-radar": ("radar", {"budget": FULL, "n_features": 256}),
    "full-radar+": ("radar+", {"budget": FULL}),
    "small-quest": ("quest", {"budget": SMALL, "page_size": 8}),
    "small-radar": ("radar", {"budget": SMALL, "n_features": 256}),
    "small-radar+": ("radar+", {"budget": SMALL}),
}


def save_checkpoint(path: Path) -> Path:
    """A random 3-layer Llama, 8 query / 4 KV heads of dim 8, float64, weights large enough (std 0.2) that
    attention is peaked and a different selection changes the output."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, max_position_embeddings=512, initializer_range=0.2, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
    )
    tf.LlamaForCausalLM(config).to(torch.float64).eval().save_pretrained(path, safe_serialization=True)
    return path


def prompt() -> torch.Tensor:
    return torch.randint(3, 64, (1, PROMPT), generator=torch.Generator().manual_seed(1))


def decode(model) -> dict:
    """Greedy-decode :data:`CASES` on ``model``; per case the tokens, and per sparse layer the heads the
    state holds, its KV bytes and, per decode step, the tokens each query head attended (and, at the small
    budget, which ones)."""
    import sparseattn
    from sparseattn import registry

    ids = prompt()
    report = {}
    for case, (name, options) in CASES.items():
        with sparseattn.apply(model, registry.build(name, **options)) as sparse:
            cache = sparse.new_cache()
            steps: dict[int, list] = {}
            masks = case.startswith("small")  # which tokens, at the small budget (at a full one: all of them)
            for layer in cache.sparse_layers:
                steps[layer.layer_idx] = []

                def record(info, log=steps[layer.layer_idx], record=layer.record_step, masks=masks):
                    positions = [row.nonzero().flatten().tolist() for row in info.to_mask()[0]] if masks else None  # [H_q, t]
                    log.append({"attended": info.attended[0].tolist(), "positions": positions})
                    record(info)

                layer.record_step = record
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **sparseattn.cache_kwargs(model, cache),
                                 max_new_tokens=NEW_TOKENS, do_sample=False)
        report[case] = {
            "tokens": out[0, PROMPT:].tolist(),
            "layers": [
                {
                    "heads": list(layer.state.layer.heads),
                    "total_kv_heads": layer.state.layer.total_kv_heads,
                    "keys": list(layer.state.keys.shape),
                    "kv_bytes": layer.state.nbytes()["kv"],
                    "steps": steps[layer.layer_idx],
                }
                for layer in cache.sparse_layers
            ],
        }
    return report


def tp_plan_auto() -> dict:
    """``from_pretrained``'s keyword for ``tp_plan="auto"``: a ``DistributedConfig`` where transformers has one
    (5.23 deprecates the bare ``tp_plan=``), else ``tp_plan`` itself; both shard the same way."""
    import inspect

    import transformers as tf

    config = getattr(tf, "DistributedConfig", None)
    if config is not None and "tp_plan" in inspect.signature(config).parameters:
        return {"distributed_config": config(tp_plan="auto")}
    return {"tp_plan": "auto"}


def worker(checkpoint: str, out_dir: str) -> None:
    """One rank: load the checkpoint sharded by transformers' tp_plan, decode, write ``rank{r}.json``."""
    import torch.distributed as dist
    import transformers as tf

    from sparseattn.hf.attention import kv_head_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=RANK_TIMEOUT_S))
    try:
        model = tf.AutoModelForCausalLM.from_pretrained(checkpoint, **tp_plan_auto(), dtype=torch.float64).eval()
        weight = model.model.layers[0].self_attn.k_proj.weight
        print(f"rank {dist.get_rank()}: tp_size={model.tp_size}, k_proj {type(weight).__name__} {tuple(weight.to_local().shape)}", flush=True)
        report = {"rank": dist.get_rank(), "world": dist.get_world_size(), "cases": decode(model)}
        attention = model.model.layers[0].self_attn
        report["shard"] = kv_head_shard(attention, KV_HEADS // WORLD, "llama")
        try:  # heads that are not this rank's even share of the model's: refused
            kv_head_shard(attention, 1, "llama")
        except ValueError as error:
            report["uneven"] = str(error)
        Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(checkpoint: Path, out: Path, deadline_s: float = 3 * RANK_TIMEOUT_S, grace_s: float = 10) -> list[dict]:
    """Start :data:`WORLD` ranks of this file as ``torchrun --nproc-per-node 2`` would (same environment
    variables), wait for all, and return their reports. When a rank fails, the others get ``grace_s``
    seconds to report their side and are then stopped; on any failure or after ``deadline_s``, raise with
    every rank's exit status, stdout and stderr."""
    root = Path(__file__).resolve().parents[1]
    base = {
        **os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(WORLD),
        "LOCAL_WORLD_SIZE": str(WORLD), "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
    }
    end, failed_at, killed = time.monotonic() + deadline_s, None, set()
    with contextlib.ExitStack() as files:
        procs = []
        for rank in range(WORLD):
            env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0"}
            stdout = files.enter_context(open(out / f"rank{rank}.stdout", "w"))
            stderr = files.enter_context(open(out / f"rank{rank}.stderr", "w"))
            procs.append(subprocess.Popen([sys.executable, __file__, "--worker", str(checkpoint), str(out)],
                                          env=env, cwd=root, stdout=stdout, stderr=stderr))
        try:
            while any(p.poll() is None for p in procs) and time.monotonic() < end:
                if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                    failed_at = time.monotonic()
                if failed_at is not None and time.monotonic() > failed_at + grace_s:
                    break
                time.sleep(0.2)
        finally:
            for rank, p in enumerate(procs):
                if p.poll() is None:
                    p.kill()
                    killed.add(rank)
                p.wait()
    reports = [out / f"rank{rank}.json" for rank in range(WORLD)]
    if killed or any(p.returncode for p in procs) or not all(r.exists() for r in reports):
        why = "" if not killed else (
            f" (stopped {grace_s:.0f} s after another rank failed)" if failed_at is not None else f" (ran past {deadline_s:.0f} s)"
        )
        detail = "\n".join(
            f"--- rank {rank}: {'killed' if rank in killed else f'exit {p.returncode}'}, "
            f"report {'written' if reports[rank].exists() else 'missing'}\n"
            f"stdout:\n{(out / f'rank{rank}.stdout').read_text()[-4000:]}\n"
            f"stderr:\n{(out / f'rank{rank}.stderr').read_text()[-8000:]}"
            for rank, p in enumerate(procs)
        )
        raise AssertionError(f"the {WORLD} tensor-parallel ranks did not all finish{why}:\n{detail}")
    return [json.loads(r.read_text()) for r in reports]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(single-process report, [rank 0 report, rank 1 report]) of the same checkpoint and prompt."""
    import transformers as tf

    if not torch.distributed.is_available():
        pytest.skip("this torch build has no torch.distributed")
    directory = tmp_path_factory.mktemp("tp")
    checkpoint = save_checkpoint(directory / "checkpoint")
    ranks = launch(checkpoint, directory)
    single = decode(tf.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64).eval())
    return single, ranks


def query_heads(rank: int) -> slice:
    per = HEADS // WORLD
    return slice(rank * per, (rank + 1) * per)


@pytest.mark.parametrize("case", [c for c in CASES if not c.startswith("small")])
def test_full_budget_tokens_equal_single_process(runs, case):
    single, ranks = runs
    for report in ranks:
        assert report["cases"][case]["tokens"] == single[case]["tokens"], f"rank {report['rank']}"
    assert single[case]["tokens"] == single["dense"]["tokens"]  # and a full budget is dense attention


@pytest.mark.parametrize("case", [c for c in CASES if c != "dense"])
def test_each_rank_holds_and_attends_its_own_heads(runs, case):
    single, ranks = runs
    per_kv = KV_HEADS // WORLD
    for report in ranks:
        rank, mine = report["rank"], query_heads(report["rank"])
        got, want = report["cases"][case], single[case]
        assert len(got["layers"]) == len(want["layers"]) == 3
        for layer, ref in zip(got["layers"], want["layers"]):
            assert layer["heads"] == list(range(rank * per_kv, (rank + 1) * per_kv))
            assert layer["total_kv_heads"] == KV_HEADS
            assert layer["keys"][1] == per_kv and layer["keys"][2] == ref["keys"][2]
            assert layer["kv_bytes"] * WORLD == ref["kv_bytes"]
            assert len(layer["steps"]) == len(ref["steps"]) == NEW_TOKENS - 1  # the first token comes from the prefill
            for step, (a, b) in enumerate(zip(layer["steps"], ref["steps"])):
                assert a["attended"] == b["attended"][mine], f"rank {rank}, step {step}"
                assert a["positions"] == (None if b["positions"] is None else b["positions"][mine]), f"rank {rank}, step {step}"
                if case.startswith("small"):
                    assert max(a["attended"]) <= SMALL
                else:
                    assert a["attended"] == [ref["keys"][2] - NEW_TOKENS + 2 + step] * len(a["attended"])
        assert got["tokens"] == want["tokens"], f"rank {rank}"


def test_the_shard_is_read_off_the_sharded_attention_module(runs):
    _, ranks = runs
    for report in ranks:
        rank = report["rank"]
        assert report["shard"] == [rank * KV_HEADS // WORLD, KV_HEADS]
        assert report["uneven"] == (
            f"llama: layer 0 holds 1 KV heads on rank {rank} of a 2-way tensor-parallel mesh, but the model has 4: not an "
            "even split of 4 // 2 per rank, so sparseattn cannot tell which of the model's heads these are; the model's "
            "sharding plan splits them some other way, which sparseattn does not support"
        )


def test_small_budget_attends_fewer_than_stored(runs):
    """The small budget is a real restriction here: each step attends at most SMALL of ~200 stored tokens."""
    single, _ = runs
    for case in ("small-quest", "small-radar", "small-radar+"):
        stored = single[case]["layers"][0]["keys"][2]
        attended = {n for layer in single[case]["layers"] for s in layer["steps"] for n in s["attended"]}
        assert stored > PROMPT and max(attended) <= SMALL, (case, attended)


def test_layer_spec_heads_are_validated():
    from sparseattn.methods.base import LayerSpec

    assert LayerSpec(1, 2, 8).heads == range(2) and LayerSpec(1, 2, 8).total_kv_heads == 2
    with pytest.raises(ValueError, match=r"KV heads 3\.\.4 .* total_kv_heads=4"):
        LayerSpec(1, 2, 8, kv_head_offset=3, total_kv_heads=4)
    with pytest.raises(ValueError, match="kv_head_offset must be an int >= 0, got -1"):
        LayerSpec(1, 2, 8, kv_head_offset=-1)
    with pytest.raises(ValueError, match="total_kv_heads must be an int >= 1"):
        LayerSpec(1, 2, 8, total_kv_heads=2.0)


def test_a_shard_keeps_its_rows_of_every_heads_features():
    """Rank 1 of 2 holds KV heads 2, 3: its state's random features are rows 2, 3 of the unsharded state's."""
    from sparseattn import Radar
    from sparseattn.methods.base import LayerSpec

    method = Radar(n_features=64)
    whole = method.new_state(LayerSpec(1, 4, 8, layer_idx=5))
    shard = method.new_state(LayerSpec(1, 2, 8, layer_idx=5, kv_head_offset=2, total_kv_heads=4))
    assert torch.equal(shard._params, whole._params[2:4])
    assert not torch.equal(shard._params, method.new_state(LayerSpec(1, 2, 8, layer_idx=5))._params)


def test_a_summary_without_per_head_parameters_cannot_be_sharded():
    from dataclasses import dataclass

    from sparseattn import SegmentSearch
    from sparseattn.methods.base import LayerSpec
    from sparseattn.summaries.performer import PerformerFeatures

    @dataclass(frozen=True)
    class Packed(PerformerFeatures):  # parameters in a tuple: which part belongs to which head is unknown
        def prepare(self, kv_heads, head_dim, *, layer_idx, device, dtype):
            return (super().prepare(kv_heads, head_dim, layer_idx=layer_idx, device=device, dtype=dtype),)

    method = SegmentSearch(summary=Packed(n_features=8))
    method.new_state(LayerSpec(1, 4, 8))  # unsharded: the summary's own business
    with pytest.raises(ValueError, match=r"\(tuple\) are not one row per KV head \(4\).*heads 2\.\.3"):
        method.new_state(LayerSpec(1, 2, 8, kv_head_offset=2, total_kv_heads=4))


def test_an_unsharded_module_holds_all_heads():
    from sparseattn.hf.attention import kv_head_shard

    class Attention(torch.nn.Module):
        config = type("Config", (), {"num_key_value_heads": 4, "num_attention_heads": 8})()

    assert kv_head_shard(Attention(), 4, "llama") == (0, 4)
    assert kv_head_shard(Attention(), 2, "llama") == (0, 2)  # fewer heads but no sharded parameters: not TP


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    worker(*sys.argv[2:4])
