"""Which picture of the unattended tokens helps: the estimators behind ``MergedRest``, side by side.

``radar+pooled`` at a budget reduced by one token per block (given: at prefill 4096 + 512 steps and
blocks of 64 positions, 72 merged tokens, so a selection budget of 440), plus one merged token per block of
``--block`` positions (after the sinks) made of the tokens the step does not attend, with its
weight estimated four ways (values: always the mean value of those tokens):

* ``mean``: ``log m + scale q . mean k`` (what :class:`~sparseattn.methods.rest.MergedRest` does:
  exact for equal keys, never more than the true mass);
* ``var``: the same plus ``scale^2 / 2 sum_i q_i^2 var_i`` (the second cumulant of Gaussian keys);
* ``exact``: the true log mass of those tokens (an oracle: O(t));
* ``whole``: ``mean``, but only for blocks the step attends nothing of.

Everything is computed from the full keys each step (O(t), float64): a measuring stick for the
estimators, not a method. Prefill 4096, budget 512 (each block's merged token counted);
the gap ratio against the dense and StreamingLLM runs that ``benchmarks/quality.py``
left for the same texts, prefill and at least as many steps (their first ``--steps`` records).

    OMP_NUM_THREADS=1 python benchmarks/merged_rest_variants.py --texts macbeth othello pydecimal inspect \
        --reference-steps 512 --steps 256 --variants mean:64:440 var:64:440 exact:64:440 whole:64:440 \
        mean:32:368 mean:128:476

Resumable (one run directory per variant under ``benchmarks/results/quality-runs``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from sparseattn.methods.radar_plus import RadarPlusPooled
from sparseattn.methods.segment_search import SegmentSearch
from sparseattn.methods.segment_state import SegmentSearchState

RUNS = Path(__file__).parent / "results" / "quality-runs"
ESTIMATORS = ("mean", "var", "exact", "whole")


@dataclass(frozen=True)
class RestVariant(SegmentSearch):
    """radar+pooled plus one merged token per ``block`` positions, weighted by ``estimator``."""

    block: int = 64
    estimator: str = "mean"

    def state_type(self):
        return RestVariantState


class RestVariantState(SegmentSearchState):
    def attend(self, query):
        out, info = super().attend(query)
        m, lay = self.method, info.layout
        B, H, D = self.batch, self.kv_heads, self.head_dim
        a, n = lay.sink_end, (lay.segment_end - lay.sink_end) // m.block
        if n == 0:
            return out, info
        e, G, t = a + n * m.block, query.shape[1] // H, self.length
        attended = info.to_mask().view(B, H, G, t)
        q = query.double().reshape(B, H, G, D)
        K, V = self.keys[:, :, :t].double(), self.values[:, :, :t].double()
        logits = torch.einsum("bhgd,bhtd->bhgt", q, K) * self.scale
        lse_attended = logits.masked_fill(~attended, float("-inf")).logsumexp(-1)
        rest = (~attended[..., a:e]).double().view(B, H, G, n, m.block)
        if m.estimator == "whole":
            rest = rest * (rest.sum(-1, keepdim=True) == m.block)
        count = rest.sum(-1)
        Kb, Vb = K[:, :, a:e].reshape(B, H, n, m.block, D), V[:, :, a:e].reshape(B, H, n, m.block, D)
        safe = count.clamp_min(1).unsqueeze(-1)
        mean_k = torch.einsum("bhgnc,bhncd->bhgnd", rest, Kb) / safe
        mean_v = torch.einsum("bhgnc,bhncd->bhgnd", rest, Vb) / safe
        if m.estimator == "exact":
            weight = logits[..., a:e].reshape(B, H, G, n, m.block).masked_fill(rest == 0, float("-inf")).logsumexp(-1)
        else:
            weight = count.clamp_min(1).log() + (q.unsqueeze(3) * mean_k).sum(-1) * self.scale
            if m.estimator == "var":
                var = (torch.einsum("bhgnc,bhncd->bhgnd", rest, Kb * Kb) / safe - mean_k**2).clamp_min(0)
                weight = weight + 0.5 * self.scale**2 * (q.unsqueeze(3) ** 2 * var).sum(-1)
        weight = weight.masked_fill(count == 0, float("-inf"))
        top = torch.maximum(lse_attended, weight.amax(-1))
        w_att, w_rest = torch.exp(lse_attended - top), torch.exp(weight - top.unsqueeze(-1))
        mixed = w_att.unsqueeze(-1) * out.double().view(B, H, G, D) + torch.einsum("bhgn,bhgnd->bhgd", w_rest, mean_v)
        mixed = mixed / (w_att + w_rest.sum(-1)).unsqueeze(-1)
        return mixed.reshape(B, H * G, D).to(out.dtype), info


def variant(spec: str) -> RestVariant:
    """``ESTIMATOR:BLOCK:BUDGET``: the selection's budget is what is left after the merged tokens."""
    parts = spec.split(":")
    if len(parts) != 3 or parts[0] not in ESTIMATORS or not all(p.isdigit() and int(p) >= 1 for p in parts[1:]):
        raise ValueError(f"--variants {spec!r}: expected ESTIMATOR:BLOCK:BUDGET with ESTIMATOR one of {', '.join(ESTIMATORS)}, BLOCK and BUDGET >= 1")
    base = RadarPlusPooled(budget=int(parts[2]))
    return RestVariant(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)}, block=int(parts[1]), estimator=parts[0])


def ppls(path: Path, steps: int, rows: int) -> list[float] | None:
    records = [json.loads(line) for line in (path / "tokens.jsonl").read_text().splitlines()][:steps]
    if len(records) < steps:
        return None
    return [math.exp(sum(r["nlls"][i] for r in records) / steps) for i in range(rows)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", nargs="+", required=True, help="the texts of a finished quality.py run, in its order")
    parser.add_argument("--reference-steps", type=int, required=True, help="--steps of that run (its dense and streamingllm)")
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--prefill", type=int, default=4096)
    parser.add_argument("--variants", nargs="+", default=["mean:64:440", "exact:64:440"],
                        help="ESTIMATOR:BLOCK:BUDGET (BUDGET: the selection's, the merged tokens' count taken off --budget)")
    args = parser.parse_args()
    if not 1 <= args.steps <= args.reference_steps:
        parser.error(f"--steps: {args.steps} is out of range; allowed: 1 to --reference-steps ({args.reference_steps})")
    try:
        methods = {spec: variant(spec) for spec in args.variants}
    except ValueError as error:
        parser.error(str(error))
    reference = RUNS / f"{'+'.join(args.texts)}-p{args.prefill}-s{args.reference_steps}"
    for name in ("dense", f"streamingllm-b{args.budget}"):
        if not (reference / name / "tokens.jsonl").exists():
            parser.error(f"no {name} run in {reference}: run benchmarks/quality.py on these texts first")

    from sparseattn.data.sources import load_text
    from sparseattn.evaluation.ppl import run_ppl_together, tokenize
    from sparseattn.evaluation.runs import RunDir
    from sparseattn.hf import load_model

    model, tokenizer = load_model("default")
    n = args.prefill + args.steps + 1
    ids = torch.stack([tokenize(tokenizer, load_text(t), n, name=t) for t in args.texts])
    where = RUNS / f"{'+'.join(args.texts)}-p{args.prefill}-s{args.steps}-rest-variants"
    runs = {spec: (method, RunDir(where / spec.replace(":", "-"), {"variant": spec, "params": repr(method)})) for spec, method in methods.items()}
    run_ppl_together(model, runs, ids, args.prefill, args.steps)
    dense = ppls(reference / "dense", args.steps, len(args.texts))
    window = ppls(reference / f"streamingllm-b{args.budget}", args.steps, len(args.texts))
    rows = [("radar+pooled (reference run)", reference / f"radar+pooled-b{args.budget}")] + [(s, r.path) for s, (_, r) in runs.items()]
    print(f"gap ratio over the first {args.steps} steps (0: dense, 1: StreamingLLM), budget {args.budget}")
    print(f"{'variant':<30}" + "".join(f"{t:>14}" for t in args.texts))
    for label, path in rows:
        got = ppls(path, args.steps, len(args.texts)) if (path / "tokens.jsonl").exists() else None
        if got is None:
            print(f"{label:<30} (not run for {args.steps} steps)")
            continue
        print(f"{label:<30}" + "".join(f"{(p - d) / (w - d):>14.3f}" for p, d, w in zip(got, dense, window)))


if __name__ == "__main__":
    main()
