"""torch_cfm ops: public wrappers plus fake / autocast / per-device registrations."""

from .cfm_attention import cfm_attention
from .dit_body import dit_body  # registers torch_cfm::dit_body (schema, fake, autocast, CPU/CUDA)

__all__ = ["cfm_attention", "dit_body"]
