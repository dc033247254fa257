"""Plain-PyTorch reference math: defines the semantics every fast path is checked against."""

from .cfm_attention import cfm_attention_reference

__all__ = ["cfm_attention_reference"]
