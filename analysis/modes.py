"""Each communication mode's name, costs and memory terms: the analysis's half of the mode's card, keyed by its name.

The other half (its config key, checks and stages) is zero3d/comm/modes.py, in the engine, which the config and the
engine's CommPlan read; the engine never imports the analysis, so the names the analysis gives modes ("+hpZ",
"qwZ+hpZ+qgZ": `named_modes`, `mode_name`), a mode's collectives' α-β costs and its memory terms, which need the
analysis's arithmetic (analysis/link_collectives.py, analysis/model_states.py), sit here, one class per mode, beside
each other. The α-β model (comm_model.dp_collectives), the estimator (estimate.py) and the --zeropp report ask every
mode on (`mode_costs`, in name order) what it changes of plain ZeRO; `COSTS` registers each card by the name the
engine's half gives it."""
from fractions import Fraction

from analysis.link_collectives import DPPass, LinkCollective, quantized_copy_bytes, ring_collective
from analysis.model_states import ADAMW_FP32, PRECISIONS, OptimizerStates, model_state_bytes
from zero3d.comm.modes import CARDS, CommModes

BY_NAME = {card.name: card for card in CARDS}
# A mode's short name, in the order names join ("qwZ+hpZ+qgZ"); one mode alone is "+" + its name.
ORDER = ("qwZ", "hpZ", "qgZ", "hybrid")
# The combinations the analysis models at each stage ("" = plain ZeRO), by name.
ANALYSED = ("", "+hpZ", "+hybrid", "+qwZ", "+qgZ", "qwZ+hpZ+qgZ")
# A quantizing mode's bits as the analysis models it: the paper's int8 weights and int4 gradients (the engine also
# runs int8 gradients).
ANALYSED_BITS = {"qwZ": 8, "qgZ": 4}
# The modes that split the node, by name ("hpZ / hybrid").
NODE_SPLITTING = " / ".join(card.name for card in CARDS if card.splits_node)


def named_modes(name: str) -> CommModes:
    """The modes a name switches on ("" plain, "+hpZ", "qwZ+hpZ+qgZ", ...), quantizing ones at ANALYSED_BITS."""
    parts = [p for p in name.split("+") if p]
    if any(p not in ORDER for p in parts) or len(set(parts)) != len(parts):
        raise ValueError(f"mode {name!r} is invalid; valid: {', '.join(repr(n) for n in ANALYSED)} "
                         f"(modes {', '.join(ORDER)} joined by '+')")
    return CommModes(**{BY_NAME[p].field: ANALYSED_BITS.get(p, True) for p in parts})


def mode_parts(modes: CommModes) -> tuple:
    """The names of the modes on, in name order."""
    return tuple(p for p in ORDER if BY_NAME[p].on(modes))


def mode_name(modes: CommModes) -> str:
    """"" (plain), "+hpZ" for one mode, "qwZ+hpZ+qgZ" for several."""
    parts = mode_parts(modes)
    return "+" + parts[0] if len(parts) == 1 else "+".join(parts)


def stage_modes(stage: int) -> tuple:
    """The analysed mode names that run at ZeRO `stage`."""
    return tuple(name for name in ANALYSED if named_modes(name).min_stage <= stage)


def zero_keys(modes: CommModes) -> dict:
    """The ZeroConfig keys that switch these modes on."""
    return {card.key: card.key_value(modes) for card in CARDS}


FLOAT8_REFUSED = "float8 gathers run at stage 3 without hpZ or qwZ"


class ModeCosts:
    """What a mode changes of plain ZeRO's DP collectives and memory: by default, nothing. `memory_note`: what the
    --zeropp report's legend says of its extra memory ("" for none)."""

    memory_note = ""

    def wire_note(self, grad_bits: int) -> str:
        """What the --zeropp report's legend says of its wire format ("" for plain), qgZ at `grad_bits`."""
        return ""

    def shard_ranks(self, n: int, m: int) -> int:
        """The ranks the stage's rings run over, of n in the DP group with m per node."""
        return n

    def where(self) -> str:
        """What the stage's collectives' names add (" (node)": inside the node)."""
        return ""

    def grad_reduction(self, p: DPPass, plain: list) -> list:
        """The gradient reduction's collectives, given plain ZeRO's (`plain`)."""
        return plain

    def gather(self, p: DPPass, plain: Fraction, tag: str) -> tuple:
        """(bytes, name tag) of one stage-3 all-gather of Ψ, given plain ZeRO's."""
        return plain, tag

    def backward_gather(self, p: DPPass, plain: LinkCollective) -> LinkCollective:
        """Stage 3's backward all-gathers, given plain ZeRO's."""
        return plain

    def after(self, p: DPPass) -> list:
        """Collectives the mode adds once its stage's are done."""
        return []

    def state_ranks(self, dp: int, per_node: int) -> int:
        """The ranks the model states are sharded over (dp, or the node's `per_node`)."""
        return dp

    def added_param_bytes(self, psi: int, per_node: int, precision: str) -> float:
        """Parameter bytes per GPU the mode keeps besides the stage's shard."""
        return 0.0

    def extra_state_bytes(self, psi: int, dp: int, per_node: int, precision: str, stage: int,
                          optimizer: OptimizerStates) -> float:
        """Per-GPU bytes the mode adds over plain ZeRO `stage`."""
        return 0.0


class HpZ(ModeCosts):
    """hpZ (stage 3): the backward all-gather runs inside the node from the node's secondary shards: AΨb(m−1)/m, all
    intra. Memory: the secondary copy Ψb/m of the parameters (the engine measures the same: zero3d/accounting.py)."""

    memory_note = "hpZ's secondary parameter copy"

    def backward_gather(self, p: DPPass, plain: LinkCollective) -> LinkCollective:
        return ring_collective("all_gather bwd (node, hpZ)", p.full * Fraction(p.m - 1, p.m) * p.a, p.m, p.m,
                               p.a * p.gathers, "params")

    def added_param_bytes(self, psi: int, per_node: int, precision: str) -> float:
        return psi * PRECISIONS[precision].param_bytes / per_node

    def extra_state_bytes(self, psi, dp, per_node, precision, stage, optimizer) -> float:
        return self.added_param_bytes(psi, per_node, precision)


class Hybrid(ModeCosts):
    """+hybrid (stages 1-3): the stage's collectives over the node's m ranks (all intra, ring (m−1)/m), then the Ψ/m
    gradient shard all-reduced across the k nodes once per step: 2(Ψb/m)(k−1)/k, all inter, one call per bucket piece
    (B calls of 2(k−1) steps). Memory: the states sharded over m instead of N ranks, (b_p + b_g + K)Ψ(1/m − 1/N) at
    stage 3, (b_g + K)Ψ(1/m − 1/N) at stage 2, KΨ(1/m − 1/N) at stage 1 (model_state_bytes' shards)."""

    memory_note = "hybrid's node-only sharding"

    def shard_ranks(self, n: int, m: int) -> int:
        return m  # sharded inside the node: every ring of the stage runs over the node's m ranks

    def where(self) -> str:
        return " (node)"

    def after(self, p: DPPass) -> list:
        if p.k == 1:
            return []
        return [LinkCollective("all_reduce (across nodes)", Fraction(0), 2 * p.full / p.m * Fraction(p.k - 1, p.k),
                               p.buckets * 2 * (p.k - 1), p.buckets, "replicas")]

    def state_ranks(self, dp: int, per_node: int) -> int:
        return per_node

    def extra_state_bytes(self, psi, dp, per_node, precision, stage, optimizer) -> float:
        if stage not in (1, 2, 3):
            raise ValueError(f"stage {stage} is invalid for +hybrid; valid: 1, 2, 3 (stage 0 shards nothing)")
        return (sum(float(x) for x in model_state_bytes(psi, stage, per_node, precision, optimizer))
                - sum(float(x) for x in model_state_bytes(psi, stage, dp, precision, optimizer)))


class QwZ(ModeCosts):
    """+qwZ (stage 3): both all-gathers send AΨq_w(N−1)/N (q_w = weight_bits/8 + scale_bytes/block bytes an
    element; with `pieces`, each chunk in whole blocks)."""

    def wire_note(self, grad_bits: int) -> str:
        return "qwZ int8"

    def gather(self, p: DPPass, plain: Fraction, tag: str) -> tuple:
        return quantized_copy_bytes(p.psi, p.pieces, p.n, p.weight_bits, p.block, p.scale_bytes) * p.ring, " (qwZ)"


class QgZ(ModeCosts):
    """+qgZ (stages 2, 3): each reduce-scatter is comm/hierarchical.py's two all-to-alls: inside the node (m−1)
    chunks of Ψ/m·q_g, then across nodes (k−1) chunks of Ψ/N·q_g (m−1 and k−1 steps per bucket), after a one-element
    fp32 all-reduce per bucket over the N ranks (the ranks agree whether any holds a non-finite gradient:
    hierarchical.overflow_safe_quantized_reduce_scatter), its bytes counted as a ring's and its latency as a tree's
    (2·⌈log2 N⌉ steps)."""

    def wire_note(self, grad_bits: int) -> str:
        return f"qgZ int{grad_bits}"

    def grad_reduction(self, p: DPPass, plain: list) -> list:
        # (1) each of the m − 1 local peers gets the k·c elements it owns a slice of, (2) each of the k − 1
        # other nodes' peers gets c (c = a bucket / N): one quantized copy over m, one over N
        n, m, k, a, buckets = p.n, p.m, p.k, p.a, p.buckets
        node_copy = quantized_copy_bytes(p.psi, p.pieces, m, p.grad_bits, p.block, p.scale_bytes)
        rank_copy = quantized_copy_bytes(p.psi, p.pieces, n, p.grad_bits, p.block, p.scale_bytes)
        return [LinkCollective("all_to_all (node, qgZ)", node_copy / m * (m - 1) * a, Fraction(0),
                               a * buckets * (m - 1), a * buckets, "grads"),
                LinkCollective("all_to_all (across nodes, qgZ)", Fraction(0), rank_copy / n * (k - 1) * a,
                               a * buckets * (k - 1), a * buckets, "grads"),
                ring_collective("all_reduce (qgZ overflow flag)", 2 * Fraction(4) * p.ring * a * buckets, n, m,
                                a * buckets, "grads", 2 * max(1, (n - 1).bit_length()))]  # one element: NCCL's tree


COSTS = {"hpZ": HpZ(), "hybrid": Hybrid(), "qwZ": QwZ(), "qgZ": QgZ()}


def mode_costs(modes: CommModes) -> tuple:
    """The cost cards of the modes on, in name order."""
    return tuple(COSTS[name] for name in mode_parts(modes))


def extra_state_bytes(mode: str, psi: int, dp: int, per_node: int, precision: str = "fp16", stage: int = 3,
                      optimizer: OptimizerStates = ADAMW_FP32) -> float:
    """Per-GPU bytes a node-aware mode (comm_model.STAGE_MODES) adds over plain ZeRO `stage`, this formula's
    one home (the engine measures the same: zero3d/accounting.py): hpZ's secondary copy Ψb/m of the
    parameters; hybrid's sharded states over m instead of N ranks, (b_p + b_g + K)Ψ(1/m − 1/N) at stage 3,
    (b_g + K)Ψ(1/m − 1/N) at stage 2, KΨ(1/m − 1/N) at stage 1 (model_state_bytes' shards); the config refuses
    the two together."""
    return sum((costs.extra_state_bytes(psi, dp, per_node, precision, stage, optimizer)
                for costs in mode_costs(named_modes(mode))), 0.0)
