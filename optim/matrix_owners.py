"""Which DP rank computes each whole matrix of Muon's step: dealt out by Newton–Schulz's work. Below both of its
readers, the engine's whole-matrix step (zero3d/whole_matrix.py) and the estimator (analysis/step_moment.py), and
torch-free, so the estimator deals them out as the engine does."""


def newton_schulz_cost(rows: int, cols: int) -> int:
    """Newton–Schulz's work on a whole rows × cols matrix: its elements × its smaller side."""
    return rows * cols * min(rows, cols)


def assign_owners(costs: list, ranks: int) -> list:
    """Each cost to a rank, largest first, to the least loaded (ties: the lowest rank)."""
    load, owners = [0] * ranks, [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        owners[i] = min(range(ranks), key=lambda r: (load[r], r))
        load[owners[i]] += costs[i]
    return owners
