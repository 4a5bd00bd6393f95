"""The text `plan --hardware NAME` prints after the estimate (plan/perf.py's prediction)."""

from __future__ import annotations

TERMS = (
    ("matmul_s", "matmuls"),
    ("attention_s", "attention"),
    ("memory_s", "memory-bound ops"),
    ("host_s", "host (ops, DTensor, FSDP)"),
    ("tp_s", "tp communication (exposed)"),
    ("cp_s", "cp K/V exchange"),
    ("ep_s", "ep all-to-all (exposed)"),
    ("pp_s", "pp sends"),
    ("bubble_s", "pipeline bubble"),
    ("dp_exposed_s", "dp communication (exposed)"),
    ("optimizer_s", "optimizer step"),
    ("shared_cores_s", "waiting for a shared core"),
)


def performance_lines(recipe, perf: dict) -> list[str]:
    """The step's terms (the busiest pp rank), then tokens/s/GPU, MFU and the bound."""
    step = perf["step_time_s"]
    fp8 = ", float8 matmuls" if perf["float8"] else ""
    lines = [
        "",
        f"predicted on {perf['hardware']} ({perf['nodes']} nodes of {perf['gpus_per_node']}{fp8}), "
        "the busiest pipeline rank's step:",
    ]
    for key, name in TERMS:
        s = perf["breakdown_s"][key]
        if s:
            lines.append(f"  {name:<28} {s:10.4g} s  {100 * s / step:5.1f}%")
    if len(perf["stages"]) > 1:
        busy = ", ".join(f"{r['busy_s']:.3g}" for r in perf["stages"])
        lines.append(f"  busy seconds per pp rank: {busy}; bubble {100 * perf['bubble_fraction']:.1f}%")
    lines += [
        f"step {step:.4g} s: {perf['tokens_per_sec_per_gpu']:,.1f} tokens/s/GPU "
        f"({perf['tokens_per_sec']:,.0f} in all), {perf['tflops_per_gpu']:.1f} TFLOP/s/GPU, "
        f"MFU {100 * perf['mfu']:.1f}%",
        f"bound: {perf['bound']} -- {perf['advice']}",
    ]
    return lines
