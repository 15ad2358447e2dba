"""`make gpu-check`'s page: the check's result (launch/gpu_check.py: `collect`) as markdown tables.

Peak memory of one update (measured, XLA's prediction on the device, the deviceless XLA:GPU and
XLA:CPU plans, and LoGRA over AdamW for each), update time, the decode kernels against the layers,
the sampler, seconds per RL step, and every part's command, status and seconds. A part that gave no figure shows why ("absent (...)").
"""

from __future__ import annotations

from logra_jax.perf.machines import GIB


def _gib(n) -> str:
    return f"{n / GIB:.2f}" if isinstance(n, (int, float)) else "–"


def memory_rows(result: dict) -> list[str]:
    memory = result.get("memory", {})
    plans = {name: result.get(name) for name in ("plan_gpu", "plan_cpu")}

    on_cpu = (result.get("versions") or {}).get("backend") == "cpu"

    def plan_cell(name, opt):
        plan = plans[name]
        if plan is None and name == "plan_cpu" and on_cpu:
            return "the device's prediction (XLA:CPU)"
        if plan is None:
            return "not run"
        if "absent" in plan:
            return f"absent ({plan['absent']})"
        if opt in plan["peak"]:
            return _gib(plan["peak"][opt])
        if opt in plan["refused"]:   # the compiler's own verdict, keyed by the column's label
            needed = plan["refused"][opt]
            return f"refused: needs {_gib(needed)} GiB" if needed else "refused"
        return "–"

    gpu_target = (plans["plan_gpu"] or {}).get("target") or "XLA:GPU"
    rows = [f"| optimizer | measured peak_bytes_in_use | XLA's prediction on the device | "
            f"deviceless XLA:GPU plan ({gpu_target}) | XLA:CPU plan |", "|---|---|---|---|---|"]
    for opt, m in memory.items():   # the memory part's optimizers, in the order they ran
        if "absent" in m:
            measured = predicted = f"absent ({m['absent']})"
        elif not m.get("fits", True):
            measured = m["message"]
            predicted = _gib(m.get("predicted_peak"))
        else:
            measured = (_gib(m["peak_bytes_in_use"]) if m.get("peak_bytes_in_use") is not None
                        else f"– ({m['backend']} keeps no allocator statistics)")
            predicted = _gib(m.get("predicted_peak"))
        rows.append(f"| {opt} | {measured} | {predicted} | {plan_cell('plan_gpu', opt)} | "
                    f"{plan_cell('plan_cpu', opt)} |")

    def ratio(logra, adamw, adamw_needs):
        """LoGRA's figure over AdamW's; over what AdamW needs (a bound: ≤) where it did not fit."""
        b, bound = (adamw, "") if isinstance(adamw, (int, float)) else (adamw_needs, "≤ ")
        return (f"{bound}{logra / b:.3f}" if isinstance(logra, (int, float))
                and isinstance(b, (int, float)) and b else "–")
    lo, ad = memory.get("logra", {}), memory.get("adamw", {})
    gpu, cpu = plans["plan_gpu"] or {}, plans["plan_cpu"] or {}
    cells = [ratio(lo.get("peak_bytes_in_use"), ad.get("peak_bytes_in_use"), ad.get("needs_bytes")),
             ratio(lo.get("predicted_peak"), ad.get("predicted_peak"), ad.get("needs_bytes")),
             ratio(gpu.get("peak", {}).get("logra"), gpu.get("peak", {}).get("adamw"),
                   gpu.get("refused", {}).get("adamw")),
             ratio(cpu.get("peak", {}).get("logra"), cpu.get("peak", {}).get("adamw"),
                   cpu.get("refused", {}).get("adamw"))]
    rows.append("| logra / adamw | " + " | ".join(cells) + " |")
    return rows


def _heading(title: str, part: dict) -> list[str]:
    """A part's heading, and why it is absent when it wrote no figures."""
    lines = [f"## {title}", ""]
    return lines + [f"absent ({part['absent']})", ""] if "absent" in part else lines


def _table(caption: str, columns, rows) -> list[str]:
    """A caption, then a markdown table of ``rows`` (each a sequence of cells) under ``columns``,
    then a blank line."""
    return ([caption, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows] + [""])


def _rows_section(title: str, part: dict | None, caption, columns, cells, unfinished: str) -> list[str]:
    """A part that writes one JSON row per measurement (`gpu_check.collect`: rows, status, why):
    its heading, a caption drawn from the first row, a table of ``cells(row)`` under ``columns``,
    and why not every row is there when the part did not end well."""
    if not part:
        return []
    lines = [f"## {title}", ""]
    if part["rows"]:
        lines += _table(caption(part["rows"][0]), columns, [cells(r) for r in part["rows"]])[:-1]
    if part["status"] != "ok":
        lines.append(f"\n{unfinished}: {part.get('why', part['status'])}")
    return lines + [""]


def markdown(result: dict, when: str) -> str:
    v = result.get("versions") or {}
    lines = [f"# gpu-check, {when}", ""]
    if v:
        plugins = ", ".join(f"{k} {val}" for k, val in (v.get("cuda_plugins") or {}).items()) or "none"
        lines += [f"Machine: {v['device_count']} × {v['device_kind']} ({v['backend']}), allocator "
                  f"limit {_gib(v.get('bytes_limit'))} GiB, XLA_PYTHON_CLIENT_MEM_FRACTION="
                  f"{v.get('mem_fraction')}; Python {v['python']}, jax {v['jax']}, jaxlib "
                  f"{v['jaxlib']}, flax {v['flax']}, optax {v['optax']}, orbax-checkpoint "
                  f"{v['orbax_checkpoint']}; CUDA plugins: {plugins}.", ""]
    if "memory" in result or "plan_gpu" in result or "plan_cpu" in result:
        m = next((x for x in result.get("memory", {}).values() if "params" in x), {})
        lines += [f"## Peak memory of one update, GiB per device ({m.get('model', 'the config')}, "
                  f"{m['params'] / 1e6:,.1f} M parameters)" if m else
                  "## Peak memory of one update, GiB per device", ""] + memory_rows(result) + [""]
    t = result.get("time")
    if t:
        lines += _heading("Update time, LoGRA vs AdamW", t)
        if "absent" not in t:
            def ratio(w):
                return w["flops"]["logra"] / w["flops"]["adamw"] if w["flops"]["adamw"] else float("nan")
            lines += _table(
                f"{t['layers']} layers, {t['micro_steps']} micro-step(s) of {t['rows']} × "
                f"{t['tokens']} tokens, rank {t['rank']}, vocabulary {t['vocab']}, {t['dtype']}, "
                f"{t['device_kind']}; median of {t['repeats']} interleaved runs",
                ("width", "logra ms", "adamw ms", "time ratio", "paired ratio", "FLOP ratio"),
                [(w["width"], f"{w['ms']['logra']:.1f}", f"{w['ms']['adamw']:.1f}",
                  f"{w['ms']['logra'] / w['ms']['adamw']:.3f}", f"{w['paired']['logra'][0]:.3f}",
                  f"{ratio(w):.3f}") for w in t["widths"]])
    lines += _rows_section(
        "Decode kernels against the layers", result.get("kernels"),
        lambda r0: (f"{r0['shape']} ({r0['layers']} layers, random weights), {r0['steps']} decode "
                    f"steps, {r0['device_kind']}, kernels run by {r0['kernels']}; the largest "
                    f"difference relative to the largest magnitude of the layers' own"),
        ("dtype", "rows", "logits", "cache", "tolerance", "within"),
        lambda r: (r["dtype"], r["rows"], f"{r['logits_rel_diff']:.2e}",
                   f"{r['cache_rel_diff']:.2e}", f"{r['tolerance']:g}",
                   "yes" if r["ok"] else "**no**"),
        "not every row passed or finished")
    lines += _rows_section(
        "Sampler", result.get("sampler"),
        lambda r0: (f"{r0['model']}, {r0['dtype']}, {r0['prompt_length']} + "
                    f"{r0['completion_length']} tokens per row, {r0['device_kind']}; matmul "
                    f"{r0['matmul_flops_per_second'] / 1e9:,.1f} GFLOP/s, copy "
                    f"{r0['copy_bytes_per_second'] / GIB:.1f} GiB/s (measured)"),
        ("batch", "decode", "seconds", "tokens/s", "roofline s", "achieved/roofline"),
        lambda r: (r["batch"], r["decode_weights"], f"{r['seconds']:.3f}",
                   f"{r['tokens_per_second']:.1f}", f"{r['roofline_seconds']:.3f}",
                   f"{r['achieved_over_roofline']:.2f}"),
        "not every cell finished")
    r = result.get("rollout")
    if r:
        lines += _heading("Rollout: the static engine against the slot engine", r)
        if "absent" not in r:
            lines += _table(
                f"{r['model']} ({r['dtype']}), {r['device_kind']}; {r['prompts']} prompts × "
                f"{r['samples']} samples, {r['prompt_length']} + {r['completion_length']} tokens; "
                f"lengths {r['schedule']} ({r['kept_tokens']:,} tokens kept, longest "
                f"{r['longest']}); median of {r['repeats']} calls, engines alternated; same "
                f"tokens: {'yes' if r['same_tokens'] else '**no**'}",
                ("engine", "seconds", "kept tokens/s", "row-steps", "efficiency", "time/static"),
                [(e["engine"], f"{e['seconds']:.2f}", f"{e['kept_tokens_per_second']:,.0f}",
                  e["row_steps"], f"{e['efficiency']:.3f}", f"{e['time_over_static']:.3f}")
                 for e in r["engines"]])
    rl = result.get("rl")
    if rl:
        lines += ["## Seconds per RL step", ""]
        if "absent" in rl:
            lines += [f"absent ({rl['absent']})", ""]
            for row in rl.get("logged_steps", []):   # what the trainer logged before the cut
                lines.append(f"- step {row.get('step')}: " + ", ".join(
                    f"{k.removeprefix('time/')} {v:.2f} s" for k, v in row.items()
                    if k.startswith("time/")))
            lines.append("")
        else:
            lines += [f"{rl['model']}, {rl['optimizer']}: {rl['rows']} rows of "
                      f"{rl['prompt_window']} + ≤ {rl['max_completion_length']} tokens per step, "
                      f"{rl['devices']} × {rl['device_kind']}", "",
                      "| | rollout | reward | reference | update | sync | step | generated tokens/s per device |",
                      "|---|---|---|---|---|---|---|---|"]
            for label, part in (("first step (compiles)", rl["first"]),
                                (f"median of {rl['steps'] - 1} more", rl["steady"])):
                if part:
                    lines.append(f"| {label} | " + " | ".join(
                        f"{part['seconds'][p]:.2f}" for p in
                        ("rollout", "reward", "reference", "update", "sync"))
                        + f" | {part['step_seconds']:.2f} | "
                        f"{part['generated_tokens_per_second_per_device']:.1f} |")
            lines.append("")
    lines += ["## Commands", "", "| part | status | seconds | command |", "|---|---|---|---|"]
    for name, p in result["parts"].items():
        seconds = f"{p['seconds']:.0f}" if p["seconds"] is not None else "–"
        lines.append(f"| {name} | {p['status']} | {seconds} | `{p['command']}` |")
    return "\n".join(lines) + "\n"
