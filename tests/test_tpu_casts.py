"""The TPU compiler's update keeps fp32 weight stacks whole: cast to bf16 one layer at a time.

In a file of its own so that the test runner can give its two compiles (about a minute) to the
other worker than test_tpu_compile.py's.
"""

import re

import jax
import jax.numpy as jnp
import pytest

from logra_jax.perf import tpu

pytestmark = pytest.mark.skipif(tpu.libtpu_version() is None,
                                reason="libtpu (the 'tpu' extra) is not installed: no TPU compiler")


def _whole_stack_casts(config, monkeypatch, tmp_path, options=None):
    """The bf16 casts of whole [layers, in, out] weight stacks (entry parameters) in the TPU
    compiler's update for 4 v5p chips."""
    from logra_jax.perf import memory
    from logra_jax.rl import update
    from logra_jax.rl.build import build_mesh
    if options is not None:
        monkeypatch.setattr(update, "update_compiler_options", lambda params: options)
    target = tpu.target("v5p-8")
    mesh = build_mesh({"fsdp": target.devices, "tensor": 1}, tpu.devices(target))
    memory.update_step_memory(config, mesh, micro_steps=1, dump_dir=tmp_path)
    text = next(p for p in tmp_path.glob("*_step_impl*after_optimizations.txt")).read_text()
    layers = config.model.tiny.num_layers
    return re.findall(rf"bf16\[{layers},\d+,\d+\]\S* convert\(%param[.\d]*\)", text)


def test_fp32_weight_stacks_are_cast_per_layer_not_copied_whole_in_bf16(monkeypatch, tmp_path):
    """fp32 master weights, bf16 compute: the layer scan casts each layer's kernels as it reaches
    them. The TPU compiler's bfloat16-propagation pass would instead cast every whole stack once
    before the micro-steps and hold the bf16 copies through the update (2.66 GiB per chip at
    Qwen2.5-7B); the update's compiler options turn that pass off for fp32 stacks (bf16 weights keep
    it: nothing to cast, and it saves them memory elsewhere). The v5p compiler makes these
    copies from a few MiB of weights per chip on (the v5e compiler not at these sizes): two
    layers 1024 wide, MLP 4096."""
    from configs import tiny
    config = tiny.get_config()
    config.model.update(dtype="bfloat16", param_dtype="float32", remat=True)
    config.model.tiny.update(num_layers=2, hidden_size=1024, intermediate_size=4096)
    from logra_jax.rl.update import update_compiler_options
    assert update_compiler_options({"kernel": jax.ShapeDtypeStruct((2, 8, 8), jnp.bfloat16)}) == {}
    assert _whole_stack_casts(config, monkeypatch, tmp_path / "ours") == []
    assert _whole_stack_casts(config, monkeypatch, tmp_path / "pass_on", options={})   # it can fail
