"""coat_ds._compat.triton and coat_ds._compat.deepspeed: each probe forced off warns once (or,
where there is no fallback, raises an error naming the missing piece) and the result stays
right; and no private Triton or DeepSpeed access is left outside coat_ds/_compat."""
from __future__ import annotations

import importlib.machinery
import os
import re
import warnings

import pytest
import torch

import coat_ds
from coat_ds import _compat
from coat_ds._compat import deepspeed as ds_compat
from coat_ds._compat import triton as tr_compat

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="needs Triton's interpreter (TRITON_INTERPRET=1)")


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Every test sees its own once-per-process warnings and probes."""
    monkeypatch.setattr(_compat, "_WARNED", set())
    tr_compat._direct_launch_parts.cache_clear()
    ds_compat.known_config_words.cache_clear()
    yield
    tr_compat._direct_launch_parts.cache_clear()
    ds_compat.known_config_words.cache_clear()


def _runtime_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, RuntimeWarning)]


# -- Triton -------------------------------------------------------------------------------

@pytest.mark.parametrize("text, version", [("3.6.0", (3, 6)), ("3.9.1+git1234", (3, 9)), ("10.12", (10, 12)),
                                           ("3", (0, 0)), ("dev", (0, 0)), ("3.x", (0, 0))])
def test_parse_version(text, version):
    assert tr_compat.parse_version(text) == version


def test_fp8_reads_the_version_probe_of_compat():
    import triton

    from coat_ds.kernels import fp8

    assert fp8.triton_version is tr_compat.triton_version
    assert fp8.triton_version() == tr_compat.parse_version(triton.__version__)
    assert fp8.TRITON_MIN == tr_compat.TRITON_MIN


class _Compiled:
    """Records how it is launched: the attributes `fast_launcher` reads from a CompiledKernel."""

    function, packed_metadata = "fn-handle", "packed"

    def __init__(self):
        self.calls = []

    def run(self, *args):
        self.calls.append(("run", args))

    def __getitem__(self, grid):
        return lambda *args: self.calls.append(("getitem", grid, args))


def _pass_probe(monkeypatch):
    """The probe as on a CUDA build of torch with a checked Triton: stream 7 on device 0."""
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 7 + device, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(tr_compat, "triton_version", lambda: (3, 9))


def test_fast_launcher_passes_the_launcher_its_arguments_and_yields_to_hooks(monkeypatch, recwarn):
    from triton import knobs

    _pass_probe(monkeypatch)
    kernel = _Compiled()
    launch = tr_compat.fast_launcher(kernel)
    assert launch is not None
    x = torch.zeros(4)
    launch(3, (x, 4), (16, 2))
    assert kernel.calls == [("run", (3, 1, 1, 7, "fn-handle", "packed", None, None, None, x, 4, 16, 2))]
    hook = lambda *a: None  # noqa: E731 - a profiler's launch hook
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        launch(5, (x, 4), (16, 2))
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert kernel.calls[1] == ("getitem", (5, 1, 1), (x, 4, 16, 2))
    assert _runtime_warnings(recwarn) == []


@pytest.mark.parametrize("force", ["version", "stream", "kernel"])
def test_fast_launcher_probe_off_warns_once(monkeypatch, force):
    _pass_probe(monkeypatch)
    kernel = _Compiled()
    if force == "version":
        monkeypatch.setattr(tr_compat, "triton_version", lambda: (3, 5))
        why = r"Triton 3\.5 \(its launcher's arguments were checked only on 3\.6, 3\.9\)"
    elif force == "stream":
        monkeypatch.delattr(torch._C, "_cuda_getCurrentRawStream")
        why = r"lacks torch\._C\._cuda_getCurrentRawStream"
    else:
        kernel = object()
        why = r"its compiled kernel \(object\) has no run / function / packed_metadata"
    with pytest.warns(RuntimeWarning, match=why) as record:
        assert tr_compat.fast_launcher(kernel) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tr_compat.fast_launcher(kernel) is None  # said once
    assert len(_runtime_warnings(record)) == 1
    assert "launching through the public kernel[grid](...)" in str(record[0].message)


@interpreted
def test_public_launch_fallback_gives_the_same_result(monkeypatch):
    # The fast path never runs on CPU; what a CUDA launch falls back to when the probe fails
    # is `fn[grid]`, and here it writes the same bits as the interpreter's own launch.
    import triton

    from coat_ds.kernels import act_codec as aq
    from coat_ds.kernels import get, jit
    from coat_ds.kernels.fp8 import ISA_GENERIC

    codec = get("act_codec", torch.device("cpu"), "triton")
    monkeypatch.setattr(tr_compat, "triton_version", lambda: (3, 5))
    torch.manual_seed(0)
    x = torch.randn(3000) * torch.logspace(-3, 2, 3000)
    codes, exp = codec.quantize_tensor(x)
    expected = codec.dequantize_tensor(codes, exp)
    with pytest.warns(RuntimeWarning, match="direct launch of compiled Triton kernels is unavailable"):
        run = jit._launcher(aq._dequantize_tensor_kernel, None, aq._NUM_WARPS)
    out = torch.empty_like(x)
    n = x.numel()
    run(triton.cdiv(n, aq.BLOCK_ELEMS), (codes, exp, out, n, aq._out_max(torch.float32)),
        (0, aq.BLOCK_ELEMS, ISA_GENERIC))
    assert torch.equal(out, expected)
    sqnr = 10 * torch.log10(x.pow(2).sum() / (out - x).pow(2).sum())
    assert sqnr > 25, float(sqnr)


@interpreted
def test_cpu_launches_never_warn(monkeypatch):
    from coat_ds.kernels import get

    codec = get("act_codec", torch.device("cpu"), "triton")
    monkeypatch.setattr(tr_compat, "triton_version", lambda: (3, 5))
    x = torch.randn(64, 32)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        codes, exps = codec.quantize_rows(x)
        codec.dequantize_rows(codes, exps)
    assert _runtime_warnings(record) == []


# -- DeepSpeed ----------------------------------------------------------------------------

def test_known_keys_unreadable_warns_once_and_checks_no_key(monkeypatch, tmp_path):
    from coat_ds.integrations.deepspeed.config import load_ds_config

    fake = tmp_path / "deepspeed" / "__init__.py"
    fake.parent.mkdir()
    fake.write_text("")
    spec = importlib.machinery.ModuleSpec("deepspeed", None, origin=str(fake))
    monkeypatch.setattr(ds_compat.importlib.util, "find_spec", lambda name: spec if name == "deepspeed" else None)
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimisation": {"stage": 2}}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert load_ds_config(cfg) == cfg
        assert load_ds_config(cfg) == cfg
    messages = [str(w.message) for w in record]
    assert len(messages) == 1 and issubclass(record[0].category, RuntimeWarning), messages
    assert re.search(r"cannot read the config keys of DeepSpeed \S+ \(coat_ds checked 0\.19\.8\) from .*config\.py; "
                     "unknown top-level keys of a DeepSpeed JSON are not reported", messages[0])


def test_known_keys_from_the_installed_deepspeed():
    words = ds_compat.known_config_words()
    assert {"zero_optimization", "train_micro_batch_size_per_gpu", "gradient_clipping", "bf16"} <= words
    assert "zero_optimisation" not in words


@pytest.fixture
def no_zero_list(monkeypatch):
    from deepspeed.runtime.zero import utils as zero_utils

    monkeypatch.delattr(torch.optim, "CoatAdamW", raising=False)
    monkeypatch.delattr(zero_utils, "ZERO_SUPPORTED_OPTIMIZERS")


def test_registry_without_zero_list_warns_once_and_still_registers(no_zero_list):
    from coat_ds.integrations.deepspeed.registry import is_registered, mark_zero_tested

    with pytest.warns(RuntimeWarning, match=r"DeepSpeed \S+ \(coat_ds checked 0\.19\.8\) has no list "
                      r"deepspeed\.runtime\.zero\.utils\.ZERO_SUPPORTED_OPTIMIZERS") as record:
        coat_ds.register_deepspeed()
        mark_zero_tested()
    assert len(_runtime_warnings(record)) == 1
    assert torch.optim.CoatAdamW is coat_ds.CoatAdamW
    assert not is_registered()  # only one of the two additions could be made


@pytest.mark.parametrize("name", ["_get_fp32_state_dict_from_zero2_checkpoint",
                                  "_get_fp32_state_dict_from_zero3_checkpoint", "parse_model_states"])
def test_consolidation_without_zero_to_fp32_internals_names_them(monkeypatch, tmp_path, name):
    from deepspeed.utils import zero_to_fp32

    from coat_ds.integrations.deepspeed.checkpoint import consolidate_checkpoint

    monkeypatch.delattr(zero_to_fp32, name)
    with pytest.raises(ds_compat.DeepSpeedInternalsError,
                       match=rf"consolidate_checkpoint needs deepspeed\.utils\.zero_to_fp32\.{name}, which "
                             r"DeepSpeed \S+ \(coat_ds checked 0\.19\.8\) lacks"):
        consolidate_checkpoint(str(tmp_path))


def test_consolidation_with_changed_zero_to_fp32_arguments_names_them(monkeypatch, tmp_path):
    from deepspeed.utils import zero_to_fp32

    from coat_ds.integrations.deepspeed.checkpoint import consolidate_checkpoint

    monkeypatch.setattr(zero_to_fp32, "_get_fp32_state_dict_from_zero3_checkpoint",
                        lambda world_size, fp32_flat_groups, zero_model_states: None)
    with pytest.raises(ds_compat.DeepSpeedInternalsError,
                       match=r"_get_fp32_state_dict_from_zero3_checkpoint\(world_size, fp32_flat_groups, "
                             r"zero_model_states, exclude_frozen_parameters, \.\.\.\) \(it takes \(world_size, "
                             r"fp32_flat_groups, zero_model_states, \.\.\.\)\)"):
        consolidate_checkpoint(str(tmp_path))


def test_scatter_without_safe_set_full_fp32_param_names_it(monkeypatch):
    import deepspeed.utils

    monkeypatch.delattr(deepspeed.utils, "safe_set_full_fp32_param")
    with pytest.raises(ds_compat.DeepSpeedInternalsError,
                       match=r"load_fp32_checkpoint needs deepspeed\.utils\.safe_set_full_fp32_param"):
        ds_compat.set_full_fp32_param(torch.nn.Parameter(torch.zeros(2)), torch.ones(2))


def test_zero3_references_released_and_fallback_warns_once(monkeypatch):
    from deepspeed.runtime.zero import parameter_offload

    ours, other = torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.nn.Linear(2, 2)
    monkeypatch.setattr(parameter_offload, "FWD_MODULE_STACK", [ours[0], other, ours])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds_compat.release_zero3_references(ours)
    assert parameter_offload.FWD_MODULE_STACK == [other]

    monkeypatch.delattr(parameter_offload, "FWD_MODULE_STACK")
    with pytest.warns(RuntimeWarning, match=r"lacks parameter_offload\.FWD_MODULE_STACK .* memory is held until "
                      "the process ends") as record:
        ds_compat.release_zero3_references(ours)
        ds_compat.release_zero3_references(ours)
    assert len(_runtime_warnings(record)) == 1


def test_comm_op_note_without_op_registry_warns_once(monkeypatch):
    import deepspeed.git_version_info

    from coat_ds.integrations.deepspeed.engine import comm_op_build_note

    monkeypatch.delattr(deepspeed.git_version_info, "installed_ops")
    with pytest.warns(RuntimeWarning, match=r"has no deepspeed\.ops\.__compatible_ops__") as record:
        assert comm_op_build_note() is None
        assert comm_op_build_note() is None
    assert len(_runtime_warnings(record)) == 1


# -- nothing private outside _compat ------------------------------------------------------

_PACKAGE = os.path.dirname(coat_ds.__file__)
# Anywhere in the text, docs included: the check for Triton and DeepSpeed (torch's
# privates are the torch part's), name-mangled names in strings, torch's CUDA
# stream getters and DeepSpeed's private functions.
_ANYWHERE = re.compile(r"CompiledKernel|\._[A-Za-z]+__[a-z]|triton\.compiler|_[A-Z][A-Za-z]+__[a-z]|_cuda_get|"
                       r"_get_fp32_state_dict_from_zero|_fp32_optimizer_param_groups|__compatible_ops__|"
                       r"FWD_MODULE_STACK|_get_build_directory")
# In code: DeepSpeed's internals that coat_ds reaches through _compat.deepspeed.
_IN_CODE = re.compile(r"\b(zero_to_fp32|ZERO_SUPPORTED_OPTIMIZERS|safe_set_full_fp32_param|knobs)\b|"
                      r"\.(single_partition_of_fp32_groups|fp32_partitioned_groups_flat|fp16_partitioned_groups\w*|"
                      r"sub_group_to_group_id|update_lp_params|unflatten)\b")


def _code_lines(text: str) -> list[tuple[int, str]]:
    """(line number, code) with comments and string literals blanked."""
    import io
    import tokenize

    lines = text.splitlines()
    kept = {i: list(line) for i, line in enumerate(lines, 1)}
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in (tokenize.STRING, tokenize.COMMENT):
            for row in range(tok.start[0], tok.end[0] + 1):
                lo = tok.start[1] if row == tok.start[0] else 0
                hi = tok.end[1] if row == tok.end[0] else len(kept[row])
                kept[row][lo:hi] = " " * (hi - lo)
    return [(i, "".join(chars)) for i, chars in kept.items()]


def test_no_private_triton_or_deepspeed_access_outside_compat():
    found = []
    for root, _, files in os.walk(_PACKAGE):
        rel = os.path.relpath(root, _PACKAGE)
        if rel.split(os.sep)[0] == "_compat":
            continue
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            where = os.path.relpath(path, _PACKAGE)
            with open(path, encoding="utf-8") as f:
                text = f.read()
            found += [f"{where}:{i}: {line.strip()}" for i, line in enumerate(text.splitlines(), 1)
                      if _ANYWHERE.search(line)]
            found += [f"{where}:{i}: {line.strip()}" for i, line in _code_lines(text) if _IN_CODE.search(line)]
    assert not found, "private access outside coat_ds/_compat:\n" + "\n".join(found)
