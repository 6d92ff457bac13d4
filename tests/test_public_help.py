"""What `help()` shows of the public API: every config field's doc line, the real signature of
`deepspeed_initialize` (loaded without DeepSpeed), and help text on every profiler option."""
from __future__ import annotations

import dataclasses
import json
import os
import pydoc
import re
import subprocess
import sys

import pytest

import coat_ds

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("cls", [coat_ds.ActivationConfig, coat_ds.Fp8LinearConfig, coat_ds.OptimStateConfig,
                                 coat_ds.AdamWHyperparams, coat_ds.FsdpConfig, coat_ds.ApplyConfig],
                         ids=lambda c: c.__name__)
def test_help_shows_a_doc_line_for_every_config_field(cls):
    text = pydoc.render_doc(cls, renderer=pydoc.plaintext)
    for field in dataclasses.fields(cls):
        line = re.search(rf"^\s*\|?\s+{field.name}: (.*)$", text, re.M)
        assert line is not None and len(line.group(1).split()) >= 2, f"{cls.__name__}.{field.name} has no doc line"


@pytest.mark.slow
def test_deepspeed_initialize_has_the_real_signature_without_loading_deepspeed():
    # A fresh interpreter: this one may have imported DeepSpeed for other tests.
    code = (
        "import inspect, json, sys\n"
        "import coat_ds\n"
        "loaded = 'deepspeed' in sys.modules\n"
        "from coat_ds.integrations.deepspeed.engine import initialize\n"
        "print(json.dumps({'loaded': loaded, 'after': 'deepspeed' in sys.modules,\n"
        "    'same': inspect.signature(coat_ds.deepspeed_initialize) == inspect.signature(initialize),\n"
        "    'sig': str(inspect.signature(coat_ds.deepspeed_initialize)),\n"
        "    'help': 'Drop-in for `deepspeed.initialize`' in (coat_ds.deepspeed_initialize.__doc__ or ''),\n"
        "    'listed': 'deepspeed_initialize' in dir(coat_ds)}))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["loaded"] is False and result["after"] is False, "importing coat_ds loaded DeepSpeed"
    assert result["same"] and "model=None" in result["sig"] and "config=None" in result["sig"], result["sig"]
    assert result["help"] and result["listed"]


def test_coat_adamw_help_names_the_step_host_tensors_take():
    """CoatAdamW's docstring says where a step on host tensors runs: the module the kernel
    table hands them to (backend "auto" and "torch"), and the switch of its C++ kernel."""
    import torch

    from coat_ds.kernels import get, host_native

    doc = " ".join(coat_ds.CoatAdamW.__doc__.split())
    for backend in ("auto", "torch"):
        module = get("adamw", torch.device("cpu"), backend).step.__module__
        assert module.replace(".", "/") + ".py" in doc, (backend, module)
    assert f"{host_native.DISABLE_ENV}=1" in doc and "C++" in doc


def test_every_profiler_option_has_help_text():
    from coat_ds.profile.options import build_parser

    parser = build_parser()
    missing = [a.option_strings[0] for a in parser._actions if a.option_strings and not a.help]
    assert not missing, f"profiler options without help: {missing}"
