"""Stage 3 (Pos+g+p): parameters, gradients and optimizer states partitioned over the DP group."""
from functools import partial

import torch

from zero3d.accounting import model_state_bytes, secondary_bytes
from zero3d.buckets import GradientBuckets
from zero3d.comm.core import wait_all
from zero3d.engine import DataParallelEngine, GroupState
from zero3d.flat import flatten_params, group_kind
from zero3d.float8_gather import Float8Group, is_float8_weight
from zero3d.gather import build_units, hook_grads, tensors_in
from zero3d.nvme import file_backed_copy
from zero3d.offload import host_copy

PERSISTENT = "persistent"


class ParameterShardedEngine(DataParallelEngine):
    """Every model state partitioned; parameters gathered one unit (plus prefetch) at a time."""

    stage = 3

    def __init__(self, model, settings, groups):
        self.units = build_units(model, settings.units)
        self._order = None  # unit indices in the first forward's execution order
        self._recording = None
        self._cursor = 0
        self._in_backward = False
        self._live = 0
        self.peak_gathered_elements = 0
        self._fetched = {}  # unit index -> device copies of host shards that its in-flight gathers read
        self._persistent = []  # the replicated groups of small parameters (set by _build_groups)
        self._float8 = {}  # group name -> Float8Group: FP8 linear weights gathered as float8 (zero.fp8_gather)
        super().__init__(model, settings, groups)
        # GPU with overlap: gathers and reductions on a side stream, so they overlap compute.
        self.stream = (torch.cuda.Stream(self.device)
                       if self.device.type == "cuda" and settings.zero.overlap_comm else None)
        self.buckets = GradientBuckets([group for unit in self.units for group in unit.groups], self.plan,
                                       self._deliver_grad_piece, dtype=settings.dtype, device=self.device,
                                       pre_scale=self.pre_scale, held_elsewhere=frozenset(self.tied),
                                       overlap=settings.zero.overlap_comm, stream=self.stream,
                                       position={p: i for i, p in enumerate(model.parameters())})
        # Tied weights (docs/engine.md, "Stage 3"): sharded ones held whole, persistent ones summed in place.
        self._tied_sharded = {p: comm for p, comm in self.tied.items() if p in self.buckets.location}
        self._tied_persistent = {p: comm for p, comm in self.tied.items() if p not in self.buckets.location}
        self._unit_of = {p: unit for unit in self.units for group in unit.groups for p in group.params}
        for p in self._unit_of:
            self.hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))
        for unit in self.units:
            if unit.entry_numel:
                self.hooks += [unit.module.register_forward_pre_hook(partial(self._pre_forward, unit)),
                               unit.module.register_forward_hook(partial(self._post_forward, unit))]
        biggest = max((unit.entry_numel for unit in self.units), default=0)
        # The unit running plus `prefetch_units` ahead (the largest, borrowed units included).
        self.live_budget_elements = (1 + settings.zero.prefetch_units) * biggest

    # ------------------------------------------------------------ layout

    def _build_groups(self, named_groups):
        threshold = self.settings.zero.param_persistence_threshold
        kind_of = {p: kind for kind, named in named_groups.items() for _, p in named}
        name_of = {p: name for name, p in self.model.named_parameters()}
        # Decided before any shard empties its parameters (their numel is 0 after).
        persistent = {kind: [(name, p) for name, p in named if p.numel() <= threshold]
                      for kind, named in named_groups.items()}
        out = {}
        for unit in self.units:
            for kind in named_groups:
                named = [(name_of[p], p) for p in unit.params if kind_of.get(p) == kind and p.numel() > threshold]
                float8 = [self.plan.float8_gather and is_float8_weight(p) for _, p in named]  # in groups of their own
                for suffix, part in (("", [x for x, f in zip(named, float8) if not f]),
                                     ("/float8", [x for x, f in zip(named, float8) if f])):
                    if part:
                        name = f"{unit.name}/{group_kind(*kind)}{suffix}"
                        out[name] = group = self._sharded_group(name, part, *kind)
                        unit.groups.append(group)
                        if suffix:
                            self._float8[name] = Float8Group(group.layout, self.dp.rank)
        for kind, kept in persistent.items():
            if kept:
                name = f"{PERSISTENT}/{group_kind(*kind)}"
                out[name] = group = self._replicated_group(name, kept, *kind)
                self._persistent.append(group)
        return out

    def _sharded_group(self, name, named, decays, matrix=False):
        layout = self._layout(named)
        params = [p for _, p in named]
        group = GroupState(name, layout, params, decays, bucketed=True, grads_per_step=True, matrix=matrix)
        full = flatten_params(layout, params, self.settings.dtype, self.device)
        group.param_flat = layout.shard_of(full, self.dp.rank)
        master = group.param_flat if group.param_flat.dtype == torch.float32 else group.param_flat.float()
        group.master_pieces = ((0, master),)
        group.norm_ranges = self._norm_ranges(layout, flat=False)
        if self.plan.secondary is not None:  # hpZ: this rank's 1/m slice of each gathered bucket, refreshed
            # by every forward gather
            group.secondary = torch.zeros(layout.padded_numel // self.plan.secondary.size, dtype=self.settings.dtype,
                                          device=self.device)
        placement = self.settings.zero.offload_params
        if placement != "none":  # the shard lives on the host or in a file; each gather fetches it
            group.master_pieces = ((0, master.clone() if master is group.param_flat else master),)
            group.param_flat = (host_copy(group.param_flat) if placement == "cpu"
                                else file_backed_copy(group.param_flat, self.settings.zero.nvme_path, self.dp.rank))
        for p in params:
            p.data = self._empty()
        return group

    def _empty(self):
        return torch.empty(0, dtype=self.settings.dtype, device=self.device)

    # ------------------------------------------------------------ gather / release

    def _materialise(self, unit, tag):
        if unit.full is not None or not unit.groups:
            return
        unit.full = []
        for group in unit.groups:
            if group.name in self._float8:  # float8 codes and their scales (zero3d/float8_gather.py)
                full, handles = self._float8[group.name].gather(self.plan, self._device_shard(group, unit.index), tag,
                                                                group.params, self._fetched.setdefault(unit.index, []),
                                                                self.stream)
                unit.handles += handles
                unit.full.append(full)
                continue
            full = torch.empty(group.layout.padded_numel, dtype=self.settings.dtype, device=self.device)
            unit.handles += self._gather_buckets(self._device_shard(group, unit.index), group, full, tag)
            for slot, p in zip(group.layout.slots, group.params):
                p.data = full[slot.start:slot.end].view(slot.shape)
            unit.full.append(full)
        unit.gather_tag = tag
        if not self.settings.zero.overlap_param_gather:
            wait_all(unit.handles)
        self._live += unit.numel
        self.peak_gathered_elements = max(self.peak_gathered_elements, self._live)

    def _gather_buckets(self, shard, group, full, tag) -> list:
        """One all-gather per bucket of the group's shard into `full`, as the plan has it for this phase (hpZ's
        backward gathers from the node's secondary shards; qwZ's quantized); plain ones on the side stream on GPU."""
        def gather_all():
            return [self.plan.gather(full[bucket.start:bucket.end], self._piece(shard, bucket), tag,
                                     secondary=self._secondary(group, bucket) if group.secondary is not None else None)
                    for bucket in group.buckets]
        if self.stream is None or not self.plan.gathers_plainly(tag):
            return gather_all()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            handles = gather_all()
        if any(handle is None for handle in handles):  # ran synchronously (one rank): order the streams
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return handles

    def _secondary(self, group, bucket):
        """The group's secondary shard of `bucket` (hpZ): its local-index slice of the bucket's elements."""
        m = self.plan.secondary.size
        return group.secondary[bucket.start // m:bucket.end // m]

    def _keep_secondary(self, unit):
        """hpZ: after a forward gather, each group's local-index slice of every gathered bucket."""
        m, local = self.plan.secondary.size, self.plan.secondary.rank
        for group, full in zip(unit.groups, unit.full):
            for bucket in group.buckets:
                size = (bucket.end - bucket.start) // m
                self._secondary(group, bucket).copy_(full[bucket.start + local * size:bucket.start + (local + 1) * size])

    @staticmethod
    def _piece(shard, bucket):
        return shard[bucket.shard_start:bucket.shard_start + bucket.piece_numel]

    def _device_shard(self, group, unit_index=None):
        """The group's parameter shard on the device: itself, or (offload_params) a fresh device copy
        of the host one, kept alive with the unit's gathers that read it."""
        if self.settings.zero.offload_params == "none":
            return group.param_flat
        shard = torch.empty(group.param_flat.shape, dtype=group.param_flat.dtype, device=self.device)
        self.copier.to_device(shard, group.param_flat)
        if unit_index is not None:
            self._fetched.setdefault(unit_index, []).append(shard)
        return shard

    def _release(self, unit):
        if unit.full is None:
            return
        wait_all(unit.handles)
        if self.plan.secondary is not None and unit.gather_tag != "params_bwd":
            self._keep_secondary(unit)
        self._fetched.pop(unit.index, None)
        for group in unit.groups:
            for p in group.params:
                p.data = self._empty()
            if group.name in self._float8:
                Float8Group.detach(group.params)
        unit.full = None
        self._live -= unit.numel

    def _tag(self):
        return "params_bwd" if self._in_backward else "params" if self.model.training else "params_eval"

    def _enter(self, unit):
        """Make `unit` (and what it borrows) usable; first queue the gathers of the next units."""
        self.comm_stats.poll()  # a point on the compute timeline: note which collectives are done
        tag = self._tag()
        unit.entered = unit.entered or self._in_backward
        for needed in unit.entry:
            self._materialise(needed, tag)
        self._prefetch(unit, tag)
        for needed in unit.entry:
            wait_all(needed.handles)

    def _sequence(self):
        order = self._order if self._order is not None else [unit.index for unit in self.units]
        order = [i for i in order if self.units[i].entry_numel]
        return order[::-1] if self._in_backward else order

    def _prefetch(self, unit, tag):
        seq = self._sequence()
        if unit.index not in seq:
            return
        start = self._cursor if unit.index in seq[self._cursor:] else 0
        pos = seq.index(unit.index, start)
        self._cursor = pos + 1
        for i in seq[pos + 1:pos + 1 + self.settings.zero.prefetch_units]:
            for needed in self.units[i].entry:
                self._materialise(needed, tag)

    def _release_all(self):
        for unit in self.units:
            self._release(unit)

    def _pre_forward(self, unit, module, args):
        self._enter(unit)
        if self._recording is not None and not self._in_backward:
            self._recording.append(unit.index)
        if unit.borrows and torch.is_grad_enabled():  # borrowed units are freed once the input grad exists
            hook_grads(args, partial(self._release_borrowed, unit))

    def _post_forward(self, unit, module, args, output):
        if self._in_backward:
            return  # a recomputation inside backward: freed as the gradients arrive
        for needed in unit.entry:
            self._release(needed)
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors_in(output)):
            hook_grads(output, partial(self._enter_backward, unit))

    def _enter_backward(self, unit):
        if unit.groups and not unit.pending:
            return  # every gradient of the unit is in already (a second output's hook)
        self._enter(unit)

    def _release_borrowed(self, unit):
        for lender in unit.borrows:
            if not lender.entered:  # else its own backward is running: it frees itself once its grads are in
                self._release(lender)

    # ------------------------------------------------------------ loop-facing interface

    def forward(self, *args, **kwargs):
        self._cursor = 0
        if self._order is None:
            self._recording = []
        try:
            return self.model(*args, **kwargs)
        finally:
            self._release_all()  # prefetched units the forward did not reach
            if self._recording is not None:
                self._order, self._recording = self._recording, None

    __call__ = forward

    def backward(self, loss):
        self._in_backward, self._cursor = True, 0
        for unit in self.units:
            unit.pending, unit.entered = {p for group in unit.groups for p in group.params}, False
        seq = self._sequence()
        for i in seq[:self.settings.zero.prefetch_units]:
            for needed in self.units[i].entry:
                self._materialise(needed, "params_bwd")
        try:
            super().backward(loss)
        finally:
            self._in_backward = False
        self._release_all()

    def finish_backward(self):
        """Tied gradients summed over their group and bucketed; the partly used buckets launched."""
        self.buckets.add_held(self._tied_sharded)
        self.buckets.launch_remaining()

    def gathered_parameters(self) -> dict:
        """Collective: {name: full TP-local tensor} (a copy), for checks and export."""
        out = {}
        for unit in self.units:
            for group in unit.groups:
                full = torch.empty(group.layout.padded_numel, dtype=self.settings.dtype, device=self.device)
                shard = self._device_shard(group)
                for bucket in group.buckets:
                    self.dp.all_gather(full[bucket.start:bucket.end], self._piece(shard, bucket),
                                       tag="params_inspect")
                for slot in group.layout.slots:
                    out[slot.name] = full[slot.start:slot.end].view(slot.shape).clone()
        for group in self._persistent:
            for slot, p in zip(group.layout.slots, group.params):
                out[slot.name] = p.detach().clone()
        return {name: out[name] for name, _ in self.model.named_parameters() if name in out}

    # ------------------------------------------------------------ backward-time reduction

    def _on_grad_ready(self, param):
        unit = self._unit_of[param]
        if unit.full is None:
            raise RuntimeError("a gradient arrived outside its unit's backward "
                               "(a parameter used in two separate backward passes?)")
        if param in self.tied:  # held whole until summed over its group (finish_backward)
            self.buckets.hold(param)
        else:
            self.buckets.add(param)
        unit.pending.discard(param)
        if not unit.pending:
            self._release(unit)

    # ------------------------------------------------------------ step

    def _reduce_grads(self):
        self.buckets.wait()
        self._all_reduce_shards_across_nodes([group for unit in self.units for group in unit.groups])
        self._sum_tied_grads(self._tied_persistent)
        self._all_reduce_replicated(self._persistent)

    def _publish_params(self):
        # Shards only: the next forward gathers them. An offloaded placement has written them already.
        if self.placement.writes_params:
            return
        for group in self.groups.values():
            master = group.master_pieces[0][1]
            if master.untyped_storage() is not group.param_flat.untyped_storage():
                group.param_flat.copy_(master)

    def _state_bytes(self):
        """Model states kept between steps; "persistent_*" are the replicated small parameters."""
        sharded = [group for unit in self.units for group in unit.groups]
        out = model_state_bytes(sharded, self.optimizer)
        out.update({"persistent_" + k: v for k, v in model_state_bytes(self._persistent, self.optimizer).items()})
        if self.plan.secondary is not None:
            out["secondary_params"] = secondary_bytes(sharded)
        return out
