"""The merged rest's float64 reference: attention over a token set plus one merged token per block of the rest.

A tensor op's reference, below the backends that implement it (``segment_attention_merged``) and the
method part that uses it (:class:`~sparseattn.methods.rest.MergedRest`).
"""

from __future__ import annotations

import math

import torch


def merged_attention_ref(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    attended: torch.Tensor,
    start: int,
    end: int,
    block_tokens: int,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Reference for :func:`merged_attention`, float64, one loop per head and block.

    ``attended: [B, H_kv, G, t]`` the tokens each query head attends; every block of ``block_tokens``
    positions in ``[start, end)`` (the last one shorter) adds one token made of its unattended
    tokens: logit ``log m + scale q . mean k`` (soft-capped), value ``mean v``.
    """
    B, H, G, D = q.shape
    out = torch.zeros(B, H, G, D, dtype=torch.float64, device=q.device)
    cap = (lambda x: x) if softcap is None else (lambda x: softcap * torch.tanh(x / softcap))
    for b in range(B):
        for h in range(H):
            K, V = keys[b, h].double(), values[b, h].double()
            for g in range(G):
                qv = q[b, h, g].double()
                logits, vals = [], []
                chosen = attended[b, h, g]
                logits.append(cap(K[chosen] @ qv * scale))
                vals.append(V[chosen])
                for a in range(start, end, block_tokens):
                    rest = ~chosen[a : min(end, a + block_tokens)]
                    m = int(rest.sum())
                    if m == 0:
                        continue
                    mk = K[a : a + rest.numel()][rest].mean(0)
                    mv = V[a : a + rest.numel()][rest].mean(0)
                    logits.append((cap(mk @ qv * scale) + math.log(m)).view(1))
                    vals.append(mv.view(1, D))
                p = torch.softmax(torch.cat(logits), dim=0)
                out[b, h, g] = p @ torch.cat(vals)
    return out
