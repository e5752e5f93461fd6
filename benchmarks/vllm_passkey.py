"""Passkey retrieval at ~8k tokens (the default model's limit) in vLLM: stock vs radar+ at budgets 512 and 1024.

One sample per depth (10, 50, 90%), 32-token pages, float32, greedy 16 tokens; run in the vLLM venv from the
repository root (it uses the engine helper of the vLLM tests, tests/vllm_engine.py):

    PYTHONPATH=. /work/venv-vllm/bin/python benchmarks/vllm_passkey_8k.py

Writes benchmarks/results/vllm-passkey-8k-block32.json: per run, (depth, answer, references, score).
"""

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from vllm_engine import greedy_tokens  # noqa: E402

from sparseattn.data.needle import PasskeyTask, string_match_all  # noqa: E402
from sparseattn.hf.models import local_model_dir  # noqa: E402

#: float32 at the model's 8k context, prefill in chunks of 1024 tokens, vLLM pages of 32 tokens.
ENGINE = {"dtype": "float32", "max_model_len": 8192, "max_num_batched_tokens": 1024, "enable_chunked_prefill": True, "seed": 0, "block_size": 32}

if __name__ == "__main__":
    import tempfile

    logs = Path(tempfile.mkdtemp(prefix="vllm-passkey-"))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(local_model_dir()))
    depths = (10.0, 50.0, 90.0)
    samples = [PasskeyTask().sample(8000, tok, seed=i, depths=d, reserve_tokens=16) for i, d in enumerate(depths)]
    ids = [tok.encode(s.prompt) for s in samples]
    print("lengths", [len(i) for i in ids], flush=True)
    out = {}
    for label, extra in (("stock", {}), ("radar+512", {"additional_config": {"sparseattn": {"method": "radar+", "budget": 512}}}),
                         ("radar+1024", {"additional_config": {"sparseattn": {"method": "radar+", "budget": 1024}}})):
        prompts = [{"prompt_token_ids": p} for p in ids]
        tokens, _ = greedy_tokens(logs / f"{label}.log", prompts, {**ENGINE, **extra}, 16, ignore_eos=True, cache_gib="4")
        answers = [tok.decode(t) for t in tokens]
        out[label] = [(d, a, s.answers, string_match_all([a], [s.answers])) for d, a, s in zip(depths, answers, samples)]
        print(label, out[label], flush=True)
    (REPO / "benchmarks" / "results" / "vllm-passkey-8k-block32.json").write_text(json.dumps(out, indent=1))
