"""ZeRO's communication modes (hpZ, hybrid, qwZ, qgZ) as cards, and `CommModes`, the one vocabulary built from them;
the modes' names, costs and memory terms in the analysis are the cards' other half (analysis/modes.py)."""
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class ModeCard:
    """One communication mode: `name` (as the analysis writes it), `key` (its ZeroConfig key) and the key's
    `values` ("none", off, first), `field` (CommModes' field it sets: True, or the bits of a quantizing mode),
    `min_stage` (the lowest ZeRO stage that runs it) and `stage_reason` (why, in the config check's words),
    `splits_node` (it splits the node: >= 2 DP ranks on it), `gathers_own_format` (it gathers the parameters its own
    way: zero.fp8_gather is refused beside it), `quantized` (it quantizes: its values name the bits, "int8"; its
    collectives carry scales, which are data) and `refusals`: (another ZeroConfig key, the message) for each setting
    it cannot run beside, the key's value being "none" where it can."""

    name: str
    key: str
    values: tuple
    field: str
    min_stage: int
    stage_reason: str
    splits_node: bool = False
    gathers_own_format: bool = False
    quantized: bool = False
    refusals: tuple = ()

    def setting(self, value: str):
        """CommModes' field value for the config key's `value`: None / False off; the bits or True on."""
        if self.quantized:
            return None if value == "none" else int(value.removeprefix("int"))
        return value == self.values[1]

    def on(self, modes: "CommModes") -> bool:
        return getattr(modes, self.field) not in (None, False)

    def key_value(self, modes: "CommModes") -> str:
        """The config key's value that switches on what `modes` holds of this mode."""
        value = getattr(modes, self.field)
        if not self.on(modes):
            return "none"
        return f"int{value}" if self.quantized else self.values[1]

    def value_check(self, zero) -> tuple:
        """(ok, message): the key's value is one of `values` (ZeroConfig raises the first failing check)."""
        value = getattr(zero, self.key)
        return value in self.values, (f"zero.{self.key} = {value!r} is invalid; valid values: "
                                      f"{', '.join(repr(v) for v in self.values)}")

    def stage_check(self, zero) -> tuple:
        """(ok, message): the mode is off, or zero.stage runs it."""
        value, stages = getattr(zero, self.key), [str(s) for s in range(self.min_stage, 4)]
        stages = ", ".join(stages[:-1]) + " or " + stages[-1] if len(stages) > 1 else stages[0]
        return (value == "none" or zero.stage in range(self.min_stage, 4),
                f"zero.{self.key} = {value!r} needs zero.stage = {stages} ({self.stage_reason}); "
                f"got zero.stage = {zero.stage}")

    def refusal_checks(self, zero, of_modes: bool) -> tuple:
        """(ok, message) of this mode beside each setting it refuses: the other modes' keys (`of_modes`) or the
        rest of zero.*."""
        mode_keys = {card.key for card in CARDS}
        return tuple((getattr(zero, self.key) == "none" or getattr(zero, other) == "none", message.format(z=zero))
                     for other, message in self.refusals if (other in mode_keys) == of_modes)


# The cards, in the order of their ZeroConfig keys.
HPZ = ModeCard("hpZ", "secondary_partition", ("none", "node"), "secondary_partition", 3,
               "only stage 3 gathers parameters", splits_node=True, gathers_own_format=True)
HYBRID_REFUSALS = (
    ("secondary_partition", "zero.hybrid = 'node' with zero.secondary_partition = 'node' is refused: hybrid shards "
                            "inside the node already, so its backward all-gather is node-local without a secondary "
                            "partition"),
    ("quantize_gradients", "zero.hybrid = 'node' with zero.quantize_gradients is refused: qgZ's hierarchical "
                           "reduce-scatter spans the nodes, hybrid's reduce-scatter does not"),
    ("offload_optimizer", "zero.hybrid = 'node' with zero.offload_optimizer = {z.offload_optimizer!r} is not "
                          "supported; use one of them"))
HYBRID = ModeCard("hybrid", "hybrid", ("none", "node"), "hybrid", 1, "stage 0 shards nothing", splits_node=True,
                  refusals=HYBRID_REFUSALS)
QWZ = ModeCard("qwZ", "quantize_weights", ("none", "int8"), "weight_bits", 3,
               "only stage 3 gathers parameters each step", gathers_own_format=True, quantized=True)
QGZ = ModeCard("qgZ", "quantize_gradients", ("none", "int8", "int4"), "grad_bits", 2, "the bucket reduce-scatter",
               quantized=True)
CARDS = (HPZ, HYBRID, QWZ, QGZ)
# The keys of every node-aware mode, as the messages of the rules that read them all write them.
NODE_AWARE_KEYS = "zero.secondary_partition / hybrid / quantize_*"
# The keys of the modes that gather in their own formats.
OWN_FORMAT_KEYS = " or ".join(f"zero.{card.key}" for card in CARDS if card.gathers_own_format)


@dataclass(frozen=True)
class CommModes:
    """Which of ZeRO's node-aware communication modes are on, whatever names them (a config's
    zero.* keys, the analysis's "+hpZ": analysis.modes.named_modes, the planner's choice)."""

    secondary_partition: bool = False  # hpZ: a node-local secondary copy of the parameters for backward gathers
    hybrid: bool = False  # states sharded inside the node, replicated across nodes
    weight_bits: Optional[int] = None  # qwZ: parameter gathers quantized to this many bits (8)
    grad_bits: Optional[int] = None  # qgZ: the bucket reduction quantized to this many bits (8 or 4)

    @classmethod
    def from_zero(cls, zero) -> "CommModes":
        """From a ZeroConfig's keys (zero.secondary_partition, hybrid, quantize_weights, quantize_gradients)."""
        return cls(**{card.field: card.setting(getattr(zero, card.key)) for card in CARDS})

    @property
    def cards(self) -> tuple:
        """The cards of the modes on."""
        return tuple(card for card in CARDS if card.on(self))

    @property
    def node_aware(self) -> bool:
        """Any mode on: the engine needs the DP group's node topology."""
        return bool(self.cards)

    @property
    def needs_two_per_node(self) -> bool:
        """hpZ and hybrid split the node: they need >= 2 DP ranks on it."""
        return any(card.splits_node for card in self.cards)

    @property
    def gathers_own_format(self) -> bool:
        """hpZ and qwZ gather the parameters in their own formats: zero.fp8_gather is refused beside them."""
        return any(card.gathers_own_format for card in self.cards)

    @property
    def min_stage(self) -> int:
        return max((card.min_stage for card in self.cards), default=0)

    def node_layout_error(self, per_node: int, gpus_per_node: int) -> str:
        """Why these modes cannot run with `per_node` DP ranks per node ("" when they can)."""
        if per_node >= 2 or not self.needs_two_per_node:
            return ""
        return (f"zero.hybrid / zero.secondary_partition = 'node' need >= 2 DP ranks per node; this layout has "
                f"{per_node} (cluster.gpus_per_node = {gpus_per_node}, after tensor parallelism's share): use "
                "zero.hybrid = zero.secondary_partition = 'none'")


def quantized_settings(zero) -> list:
    """The quantizing modes' keys a ZeroConfig `zero` switches on, as "zero.key = 'value'"."""
    return [f"zero.{card.key} = {getattr(zero, card.key)!r}" for card in CARDS
            if card.quantized and getattr(zero, card.key) != "none"]
