"""The optimizer step's moment: what a rank holds beside its model states while its optimizer steps (the estimator's
`step_bytes`) — the fp32 gradient a mixed-precision step updates from, and, for an optimizer that takes the hidden
matrices whole (Muon), the whole-matrix step's exchange and Newton–Schulz iteration (zero3d/whole_matrix.py)."""
from fractions import Fraction

from model_shape.gpt import GPTShape
from zero3d.matrix_owners import assign_owners, newton_schulz_cost

FP32 = 4


def gradient_copy_bytes(psi: int, stage: int, ranks: int, master_bytes: int) -> Fraction:
    """The fp32 copy of this rank's gradient in master coordinates that a mixed-precision step updates from
    (zero3d/placement.py: master_grad): 4Ψ/N_d, stage 0's the whole 4Ψ; none in fp32 (`master_bytes` 0), where the
    gradient is its own fp32 copy."""
    return Fraction(psi * master_bytes, ranks if stage >= 1 else 1)


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
