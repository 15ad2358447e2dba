"""The TPU compiler's update keeps fp32 weight stacks whole: cast to bf16 one layer at a time.

In a file of its own so that the test runner can give its compiles to the other worker than
test_tpu_compile.py's.
"""

import re

import jax
import jax.numpy as jnp
import pytest

from logra_jax.perf import machines

pytestmark = pytest.mark.skipif(machines.libtpu_version() is None,
                                reason="libtpu (the 'tpu' extra) is not installed: no TPU compiler")
TARGET = "v5p-8"   # the v5p compiler makes the copies from a few MiB per chip on (v5e's not yet)


def _whole_stack_casts(hlo_text: str, layers: int) -> list[str]:
    """bf16 casts of whole [layers, in, out] fp32 entry parameters in an optimized TPU program."""
    return re.findall(rf"bf16\[{layers},\d+,\d+\]\S* convert\(%param[.\d]*\)", hlo_text)


def test_the_update_options_turn_the_pass_off_for_fp32_stacks_only():
    """For bf16 weights the options are empty: nothing to cast, and the bfloat16-propagation pass
    saves them memory elsewhere (0.42 GiB of Llama-3.1-70B's update on v6e-8)."""
    from logra_jax.rl.update import update_compiler_options
    fp32, bf16 = (jax.ShapeDtypeStruct((4, 8, 8), dtype) for dtype in (jnp.float32, jnp.bfloat16))
    assert update_compiler_options({"kernel": bf16}) == {}
    assert update_compiler_options({"kernel": fp32}) == {"xla_disable_hlo_passes": "bfloat16-propagation"}


def test_our_fp32_update_casts_each_layer_as_the_scan_reaches_it(tmp_path, monkeypatch):
    """Our update, fp32 master weights under bf16 compute, compiled for the TPU with its own
    options: no whole-stack casts. The same update compiled without them (the control) has them:
    the bfloat16-propagation pass sees the layer scan read each fp32 stack only through bf16 casts
    and casts the whole stack once before the loops, a bf16 copy held through the update (2.66 GiB
    per chip at Qwen2.5-7B). Two layers 1024 wide, MLP 4096: the copies start at a few MiB per chip."""
    from configs import tiny
    from logra_jax.perf import memory
    from logra_jax.rl import update as update_lib
    from logra_jax.rl.build import build_mesh
    config = tiny.get_config()
    config.model.update(dtype="bfloat16", param_dtype="float32", remat=True)
    config.model.tiny.update(num_layers=2, hidden_size=1024, intermediate_size=4096)
    target = machines.machine(TARGET)
    mesh = build_mesh({"fsdp": target.devices, "tensor": 1}, target.jax_devices())

    def optimized_update(dump_dir):
        memory.update_step_memory(config, mesh, micro_steps=1, dump_dir=dump_dir)
        return next(dump_dir.glob("*_step_impl*after_optimizations.txt")).read_text()
    text = optimized_update(tmp_path / "ours")
    assert re.search(r"f32\[2,\d+,\d+\]\S* parameter\(", text)   # the fp32 stacks are there
    assert _whole_stack_casts(text, layers=2) == []
    monkeypatch.setattr(update_lib, "update_compiler_options", lambda params: {})
    assert _whole_stack_casts(optimized_update(tmp_path / "control"), layers=2)
