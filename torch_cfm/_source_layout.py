"""Make ``torch_cfm.compile_rules`` importable from a bare source checkout.

pyproject.toml maps the top-level ``compile_rules/`` folder to the subpackage ``torch_cfm.compile_rules``
(``package_dir``); an installed or editable package carries that mapping. A checkout used without
an installer (``python3 setup.py build_ext --inplace`` and ``PYTHONPATH=<repo>``, as on the GPU
box, where pip's editable install needs the network) does not: this finder, last on
``sys.meta_path``, applies the same mapping so installed packages always win.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

_NAME = "torch_cfm.compile_rules"
_SOURCE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "compile_rules")


class _CompileRulesFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != _NAME:
            return None  # submodules resolve through the package's __path__ (the source folder)
        return importlib.util.spec_from_file_location(
            fullname, os.path.join(_SOURCE, "__init__.py"), submodule_search_locations=[_SOURCE])


def install() -> None:
    if os.path.isfile(os.path.join(_SOURCE, "__init__.py")) and not any(
            isinstance(f, _CompileRulesFinder) for f in sys.meta_path):
        sys.meta_path.append(_CompileRulesFinder())
