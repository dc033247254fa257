"""torch_cfm ops: public wrappers plus fake / autocast / per-device registrations."""

from .cfm_attention import cfm_attention

__all__ = ["cfm_attention"]
