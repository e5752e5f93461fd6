"""Where every per-layer random stream of the toolkit gets its seed: one user seed, one stream per layer.

A method takes one ``seed``; each layer draws from its own generator, seeded by a fixed mix of that
seed and the layer index, so layers are independent and a run is reproducible on any device and in
either engine (the decode state and vLLM's paged engine seed a layer's selector alike).
"""

from __future__ import annotations

import torch

#: The golden-ratio multiplier of Fibonacci hashing: consecutive seeds land far apart.
_SEED_MIX = 0x9E3779B1
#: A second odd multiplier (MurmurHash3's), for the random-feature draws: a stream apart from the selectors'.
_FEATURE_MIX = 0x85EBCA6B


def layer_seed(seed: int, layer_idx: int) -> int:
    """The seed of layer ``layer_idx``'s stream for a part seeded with ``seed`` (selectors, SubGen's sketch).

    >>> layer_seed(0, 3), layer_seed(1, 0) == layer_seed(0, 0)
    (3, False)
    """
    return (seed * _SEED_MIX + layer_idx) % (2**63)


def layer_generator(seed: int, layer_idx: int) -> torch.Generator:
    """A CPU generator seeded with :func:`layer_seed`."""
    return torch.Generator().manual_seed(layer_seed(seed, layer_idx))


def feature_generator(seed: int, layer_idx: int) -> torch.Generator:
    """The generator of layer ``layer_idx``'s random-feature projection (a stream apart from :func:`layer_seed`'s)."""
    return torch.Generator().manual_seed((seed * _SEED_MIX + layer_idx * _FEATURE_MIX) % (2**63))
