"""The hardware `plan --hardware NAME` predicts on: the table shipped beside this file
(hardware.yaml; names and aliases case-insensitive) or a user's own (`--hardware-file F`,
the same fields; its entries are added to the shipped ones and win on a name). Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from ..errors import RecipeError

TABLE = Path(__file__).with_name("hardware.yaml")
FIELDS = (
    "bf16_tflops",
    "fp8_tflops",
    "hbm_gbps",
    "hbm_gb",
    "intra_node_gbps",
    "gpus_per_node",
    "inter_node_gbps",
    "collective_latency_us",
    "attention_fraction",
)
OPTIONAL = (
    "fp32_tflops",
    "fp32_attention_fraction",
    "cores_per_node",
    "op_overhead_us",
    "tp_linear_us",
    "collective_cpu_us",
    "fsdp_unit_us",
    "dtensor_param_us",
    "dtensor_collective_us",
    "dtensor_grad_us",
    "shared_core_factor",
    "shared_collective_cpu_us",
    "shared_idle",
    "collective_wake_us",
    "collective_wake_cpu_us",
    "layer_host_us",
    "outer_host_us",
)

STEP_MODELS = ("log2", "ring")  # collective_steps' values (Hardware.collective_steps)


@dataclass(frozen=True)
class Hardware:
    """One device kind, in the units the table uses (see hardware.yaml's header)."""

    name: str
    bf16_tflops: float
    fp8_tflops: float
    hbm_gbps: float
    hbm_gb: float
    intra_node_gbps: float
    gpus_per_node: int
    inter_node_gbps: float
    collective_latency_us: float
    attention_fraction: float
    # CPU: the fp32 matmul peak and the share of it the attention kernel reaches in fp32 (CPU training's
    # dtype; a CPU without native bf16 GEMMs runs bf16 many times slower). 0: fp32 at bf16's figures
    fp32_tflops: float = 0.0
    fp32_attention_fraction: float = 0.0
    cores_per_node: int = 0  # CPU: the node's ranks share these cores (0: one device per rank)
    op_overhead_us: float = 0.0  # CPU: eager dispatch of one op with its backward (GPUs: hidden, the host runs ahead)
    tp_linear_us: float = 0.0  # CPU: the host cost a tp-sharded linear adds, forward with backward (DTensor)
    collective_cpu_us: float = 0.0  # CPU: the core time one collective step costs each member (loopback send + receive)
    fsdp_unit_us: float = 0.0  # CPU: FSDP2's hooks per unit and microbatch, forward with backward
    dtensor_param_us: float = 0.0  # CPU: what AdamW's step adds per DTensor parameter (FSDP or tp)
    dtensor_collective_us: float = 0.0  # CPU: the host time a collective issued by DTensor (tp) adds, per call
    dtensor_grad_us: float = 0.0  # CPU: a step's gradient bookkeeping (norm, clip, placements) per DTensor parameter
    # CPU: 8 x cores processes taking turns on the cores (hardware_probe's shared_cores): eager work's core
    # time over its time with a core of its own, a collective step's core time (collective_cpu_us's
    # stand-in there), and the share of the cores left idle (every process blocked)
    shared_core_factor: float = 1.0
    shared_collective_cpu_us: float = 0.0
    shared_idle: float = 0.0
    # CPU: what one call adds, beyond its steps, where the trainer issues it -- between eager work, with
    # a core per rank: gloo's threads and the waiting one woken again (back to back they never sleep);
    # its wall, and its core (kept at every ranks-per-core share: the trainer's ranks taking turns on the
    # cores pay it too, each woken thread switched in cold)
    collective_wake_us: float = 0.0
    collective_wake_cpu_us: float = 0.0
    # CPU: the host time of one eager decoder layer, forward with backward, and of the embedding, final
    # norm, head and loss, at a shape whose compute is nil (0: LAYER_OPS / OUTER_OPS x op_overhead_us)
    layer_host_us: float = 0.0
    outer_host_us: float = 0.0
    # how many steps (each collective_latency_us, and on a CPU collective_cpu_us of core) one call takes
    # in a group of n: "log2" ceil(log2 n) (NCCL's trees and rings at their latency); "ring" gloo's
    # algorithms: an all-reduce 2 (n - 1) steps, an all-gather or all-to-all n - 1, and a reduce-scatter
    # run as an all-reduce of its whole input (torch's gloo backend has no reduce-scatter of its own)
    collective_steps: str = "log2"
    source: str = ""


def _entry(name: str, raw, where: str) -> Hardware:
    """One table entry, checked: every field present and a positive number."""
    if not isinstance(raw, dict):
        raise RecipeError(f"{where}: hardware {name!r} must be a mapping of {', '.join(FIELDS)}")
    missing = [f for f in FIELDS if f not in raw]
    if missing:
        raise RecipeError(
            f"{where}: hardware {name!r} lacks {', '.join(missing)}; every entry gives {', '.join(FIELDS)}"
        )
    values = {}
    for f in (*FIELDS, *OPTIONAL):
        if f not in raw:
            continue
        v = raw[f]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise RecipeError(f"{where}: hardware {name!r} field {f}: {v!r} must be a positive number")
        values[f] = v
    if values.get("shared_idle", 0) >= 1:
        raise RecipeError(f"{where}: hardware {name!r} field shared_idle: {values['shared_idle']!r} must be below 1")
    values["gpus_per_node"] = int(values["gpus_per_node"])
    steps = raw.get("collective_steps", "log2")
    if steps not in STEP_MODELS:
        raise RecipeError(
            f"{where}: hardware {name!r} field collective_steps: {steps!r}; valid: {', '.join(STEP_MODELS)}"
        )
    return Hardware(name=name, source=str(raw.get("source", "")), collective_steps=steps, **values)


def _read(path: Path, where: str) -> dict[str, tuple[Hardware, list[str]]]:
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as e:
        raise RecipeError(f"{where}: cannot read it ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise RecipeError(f"{where}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(raw, dict) or not raw:
        raise RecipeError(f"{where}: must be a mapping from hardware name to its fields")
    out = {}
    for name, entry in raw.items():
        aliases = entry.get("aliases", []) if isinstance(entry, dict) else []
        out[str(name).lower()] = (_entry(str(name), entry, where), [str(a).lower() for a in aliases])
    return out


def table(hardware_file: str | None = None) -> dict[str, Hardware]:
    """Every known name (aliases too, lower case) -> its Hardware."""
    entries = _read(TABLE, "hardware.yaml")
    if hardware_file is not None:
        entries |= _read(Path(hardware_file), f"--hardware-file {hardware_file}")
    out = {}
    for name, (hw, aliases) in entries.items():
        out[name] = hw
        out |= {a: hw for a in aliases}
    return out


def lookup(name: str, hardware_file: str | None = None) -> Hardware:
    """The entry called `name` (case-insensitive), or one error line listing the known names."""
    known = table(hardware_file)
    if name.lower() not in known:
        names = sorted({hw.name for hw in known.values()})
        raise RecipeError(f"plan --hardware {name}: not known; valid: {', '.join(names)} (or --hardware-file F)")
    return known[name.lower()]


def check_nodes(nodes: int | None, world: int, hw: Hardware) -> int:
    """The node count: `--nodes N` (must divide the world size), else the fewest nodes of
    `gpus_per_node` that hold the world."""
    if nodes is None:
        return -(-world // hw.gpus_per_node)
    if nodes < 1 or world % nodes:
        raise RecipeError(f"plan --nodes {nodes}: must be a positive divisor of the world size {world}")
    return nodes
