"""The vLLM general plugin: switched on by ``TORCH_CFM_VLLM_OMNI``, it serves every
``BatchedToken2Wav`` vLLM-Omni builds with torch_cfm.

vLLM calls :func:`register` in each of its processes before any work, possibly more than once
(entry-point group ``vllm.general_plugins``, name ``torch_cfm_vllm_omni``). With the variable
unset (or ``0``/``off``/``false``/``no``) it returns at once and changes nothing. Set, it checks
the options and installs a post-import hook on two vLLM-Omni modules (patched right away when
already imported), so the plugin itself never imports vLLM or vLLM-Omni:

* ``...minicpmo_4_5.batched_token2wav``: ``BatchedToken2Wav.__init__`` is wrapped, so each backend
  the Code2Wav stage builds is built without its own CUDA graphs and accelerated
  (:func:`.apply.construct_patched`; an unsupported configuration is built as configured and
  the reason logged once);
* ``...minicpmo_4_5.minicpmo_4_5_code2wav``: ``MiniCPMO45Code2Wav._bucket_key`` puts every
  continuing request with a torch_cfm state in one bucket (:func:`merged_bucket_key`), so one
  forward decodes all of them in one server step whatever their voice prompts and positions (the
  stage batches a voice's requests only, per cache shape, otherwise). New requests keep their
  per-prompt buckets: ``setup_batch`` takes one prompt.

Calling :func:`register` again is a no-op; :func:`unregister` removes the hook and the patches.

Values of ``TORCH_CFM_VLLM_OMNI``: ``1``/``on``/``true``/``yes`` (defaults), or options as
``key=value`` pairs separated by commas, e.g. ``max_streams=64,max_prompt_frames=500`` (keys and
meaning: :class:`.options.Options`; ``dtype`` takes float16/bfloat16/float32, ``warmup``,
``graphs`` and ``progress`` take 1/0, ``warmup_last_chunk_tokens`` lengths joined by ``+``).

Why an environment variable rather than a key in the Code2Wav stage's connector ``extra``: the
backend never sees that dict (the stage hands it the chunk sizes only), reading it means importing
the stage's module, which needs vLLM's config classes, and a plugin runs before any stage config
exists; the variable reaches every stage process the server spawns.
"""

from __future__ import annotations

import functools
import importlib.abc
import sys
from typing import Any, Mapping, Optional

from ... import policy
from ...errors import fail
from .apply import construct_patched
from .backend import is_torch_cfm_state
from .options import Options, log_once

__all__ = ["ENV", "TARGET_MODULE", "CODE2WAV_MODULE", "plugin_options", "register", "unregister", "install",
           "merged_bucket_key"]

ENV = policy.ENV_VLLM_OMNI
TARGET_MODULE = "vllm_omni.model_executor.models.minicpmo_4_5.batched_token2wav"
CODE2WAV_MODULE = "vllm_omni.model_executor.models.minicpmo_4_5.minicpmo_4_5_code2wav"
_MARK = "_torch_cfm_original"  # on a patched class: {attribute: what it was}
_OFF = {"", "0", "off", "false", "no"}
_ON = {"1", "on", "true", "yes"}
_INT_KEYS = ("max_streams", "max_prompt_frames", "max_chunk_tokens", "max_memory_bytes", "vocoder_seed")
_BOOL_KEYS = ("warmup", "graphs", "progress")
_OPTIONS: dict = {}


def _flag(key: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value not in _ON | (_OFF - {""}):
        fail(ENV, key, "be 1/0/on/off/true/false/yes/no", repr(raw))
    return value in _ON


def plugin_options(env: Optional[Mapping[str, str]] = None) -> Optional[dict]:
    """The options ``TORCH_CFM_VLLM_OMNI`` asks for (None: the plugin is off). Module docstring:
    the accepted values.

    Raises:
        ValueError: an unknown key or a bad value (the message names the variable and the key).
    """
    raw = policy.env_setting(ENV, env).strip()
    if raw.lower() in _OFF:
        return None
    if raw.lower() in _ON:
        return {}
    options: dict[str, Any] = {}
    for item in raw.split(","):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep:
            fail(ENV, "its value", "be 1/0 or key=value pairs separated by commas", repr(raw))
        if key in _INT_KEYS:
            try:
                options[key] = int(value)
            except ValueError:
                fail(ENV, key, "be an int", repr(value))
        elif key in _BOOL_KEYS:
            options[key] = _flag(key, value)
        elif key in ("dtype", "vocoder"):
            options[key] = value
        elif key == "encoder_batching":
            options[key] = "ragged" if value == "ragged" else _flag(key, value)
        elif key == "warmup_last_chunk_tokens":
            try:
                options[key] = tuple(int(v) for v in value.split("+") if v)
            except ValueError:
                fail(ENV, key, "be token counts joined by '+' (e.g. 3+16+28)", repr(value))
        else:
            known = sorted((*_INT_KEYS, *_BOOL_KEYS, "dtype", "vocoder", "encoder_batching", "warmup_last_chunk_tokens"))
            fail(ENV, "its keys", f"be among {known}", repr(key))
    Options(**options)  # a bad value fails here, when the plugin loads, not when the stage starts
    return options


def register() -> None:
    """The entry point vLLM calls (``vllm.general_plugins``): nothing unless ``TORCH_CFM_VLLM_OMNI``
    is set; then :func:`install` with its options. Safe to call any number of times."""
    options = plugin_options()
    if options is not None:
        install(options)


def install(options: Optional[Mapping[str, Any]] = None) -> None:
    """Accelerate every ``BatchedToken2Wav`` built from now on in this process (module docstring).
    Idempotent; a later call replaces the options the next backends are built with."""
    options = dict(options or {})
    Options(**options)  # checked before anything changes
    _OPTIONS.clear()
    _OPTIONS.update(options)
    for name in _PATCHES:
        if name in sys.modules:
            patch_module(sys.modules[name])
    if not any(getattr(f, "torch_cfm_vllm_omni", False) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportHook())


def unregister() -> None:
    """Remove the hook and restore the patched attributes (backends built meanwhile keep
    torch_cfm until :func:`~torch_cfm.integrations.vllm_omni.undo_torch_cfm_from_vllm_omni`)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "torch_cfm_vllm_omni", False)]
    for name, (cls_name, _) in _PATCHES.items():
        cls = getattr(sys.modules.get(name), cls_name, None)
        if isinstance(cls, type) and _MARK in vars(cls):
            for attr, value in vars(cls)[_MARK].items():
                setattr(cls, attr, value)
            delattr(cls, _MARK)
    _OPTIONS.clear()


def merged_bucket_key(state: Any, cache_epoch: Any) -> Optional[tuple]:
    """The Code2Wav bucket of a continuing request whose state is torch_cfm's: one for all of
    them (per cache epoch); None for any other state (the stage's own key applies)."""
    return ("torch_cfm", cache_epoch) if is_torch_cfm_state(state) else None


def _patch_backend(cls: type) -> dict:
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self, token2wav, *args, **kwargs):
        construct_patched(original, self, token2wav, args, kwargs, dict(_OPTIONS))

    cls.__init__ = __init__
    return {"__init__": original}


def _patch_code2wav(cls: type) -> dict:
    original = vars(cls)["_bucket_key"]  # a staticmethod(item) -> tuple
    own = original.__func__ if isinstance(original, staticmethod) else original

    @functools.wraps(own)
    def _bucket_key(item):
        previous = getattr(item, "previous", None)
        key = merged_bucket_key(getattr(previous, "token2wav", None), getattr(item, "cache_epoch", None))
        return own(item) if key is None else key

    cls._bucket_key = staticmethod(_bucket_key)
    return {"_bucket_key": original}


_PATCHES = {TARGET_MODULE: ("BatchedToken2Wav", _patch_backend),
            CODE2WAV_MODULE: ("MiniCPMO45Code2Wav", _patch_code2wav)}


def patch_module(module: Any) -> None:
    """Patch the class ``module`` holds (:data:`_PATCHES`) once: a second call finds the mark."""
    cls_name, patch = _PATCHES[module.__name__]
    cls = getattr(module, cls_name, None)
    if not isinstance(cls, type) or (cls_name == "MiniCPMO45Code2Wav" and "_bucket_key" not in vars(cls)):
        log_once(f"plugin:{cls_name}", f"{ENV}: {module.__name__} has no {cls_name} of the known layout; "
                 "vLLM-Omni's own code stays there")
        return
    if _MARK not in vars(cls):
        setattr(cls, _MARK, patch(cls))


class _PostImportHook(importlib.abc.MetaPathFinder):
    """Finds the target module through the other finders and patches it once it has run."""

    torch_cfm_vllm_omni = True

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _PATCHES:
            return None
        for finder in sys.meta_path:
            if getattr(finder, "torch_cfm_vllm_omni", False) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _PatchingLoader(spec.loader)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        patch_module(module)

    def __getattr__(self, name):  # get_source, get_filename, ... of the real loader
        return getattr(self.loader, name)
