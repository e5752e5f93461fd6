"""Per-layer choices: the model's tokens per step split unevenly between its layers (the total fixed), or
one method in the first layers and another in the rest."""

from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import dataclass

from sparseattn.methods.base import DecodeState, layer_spec
from sparseattn.validation import check_int, check_real


@dataclass(frozen=True)
class FirstLayers:
    """Give the first ``layers`` layers ``factor`` times the budget and the others what is left.

    Attention in a model's first layers is diffuse: on the default model, the exact top-512 tokens
    of a layer-0 head hold 40-85% of its attention mass, against 90-100% in most later layers
    (``sparseattn diagnose -m oracle-tokens``), and Quest leaves its first two layers dense for the
    same reason. With ``L`` layers (the engine's ``LayerSpec.n_layers``) and a per-step budget ``b``
    per layer on average, layer ``i < layers`` gets ``m = round(factor * b)`` and every other layer
    ``floor((L b - layers m) / (L - layers))``: the tokens over all layers still honour ``L b``. The
    other layers keep at least ``ceil(b / 2)`` each (in a shallow model ``m`` is lowered to allow
    it). A layer whose engine does not say ``n_layers``, or a model of at most ``layers`` layers, has
    no other layer to take tokens from: every layer gets ``b``.

    Args:
        method: a method with a ``budget`` field (e.g. ``RadarPlus(budget=512)``), or a :class:`SplitLayers`
            of two; each layer's state is that method with the layer's budget (without a budget set, every
            layer runs it as given).
        layers: how many first layers get more.
        factor: their budget, as a multiple of ``b`` (>= 1).
    """

    method: object
    layers: int = 1
    factor: float = 4.0

    def __post_init__(self) -> None:
        if isinstance(self.method, type) or not dataclasses.is_dataclass(self.method) or not hasattr(self.method, "budget"):
            raise ValueError(f"FirstLayers.method must be a method instance with a budget field (e.g. RadarPlus(budget=512)), got {self.method!r}")
        check_int("FirstLayers", "layers", self.layers, 0)
        check_real("FirstLayers", "factor", self.factor, at_least=1)

    @property
    def budget(self) -> int | None:
        """The per-layer average: what ``--budget`` means for this method."""
        return self.method.budget

    def budget_of(self, layer_idx: int, n_layers: int | None) -> int | None:
        """Layer ``layer_idx``'s budget in a model of ``n_layers`` layers (None: a single layer)."""
        b = self.method.budget
        if b is None or n_layers is None or self.layers == 0 or self.layers >= n_layers:  # nothing to move
            return b
        others = n_layers - self.layers
        keep = math.ceil(b / 2)  # what every other layer keeps at least
        more = min(round(self.factor * b), (n_layers * b - others * keep) // self.layers)
        if layer_idx < self.layers:
            return more
        return (n_layers * b - self.layers * more) // others

    def method_of(self, layer_idx: int, n_layers: int | None) -> object:
        """The method layer ``layer_idx`` of ``n_layers`` runs: :attr:`method` with that layer's budget."""
        return with_budget(self.method, self.budget_of(layer_idx, n_layers))

    def new_state(self, *args, **kwargs) -> DecodeState:
        layer = layer_spec(*args, **kwargs)
        return self.method_of(layer.layer_idx, layer.n_layers).new_state(layer)


@dataclass(frozen=True)
class SplitLayers:
    """Run ``first`` in the first ``layers`` layers and ``others`` in every later layer.

    Layers differ in how their attention is spread (layer 0 of small models is diffuse, later layers
    mostly peaked), so a part that helps one kind of layer can hurt the other: e.g. a merged rest
    (:class:`~sparseattn.methods.rest.MergedRest`) where attention is diffuse and plain selection
    where it is not. Both methods must have the same ``budget``, so ``--budget`` keeps one meaning.

    Args:
        first: the method of layers ``0 .. layers - 1``.
        others: the method of every later layer.
        layers: how many first layers run ``first`` (0: every layer runs ``others``).
    """

    first: object
    others: object
    layers: int = 1

    def __post_init__(self) -> None:
        for name in ("first", "others"):
            method = getattr(self, name)
            if isinstance(method, type) or not callable(getattr(method, "new_state", None)):
                raise ValueError(f"SplitLayers.{name} must be a method instance (e.g. RadarPlus(budget=512)), got {method!r}")
        check_int("SplitLayers", "layers", self.layers, 0)
        first, others = getattr(self.first, "budget", None), getattr(self.others, "budget", None)
        if first != others:
            raise ValueError(
                f"SplitLayers.first has budget {first!r} and SplitLayers.others budget {others!r}: they must be "
                "equal, so that the budget means the same in every layer"
            )

    @property
    def budget(self) -> int | None:
        """Both methods' budget: what ``--budget`` means for this method."""
        return getattr(self.others, "budget", None)

    def method_of(self, layer_idx: int) -> object:
        """The method layer ``layer_idx`` runs."""
        return self.first if layer_idx < self.layers else self.others

    def new_state(self, *args, **kwargs) -> DecodeState:
        layer = layer_spec(*args, **kwargs)
        return self.method_of(layer.layer_idx).new_state(layer)


def layer_method(method, layer_idx: int, n_layers: int | None):
    """The plain method layer ``layer_idx`` of a model of ``n_layers`` layers runs under ``method``: ``method``
    itself unless it is a per-layer choice (:class:`FirstLayers`, :class:`SplitLayers`, nested), which is
    resolved down to one layer's method. What an engine that is not handed a :class:`LayerSpec` (the
    paged engine) calls per layer; the decode states resolve the same way through ``new_state``.

    >>> from sparseattn import registry
    >>> m = registry.build("radar+adaptive", budget=512)
    >>> layer_method(m, 0, 30).rest is None, layer_method(m, 1, 30).rest is not None
    (True, True)
    """
    while isinstance(method, (FirstLayers, SplitLayers)):
        method = method.method_of(layer_idx, n_layers) if isinstance(method, FirstLayers) else method.method_of(layer_idx)
    return method


def with_budget(method, budget: int | None):
    """``method`` with per-layer budget ``budget``: a :class:`SplitLayers` passes it to both its methods (so
    ``FirstLayers(SplitLayers(...))`` gives the first layers more and runs each layer's own method)."""
    if isinstance(method, SplitLayers):
        return dataclasses.replace(method, first=with_budget(method.first, budget), others=with_budget(method.others, budget))
    return dataclasses.replace(method, budget=budget)


def layer_budgets(method: FirstLayers, n_layers: int) -> list[int]:
    """Every layer's budget (their mean is at most the method's budget)."""
    return [method.budget_of(i, n_layers) for i in range(n_layers)]


def plain_first(method, layers: int) -> SplitLayers:
    """``method`` (a segment search with a ``rest``) in every layer but its first ``layers``, which run it
    without its ``rest`` (:class:`SplitLayers`; ``layers=0``: every layer runs ``method``)."""
    if method.rest is None and layers:
        raise ValueError(f"plain_layers={layers!r} shapes the merged or sampled rest; rest is 'dropped' (give rest='merged' or 'sampled')")
    return SplitLayers(dataclasses.replace(method, rest=None), method, layers=layers)


def first_layers_of(method, first_layers: int, layer_factor: float | None):
    """``method`` with ``layer_factor`` (None: :class:`FirstLayers`' default) times the budget in its first ``first_layers`` layers (:class:`FirstLayers`)."""
    if not first_layers:
        if layer_factor is not None:
            raise ValueError("layer_factor shapes the first layers' budget; give first_layers too")
        return method
    return FirstLayers(method, layers=first_layers, **({} if layer_factor is None else {"factor": layer_factor}))


def with_layer_options(preset, *, rest_layers: bool = False):
    """The catalogue's builder of ``preset`` (a builder of one :class:`SegmentSearch`): the preset, then the
    per-layer choices the options name: ``plain_layers`` (with ``rest_layers``: :func:`plain_first`) and
    ``first_layers`` / ``layer_factor`` (:class:`FirstLayers`). Its signature is the preset's with those
    keywords added, so the registry reads every default from the preset itself."""

    def build(*args, plain_layers: int = 0, first_layers: int = 0, layer_factor: float | None = None, **options):
        method = preset(*args, **options)
        if plain_layers:  # (an option of the catalogue's entry only with rest_layers)
            method = plain_first(method, plain_layers)
        return first_layers_of(method, first_layers, layer_factor)

    keyword = inspect.Parameter.KEYWORD_ONLY
    extra = [inspect.Parameter("first_layers", keyword, default=0), inspect.Parameter("layer_factor", keyword, default=None)]
    if rest_layers:
        extra.insert(0, inspect.Parameter("plain_layers", keyword, default=0))
    build.__signature__ = inspect.signature(preset).replace(
        parameters=[*inspect.signature(preset).parameters.values(), *extra], return_annotation=inspect.Signature.empty
    )
    build.__name__ = build.__qualname__ = f"{preset.__name__}ByLayer"
    build.__doc__ = f"{preset.__name__} with the catalogue's per-layer options (see :func:`with_layer_options`)."
    return build


__all__ = ["FirstLayers", "SplitLayers", "first_layers_of", "layer_budgets", "layer_method", "plain_first", "with_budget", "with_layer_options"]
