"""A bare source checkout (extension built in place, ``PYTHONPATH=<repo>``, no pip install: how the
GPU box runs) still imports ``torch_cfm.compile_rules`` from the top-level ``compile_rules/`` folder."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import sys
# Drop any installer's finder (editable installs map torch_cfm.compile_rules themselves).
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in str(getattr(f, "__module__", "")).lower()]
import torch_cfm
from torch_cfm.compile_rules.markers import mark_dit_step
from torch_cfm.compile_rules.passes import attention
import torch_cfm.compile_rules as rules
print(rules.__file__)
print(attention.__name__)
"""


def test_compile_rules_import_from_a_bare_checkout():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    rules_file, attention_name = res.stdout.split()[-2:]
    assert rules_file == os.path.join(ROOT, "compile_rules", "__init__.py")
    assert attention_name == "torch_cfm.compile_rules.passes.attention"
