"""Storage that grows by capacity doubling, so appending one token is amortised O(1)."""

from __future__ import annotations

import torch


class GrowableBuffer:
    """A tensor that grows along one dimension by capacity doubling.

    ``transformers``' ``DynamicLayer`` concatenates the whole cache on every token (O(t) per step);
    here an append copies only the new block, except when the capacity doubles, which happens
    O(log t) times, so the total copy work for t tokens is O(t).

    Example:
        >>> buf = GrowableBuffer(dim=2)
        >>> buf.append(torch.zeros(1, 2, 3, 4))
        >>> buf.append(torch.ones(1, 2, 1, 4))
        >>> tuple(buf.view().shape), len(buf)
        ((1, 2, 4, 4), 4)
    """

    def __init__(self, dim: int = 2, min_capacity: int = 16) -> None:
        self.dim = dim
        self.min_capacity = min_capacity
        self._data: torch.Tensor | None = None
        self._length = 0

    def __len__(self) -> int:
        return self._length

    @property
    def capacity(self) -> int:
        return 0 if self._data is None else self._data.shape[self.dim]

    def _check_compatible(self, block: torch.Tensor) -> None:
        assert self._data is not None
        expected = list(self._data.shape)
        got = list(block.shape)
        expected[self.dim] = got[self.dim] = -1
        if expected != got or block.dtype != self._data.dtype:
            raise ValueError(
                f"cannot append a block of shape {tuple(block.shape)} and dtype {block.dtype} to a buffer "
                f"of shape {tuple(self._data.shape)} and dtype {self._data.dtype} (growing dim {self.dim})"
            )

    def append(self, block: torch.Tensor) -> None:
        """Append ``block`` along ``dim``; all other dimensions and the dtype must match."""
        n = block.shape[self.dim]
        if self._data is None:
            shape = list(block.shape)
            # An eighth more than a first block (a prompt) holds: the first decode tokens then fit, instead
            # of doubling a long prompt's cache at the first one (2x its memory for a few new tokens).
            shape[self.dim] = max(self.min_capacity, n + n // 8)
            self._data = block.new_empty(shape)
        else:
            self._check_compatible(block)
        needed = self._length + n
        if needed > self.capacity:
            shape = list(self._data.shape)
            shape[self.dim] = max(needed, 2 * self.capacity)
            grown = self._data.new_empty(shape)
            grown.narrow(self.dim, 0, self._length).copy_(self._data.narrow(self.dim, 0, self._length))
            self._data = grown
        self._data.narrow(self.dim, self._length, n).copy_(block)
        self._length = needed

    def replace(self, block: torch.Tensor) -> None:
        """Drop the contents and hold ``block`` instead (used when a structure is rebuilt)."""
        self._data = None
        self._length = 0
        self.append(block)

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` entries."""
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot truncate a buffer of length {self._length} to {length}")
        self._length = length

    def reserve(self, capacity: int) -> None:
        """Hold at least ``capacity`` entries from now on (one copy if it grows; zeros past the filled part): appends up
        to it keep the storage in place.

        What a loop of fixed shapes needs (:mod:`sparseattn.methods.static_step`): its steps write the new
        tokens into :attr:`storage` themselves, at positions held in a device tensor, and the storage
        must not move under a captured graph.
        """
        if self._data is None:
            raise ValueError("GrowableBuffer.reserve: the buffer is empty; append a first block (its shape) first")
        if capacity > self.capacity:
            shape = list(self._data.shape)
            shape[self.dim] = capacity
            grown = self._data.new_empty(shape)
            grown.narrow(self.dim, 0, self._length).copy_(self._data.narrow(self.dim, 0, self._length))
            self._data = grown
        # Zeros where nothing is written yet: a fixed-shape step reads positions past the length with weight 0,
        # and 0 x an uninitialised NaN would be NaN.
        self._data.narrow(self.dim, self._length, self.capacity - self._length).zero_()

    @property
    def storage(self) -> torch.Tensor:
        """The whole storage, filled or not (its size along ``dim`` is :attr:`capacity`)."""
        if self._data is None:
            raise ValueError("the buffer is empty and has no storage yet")
        return self._data

    def fill_to(self, length: int) -> None:
        """Count the first ``length`` entries as filled: entries past the old length were written into :attr:`storage` by the caller."""
        if not 0 <= length <= self.capacity:
            raise ValueError(f"GrowableBuffer.fill_to: length must be in [0, {self.capacity}] (the capacity), got {length}")
        self._length = length

    def view(self) -> torch.Tensor:
        """The filled part, as a view (no copy)."""
        if self._data is None:
            raise ValueError("the buffer is empty and has no shape yet")
        return self._data.narrow(self.dim, 0, self._length)

    def apply_(self, fn) -> None:
        """Replace the storage by ``fn(storage)`` (e.g. a device move or a batch reindex)."""
        if self._data is not None:
            self._data = fn(self._data)


class Workspace:
    """Scratch tensors reused across decode steps, grown by capacity doubling.

    A fresh multi-megabyte tensor costs page faults on first touch (glibc hands large blocks back to
    the OS, so every step would pay again): on CPU that made a gather of the selected tokens ~10x
    slower than the copy itself. A decode state keeps one workspace and the ops write into it.

    Example:
        >>> ws = Workspace()
        >>> a = ws.get("k", (2, 3), torch.float32, torch.device("cpu"))
        >>> b = ws.get("k", (1, 3), torch.float32, torch.device("cpu"))
        >>> a.data_ptr() == b.data_ptr(), tuple(b.shape)
        (True, (1, 3))
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A contiguous tensor of ``shape`` (contents undefined), valid until the next ``get(name, ...)``."""
        numel = 1
        for n in shape:
            numel *= n
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            capacity = max(numel, 2 * buf.numel() if buf is not None and buf.dtype == dtype else 0)
            buf = torch.empty(capacity, dtype=dtype, device=device)
            self._buffers[name] = buf
        return buf[:numel].view(shape)
