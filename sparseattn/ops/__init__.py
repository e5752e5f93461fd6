"""Pure tensor functions: no transformers import, no method state."""

from sparseattn.ops.attention import attention_ref, segment_attention, segment_attention_ref, segment_mask
from sparseattn.ops.buffers import GrowableBuffer
from sparseattn.ops.features import draw_projection, log_positive_features
from sparseattn.ops.layout import SegmentLayout

__all__ = [
    "GrowableBuffer",
    "SegmentLayout",
    "attention_ref",
    "draw_projection",
    "log_positive_features",
    "segment_attention",
    "segment_attention_ref",
    "segment_mask",
]
