"""megatron's process groups on gloo: one group per set of ranks, and all of them ended when a layout is rebuilt."""
import contextlib

import torch.distributed as dist


@contextlib.contextmanager
def one_gloo_group_per_rank_set():
    """Group construction only (`initialize_model_parallel` on gloo): megatron builds ~17 groups a rank, most
    with the same ranks as another (data parallel with and without context parallel, tensor-and-model,
    every expert group, ...), and gloo gives each a TCP mesh and a thread polling it every 10 ms, which on a
    CPU host of 8 ranks cost 14% of two cores while idle. Here a group asked for with the ranks, backend
    and options of one already built is that group: every rank asks in the same order, so all agree."""
    from megatron.core import parallel_state
    original = parallel_state.create_group
    built = {}

    def create_group(ranks=None, timeout=None, backend=None, pg_options=None, use_local_synchronization=False,
                     group_desc=None):
        if ranks is None or pg_options is not None:
            return original(ranks, timeout, backend, pg_options, use_local_synchronization, group_desc)
        key = (tuple(ranks), timeout, backend, use_local_synchronization)
        if key not in built:
            built[key] = original(ranks, timeout, backend, pg_options, use_local_synchronization, group_desc)
        return built[key]

    parallel_state.create_group = create_group
    try:
        yield
    finally:
        parallel_state.create_group = original


def destroy_megatron_groups() -> None:
    """End every group megatron built, their sockets and polling threads with them; the world group stays.
    megatron's destroy_model_parallel only forgets its groups, and 0.16.1's keeps one of them
    (_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP), so a process building layout after layout held them all."""
    from megatron.core import parallel_state
    groups = {id(g): g for g in parallel_state._global_process_group_list or [] if g is not None}
    parallel_state.destroy_model_parallel()
    parallel_state._INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP = None
    for group in groups.values():
        dist.destroy_process_group(group)
