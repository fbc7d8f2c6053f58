"""ZeRO's communication modes (hpZ, hybrid, qwZ, qgZ) under one vocabulary: their config keys, their names, their stages."""
from dataclasses import dataclass
from typing import Optional

# A mode's short name, in the order names join ("qwZ+hpZ+qgZ"); one mode alone is "+" + its name.
ORDER = ("qwZ", "hpZ", "qgZ", "hybrid")
# The lowest ZeRO stage that runs each: hpZ and qwZ act on stage 3's parameter gathers, qgZ on the
# bucketed gradient reduction (stages 2, 3), hybrid on any sharding.
MIN_STAGE = {"qwZ": 3, "hpZ": 3, "qgZ": 2, "hybrid": 1}
# The combinations the analysis models at each stage ("" = plain ZeRO), by name.
ANALYSED = ("", "+hpZ", "+hybrid", "+qwZ", "+qgZ", "qwZ+hpZ+qgZ")
QGZ_BITS = 4  # qgZ as the analysis models it (the paper's int4 gradients); the engine also runs int8
QWZ_BITS = 8


@dataclass(frozen=True)
class CommModes:
    """Which of ZeRO's node-aware communication modes are on, whatever names them (a config's
    zero.* keys, the analysis's "+hpZ", the planner's choice)."""

    secondary_partition: bool = False  # hpZ: a node-local secondary copy of the parameters for backward gathers
    hybrid: bool = False  # states sharded inside the node, replicated across nodes
    weight_bits: Optional[int] = None  # qwZ: parameter gathers quantized to this many bits (8)
    grad_bits: Optional[int] = None  # qgZ: the bucket reduction quantized to this many bits (8 or 4)

    @classmethod
    def from_zero(cls, zero) -> "CommModes":
        """From a ZeroConfig's keys (zero.secondary_partition, hybrid, quantize_weights, quantize_gradients)."""
        bits = {"none": None, "int8": 8, "int4": 4}
        return cls(secondary_partition=zero.secondary_partition == "node", hybrid=zero.hybrid == "node",
                   weight_bits=bits[zero.quantize_weights], grad_bits=bits[zero.quantize_gradients])

    @classmethod
    def named(cls, name: str) -> "CommModes":
        """From a name as `name` writes it ("" plain, "+hpZ", "qwZ+hpZ+qgZ", ...)."""
        parts = [p for p in name.split("+") if p]
        unknown = [p for p in parts if p not in ORDER]
        if unknown or len(set(parts)) != len(parts):
            raise ValueError(f"mode {name!r} is invalid; valid: {', '.join(repr(n) for n in ANALYSED)} "
                             f"(modes {', '.join(ORDER)} joined by '+')")
        return cls(secondary_partition="hpZ" in parts, hybrid="hybrid" in parts,
                   weight_bits=QWZ_BITS if "qwZ" in parts else None, grad_bits=QGZ_BITS if "qgZ" in parts else None)

    @property
    def parts(self) -> tuple:
        on = {"qwZ": self.weight_bits is not None, "hpZ": self.secondary_partition,
              "qgZ": self.grad_bits is not None, "hybrid": self.hybrid}
        return tuple(p for p in ORDER if on[p])

    @property
    def name(self) -> str:
        """"" (plain), "+hpZ" for one mode, "qwZ+hpZ+qgZ" for several."""
        parts = self.parts
        return "+" + parts[0] if len(parts) == 1 else "+".join(parts)

    @property
    def node_aware(self) -> bool:
        """Any mode on: the engine needs the DP group's node topology."""
        return bool(self.parts)

    @property
    def needs_two_per_node(self) -> bool:
        """hpZ and hybrid split the node: they need >= 2 DP ranks on it."""
        return self.secondary_partition or self.hybrid

    @property
    def min_stage(self) -> int:
        return max((MIN_STAGE[p] for p in self.parts), default=0)

    def node_layout_error(self, per_node: int, gpus_per_node: int) -> str:
        """Why these modes cannot run with `per_node` DP ranks per node ("" when they can)."""
        if per_node >= 2 or not self.needs_two_per_node:
            return ""
        return (f"zero.hybrid / zero.secondary_partition = 'node' need >= 2 DP ranks per node; this layout has "
                f"{per_node} (cluster.gpus_per_node = {gpus_per_node}, after tensor parallelism's share): use "
                "zero.hybrid = zero.secondary_partition = 'none'")

    def zero_keys(self) -> dict:
        """The ZeroConfig keys that switch these modes on."""
        return {"secondary_partition": "node" if self.secondary_partition else "none",
                "hybrid": "node" if self.hybrid else "none",
                "quantize_weights": f"int{self.weight_bits}" if self.weight_bits else "none",
                "quantize_gradients": f"int{self.grad_bits}" if self.grad_bits else "none"}


def stage_modes(stage: int) -> tuple:
    """The analysed mode names that run at ZeRO `stage`."""
    return tuple(name for name in ANALYSED if CommModes.named(name).min_stage <= stage)
