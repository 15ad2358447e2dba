#!/usr/bin/env bash
# The memory and speed evidence on a real CUDA machine, in one short run (installs nothing).
#
#   bash launch/gpu_check.sh            # in the repository, with its environment active
#
# 1. Peak device memory after one real LoGRA update and one real AdamW update (a fresh process each,
#    because a device's high-water mark cannot be reset) of CONFIG (default Qwen2.5-1.5B shapes,
#    random weights), next to XLA's ahead-of-time prediction for the same program on the GPU and
#    the CPU-simulated report of launch.memory for the same mesh.
# 2. The step-time comparison LoGRA vs AdamW at widths 512, 1024, 2048 (bf16, median of 5
#    interleaved runs).
# 3. The sampler's tokens/s and achieved/roofline (launch.sampler_bench, bf16, one device, batch
#    1 / 16 / 64; it measures the device's matmul rate and copy bandwidth itself), decoding with
#    the stacked weights (the default off CPU) and per layer (the CPU default), side by side.
# Environment: CONFIG, PYTHON, TIME_ARGS (launch.step_time flags), SAMPLER_ARGS (launch.sampler_bench
# flags, e.g. "--batches 16 --repeats 1"); ALLOW_CPU=1 runs the same
# plumbing on CPU (no peak bytes there).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
CONFIG=${CONFIG:-configs/qwen2_5_1_5b.py}
TIME_ARGS=${TIME_ARGS:---widths 512,1024,2048 --layers 2 --rows 8 --prompt_length 256 --completion_length 768 --repeats 5}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

BACKEND=$($PY -c "import jax; print(jax.default_backend())" 2>/dev/null)
if [[ "$BACKEND" != "gpu" && "${ALLOW_CPU:-0}" != "1" ]]; then
  echo "error: jax sees no CUDA device (backend: $BACKEND); set ALLOW_CPU=1 to run the plumbing on CPU" >&2
  exit 1
fi
NDEV=$($PY -c "import jax; print(jax.device_count())" 2>/dev/null)
export LOGRA_HOST_DEVICES=$NDEV   # the CPU fallback uses as many simulated devices

for opt in logra adamw; do
  $PY -m launch.step_time --config "$CONFIG" --peak_memory --optimizer "$opt" \
      --config.mesh.fsdp=-1 --config.mesh.tensor=1 2>"$OUT/$opt.err" | tail -1 > "$OUT/$opt.json" \
      || { cat "$OUT/$opt.err" >&2; exit 1; }
done
JAX_PLATFORMS=cpu $PY -m launch.memory --config "$CONFIG" --mesh "fsdp=$NDEV,tensor=1" --compare adamw \
    --json "$OUT/aot.json" > "$OUT/aot.txt" 2>"$OUT/aot.err" || { cat "$OUT/aot.err" >&2; exit 1; }
DTYPE=bfloat16; [[ "$BACKEND" == "gpu" ]] || DTYPE=float32
# shellcheck disable=SC2086
$PY -m launch.step_time $TIME_ARGS --dtype "$DTYPE" > "$OUT/time.txt" 2>"$OUT/time.err" \
    || { cat "$OUT/time.err" >&2; exit 1; }

# shellcheck disable=SC2086
$PY -m launch.sampler_bench --dtype "$DTYPE" --meshes 1 --decode_weights stacked,per_layer ${SAMPLER_ARGS:-} > "$OUT/sampler.txt" \
    2>"$OUT/sampler.err" || { cat "$OUT/sampler.err" >&2; exit 1; }

$PY - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
real = {o: json.loads((out / f"{o}.json").read_text()) for o in ("logra", "adamw")}
aot = {s["optimizer"]: s["peak"] for s in json.loads((out / "aot.json").read_text())["steps"]}
gib = lambda n: n / 2**30
r = real["logra"]
print(f"\n{r['model']}: {r['params'] / 1e9:.2f} B params, {r['devices']} {r['backend']} device(s); "
      "peak GiB per device after one update")
print(f"{'optimizer':<10} {'measured':>9} {'XLA on device':>14} {'XLA on CPU':>11}")
for o in ("logra", "adamw"):
    print(f"{o:<10} {gib(real[o]['peak_bytes_in_use']):>9.2f} {gib(real[o]['predicted_peak']):>14.2f} "
          f"{gib(aot[o]):>11.2f}")
ratio = lambda d: d["logra"] / d["adamw"] if d["adamw"] else float("nan")
print(f"{'ratio':<10} {ratio({o: real[o]['peak_bytes_in_use'] for o in real}):>9.3f} "
      f"{ratio({o: real[o]['predicted_peak'] for o in real}):>14.3f} {ratio(aot):>11.3f}\n")
print((out / "time.txt").read_text().strip())
print()
print((out / "sampler.txt").read_text().strip())
EOF
