"""The ``torch_cfm`` torch.compile backend: the rules on the Dynamo graph, then stock Inductor.

``torch.compile(model, backend="torch_cfm")`` calls :func:`torch_cfm_backend` with the graph
Dynamo traced (torch-level ops, fake tensors in ``node.meta["example_value"]``). The composed
pass rewrites it there, before AOT dispatch, so a fused op that is a ``triton_op`` is traced
into its Triton kernels and Inductor sees them; then the graph goes to
``torch._inductor.compile_fx.compile_fx`` with the ``mode``/``options`` the user gave (same
meaning as for ``backend="inductor"``), and with the same pass object in
``joint_custom_pre_pass`` for the clone guard (pytorch#198031).

Options with the ``torch_cfm.`` prefix configure the rules instead of Inductor:
``torch_cfm.fused`` (bool), ``torch_cfm.tf32`` (bool), ``torch_cfm.capability`` ((major, minor)),
``torch_cfm.guard_clones`` (bool), ``torch_cfm.guard_namespaces`` (op namespaces).

The backend is registered by name when :mod:`torch_cfm.compile_rules` is imported, and through
the ``torch_dynamo_backends`` entry point (``setup.py``) so the name works without an import.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.fx

from . import hooks
from .passes import RulesConfig, Site, TorchCfmPass
from .passes.dit_step import pack_bindings

BACKEND_NAME = "torch_cfm"
OPTION_PREFIX = "torch_cfm."
_MAX_SITES = 4096  # a long-running server recompiles: keep the newest sites only
_RULE_OPTIONS = {f.name for f in dataclasses.fields(RulesConfig)} - {"env"}


def split_options(options: Optional[Mapping[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split backend options into (RulesConfig fields, Inductor config options)."""
    rules: dict[str, Any] = {}
    inductor: dict[str, Any] = {}
    for key, value in (options or {}).items():
        if key.startswith(OPTION_PREFIX):
            name = key[len(OPTION_PREFIX):]
            if name not in _RULE_OPTIONS:
                raise ValueError(f"torch_cfm backend: option {key!r} must be one of "
                                 f"{sorted(OPTION_PREFIX + n for n in _RULE_OPTIONS)}, got {key!r}")
            if name in ("capability", "guard_namespaces") and value is not None:
                value = tuple(value)
            rules[name] = value
        else:
            inductor[key.replace("-", "_")] = value
    return rules, inductor


def inductor_patches(mode: Optional[str], options: Mapping[str, Any]) -> dict[str, Any]:
    """Inductor config patches for ``mode`` + ``options``, as ``backend="inductor"`` builds them."""
    from torch._inductor import config as inductor_config
    from torch._inductor import list_mode_options

    patches: dict[str, Any] = {}
    if mode and mode != "default":
        patches.update(list_mode_options(mode))
    known = inductor_config.get_config_copy()
    for key, value in options.items():
        if key not in known:
            raise ValueError(f"torch_cfm backend: option {key!r} must be an Inductor config name "
                             f"(torch._inductor.config) or start with {OPTION_PREFIX!r}, got {key!r}")
        patches[key] = value
    return patches


class TorchCfmBackend:
    """A ``torch.compile`` backend running the torch_cfm rules, then Inductor.

    Args:
        rules: the :class:`RulesConfig` for every graph this backend compiles (options with the
            ``torch_cfm.`` prefix override single fields).
        compiler: what compiles the rewritten graph (default Inductor's ``compile_fx``); called
            as ``compiler(gm, example_inputs, config_patches=...)``. Tests pass an eager runner.
    Attributes:
        sites: the :class:`Site` records of the graphs compiled so far (newest 4096).
        last_pass: the pass object of the latest graph (its ``last_sites``, ``uuid()``).
    """

    def __init__(self, rules: Optional[RulesConfig] = None, compiler: Optional[Callable[..., Any]] = None):
        self.rules = rules or RulesConfig()
        self.compiler = compiler
        self.sites: list[Site] = []
        self.last_pass: Optional[TorchCfmPass] = None

    def make_pass(self, options: Optional[Mapping[str, Any]] = None) -> tuple[TorchCfmPass, dict[str, Any]]:
        overrides, inductor = split_options(options)
        return TorchCfmPass(dataclasses.replace(self.rules, **overrides)), inductor

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *,
                 mode: Optional[str] = None, options: Optional[Mapping[str, Any]] = None, **_: Any):
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import compile_fx

        rules_pass, inductor_options = self.make_pass(options)
        rules_pass(gm.graph)
        gm.recompile()
        self.last_pass = rules_pass
        self.sites = (self.sites + rules_pass.last_sites)[-_MAX_SITES:]
        patches = inductor_patches(mode, inductor_options)
        if rules_pass.config.guard_clones:
            current = patches.get("joint_custom_pre_pass", inductor_config.joint_custom_pre_pass)
            patches["joint_custom_pre_pass"] = hooks.add_pass(current, rules_pass)
        compiler = self.compiler or compile_fx
        compiled = compiler(gm, list(example_inputs), config_patches=patches)
        bindings = pack_bindings(gm)
        return with_pack_refresh(compiled, bindings) if bindings else compiled

    def reset(self) -> None:
        """Called by ``torch._dynamo.reset()``: drop CUDA-graph trees like Inductor's wrapper."""
        if torch.cuda.is_available():
            from torch._inductor.cudagraph_trees import reset_cudagraph_trees

            reset_cudagraph_trees()


def with_pack_refresh(compiled: Callable[..., Any], bindings: list) -> Callable[..., Any]:
    """Wrap a compiled graph so that weights packed at compile time follow their parameters
    (see :class:`~torch_cfm.compile_rules.markers.PackBinding`); keeps the boxed calling
    convention Dynamo uses for Inductor's output."""
    boxed = bool(getattr(compiled, "_boxed_call", False))

    def run(*args: Any) -> Any:
        # Dynamo calls with the arguments; debug tools call a boxed function with one list.
        real = args[0] if boxed and len(args) == 1 and isinstance(args[0], list) else args
        for binding in bindings:
            binding.refresh(real)
        return compiled(*args)

    run._boxed_call = boxed  # type: ignore[attr-defined]
    run.pack_bindings = bindings  # type: ignore[attr-defined]
    return run


_DEFAULT_BACKEND = TorchCfmBackend()


def torch_cfm_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any):
    """The registered ``"torch_cfm"`` backend (default :class:`RulesConfig`: docs/design.md §5 policy)."""
    return _DEFAULT_BACKEND(gm, example_inputs, **kwargs)


torch_cfm_backend.reset = _DEFAULT_BACKEND.reset  # type: ignore[attr-defined]


def default_backend() -> TorchCfmBackend:
    """The backend object behind the ``"torch_cfm"`` name (its ``sites`` are inspectable)."""
    return _DEFAULT_BACKEND


def register() -> None:
    """Register ``"torch_cfm"`` with Dynamo unless it is registered, or being loaded from the
    ``torch_dynamo_backends`` entry point (Dynamo then registers the loaded function itself)."""
    from importlib.metadata import EntryPoint

    from torch._dynamo.backends import registry

    if BACKEND_NAME in registry._COMPILER_FNS:
        return
    if isinstance(registry._BACKENDS.get(BACKEND_NAME), EntryPoint):
        return
    registry.register_backend(compiler_fn=torch_cfm_backend, name=BACKEND_NAME)
