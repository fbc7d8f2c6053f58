"""The optimizer step's moment: what a rank holds beside its model states while its optimizer steps (the estimator's
`step_bytes`) — stage 1's joined gradient shard, the chunks a mixed-precision step casts to fp32, and, for an optimizer
that takes the hidden matrices whole (Muon), the whole-matrix step's exchange and Newton–Schulz iteration
(zero3d/whole_matrix.py)."""
from fractions import Fraction

from model_shape.gpt import GPTShape
from optim.spec import STEP_CHUNK
from optim.matrix_owners import assign_owners, newton_schulz_cost

FP32 = 4


def gradient_join_bytes(stage: int, ranks: int, bucket_elements, grad_bytes: int, psi: int, vectors: int,
                        matrices=0) -> Fraction:
    """The shard stage 1 joins for its step over more than one rank: a group's pieces of the whole gradient, one a
    bucket, apart in memory, joined into one tensor in their own dtype (zero3d/placement.py: master_grad) where the
    group spans more than one bucket (taken as more than `bucket_elements`; None: one bucket). The groups of Ψ
    (zero3d/flat.py: param_groups): the `vectors` (1-D parameters), the `matrices` the optimizer takes whole, the
    other matrices. Every other layout steps from its shard as it is."""
    if stage != 1 or ranks == 1 or bucket_elements is None:
        return Fraction(0)
    joined = sum(n for n in (vectors, matrices, psi - vectors - matrices) if n > bucket_elements)
    return grad_bytes * Fraction(joined) / ranks


def step_moment_bytes(placement: str, shard, mixed: bool, upcast_states: int, joined=0, matrix=0) -> float:
    """What the step holds beside the model states with the optimizer at `placement` (zero.offload_optimizer) over a
    gradient shard of `shard` elements: `joined` (gradient_join_bytes) and the larger of Muon's whole-matrix step
    (`matrix`) and what it casts to fp32 at once — at most STEP_CHUNK elements (optim/spec.py) of a `mixed`-precision
    gradient (4 bytes each: the norm's blocks, the update's chunks), with the chunk's `upcast_states` bf16 states
    (4 bytes each) where the update runs on the device. No fp32 copy of the whole shard is made. "cpu": the shard
    goes down to the host before the norm; only Muon's exchange stays on the device."""
    if placement == "cpu":
        return float(matrix)
    per_element = FP32 * ((1 if mixed else 0) + (upcast_states if placement == "none" else 0))
    return float(joined + max(per_element * min(Fraction(shard), Fraction(STEP_CHUNK)), Fraction(matrix)))


def hidden_matrices(shape: GPTShape) -> list:
    """(rows, columns) of every layer's 2-D weight at TP 1: what Muon takes whole (optim/muon.py: takes_matrix)."""
    return [dims for name, dims in shape.parameter_shapes().items() if name.startswith("decoder.layers.")
            and len(dims) == 2]


def newton_schulz_elements(rows: int, cols: int) -> int:
    """fp32 elements Newton–Schulz holds at once on one r × c matrix (optim/muon.py: newton_schulz): the normalised
    matrix, the next one, a·X and the product (r·c each), the Gram matrix, its square and their sum (r'² each, r' the
    smaller side)."""
    side = min(rows, cols)
    return 4 * rows * cols + 3 * side * side


def whole_matrix_step_bytes(shape: GPTShape, tp: int, stage: int, ranks: int) -> Fraction:
    """The most fp32 bytes Muon's whole-matrix step holds at once on a rank (zero3d/whole_matrix.py), with M this
    rank's part of every matrix and O the matrices it computes (the elements of the most loaded rank as
    assign_owners deals them out by Newton–Schulz's work; TP-local elements):
    - the gather, the transform and the reverse exchange each hold two of those copies at a time: 8·max(M, O) bytes;
    - at TP > 1 the transform also holds the TP group's shards of its matrices, (1 + tp)·O, beside the outputs, and
      the whole matrix being transformed;
    - Newton–Schulz on the largest matrix the rank computes, beside the directions not yet transformed (O).
    Stage 0 over more than one rank (each holds every matrix and computes it): M = O = all of them; at TP 1 the
    directions, views of the pieces, are all held until the last is transformed (2·O beside Newton–Schulz)."""
    matrices = hidden_matrices(shape)
    local = [rows * cols // tp for rows, cols in matrices]
    replicated = stage == 0 and ranks > 1  # zero3d/whole_matrix.py: replicated
    if replicated:
        mine, computed = Fraction(sum(local)), list(range(len(matrices)))
        most = mine
    else:
        owners = assign_owners([newton_schulz_cost(rows, cols) for rows, cols in matrices], ranks)
        load = [0] * ranks
        for owner, n in zip(owners, local):
            load[owner] += n
        busiest = max(range(ranks), key=lambda r: (load[r], -r))
        computed = [i for i, owner in enumerate(owners) if owner == busiest]
        mine, most = Fraction(sum(local), ranks), Fraction(load[busiest])
    largest = max((matrices[i] for i in computed), key=lambda dims: dims[0] * dims[1], default=(0, 0))
    exchange = 2 * max(mine, most)
    transform = ((2 if replicated and tp == 1 else 1) * most + newton_schulz_elements(*largest)
                 + ((1 + tp) * most + largest[0] * largest[1] if tp > 1 else 0))
    return FP32 * max(exchange, transform)
