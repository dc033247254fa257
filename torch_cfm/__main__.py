"""``python -m torch_cfm``: print the dispatch decisions for this machine (see torch_cfm.explain)."""

from .diagnostics import explain

explain()
