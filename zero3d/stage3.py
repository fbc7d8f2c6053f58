"""Stage 3 (Pos+g+p): parameters, gradients and optimizer states partitioned over the DP group.

Layout: one FlatLayout per (gather unit, decay class) — see zero3d/gather.py for the units — so a
unit is materialised by one all-gather of its own padded buffer per decay class; each rank keeps
only its contiguous shard of each: model-dtype parameters, model-dtype gradients, the fp32 master
(the parameter shard itself when the model is fp32, else an fp32 copy) and Adam's moments. The optimizer sees one master shard
per group. Outside a unit's forward/backward its parameters hold no storage (`p.data` is empty).

Forward: a module pre-hook gathers the unit (tag "params"), first issuing the all-gathers of the
next `prefetch_units` units so they overlap this unit's compute; a post-hook frees it. The order is
the one recorded on the first forward (so any execution order is followed, including modules run
out of definition order); until then, module-definition order. Eval forwards gather the same way
(tag "params_eval") and free everything when done.

Backward: a gradient hook on the unit's outputs re-gathers it (tag "params_bwd") just before its
backward runs, prefetching the next units in reverse recorded order; with full recomputation the
pre-hook of the recomputed forward does it instead and the unit stays gathered through the
recompute's backward. Each parameter's gradient is added into a staging bucket of the unit's
padded buffer by a post-accumulate-grad hook and freed; a full bucket (CB) is reduced to its owners
(tag "grads", sum then ÷N_d, as in stages 0-2) and added into the gradient shard, so accumulation
over micro-batches just adds. Once every owned gradient has arrived, the unit is freed.
Per step (no accumulation, no recompute) that is Ψ forward + Ψ backward + Ψ gradients = 3Ψ(N_d−1)/N_d
elements, Ψ counted over the padded buffers.

Tied weights: a unit that uses another unit's parameter (megatron's output layer handed the word
embeddings when `share_embeddings_and_output_weights`, PP = 1) borrows that unit: it is gathered
with it in forward and backward (in backward freed once the borrower's input gradient exists,
unless the lender's own backward has begun), at the cost of one more gather of the lender each way.

Persistence: a parameter with numel <= `param_persistence_threshold` is never sharded: it stays
whole on every rank and is replicated like stage 0 (full gradient all-reduced and averaged, full
fp32 master and Adam states), in groups "persistent/<decay class>" (state_bytes "persistent_*").

Pipeline parallelism is not supported (the config requires parallel.pipeline = 1).
"""
from functools import partial

import torch

from zero3d.buckets import GradientBuckets
from zero3d.engine import DataParallelEngine, GroupState, wait_all
from zero3d.flat import FlatLayout, flatten_params
from zero3d.gather import build_units, hook_grads, tensors_in
from zero3d.stage0 import replicated_group

PERSISTENT = "persistent"


class ParameterShardedEngine(DataParallelEngine):
    """Every model state partitioned; parameters gathered one unit (plus prefetch) at a time."""

    stage = 3

    def __init__(self, model, settings, groups):
        if groups.tied:
            raise ValueError("ZeRO stage 3 does not support gradients summed over another group (weights "
                             "tied across pipeline stages, sequence-parallel layer norms); use zero.stage <= 2")
        self.units = build_units(model)
        self._order = None  # unit indices in the first forward's execution order
        self._recording = None
        self._cursor = 0
        self._in_backward = False
        self._live = 0
        self.peak_gathered_elements = 0
        super().__init__(model, settings, groups)
        self.buckets = GradientBuckets(self, [g for u in self.units for g in u.groups],
                                       overlap=settings.overlap_comm)
        self._unit_of = {p: u for u in self.units for g in u.groups for p in g.params}
        for p in self._unit_of:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
        for u in self.units:
            if u.entry_numel:
                u.module.register_forward_pre_hook(partial(self._pre_forward, u))
                u.module.register_forward_hook(partial(self._post_forward, u))
        biggest = max((u.entry_numel for u in self.units), default=0)
        # The unit running plus `prefetch_units` ahead (the largest, borrowed units included).
        self.live_budget_elements = (1 + settings.prefetch_units) * biggest

    # ------------------------------------------------------------ layout

    def _build_groups(self, named_groups):
        threshold = self.settings.param_persistence_threshold
        decay_of = {p: decay for decay, named in named_groups.items() for _, p in named}
        name_of = {p: n for n, p in self.model.named_parameters()}
        persistent = {decay: [(n, p) for n, p in named if p.numel() <= threshold]
                      for decay, named in named_groups.items()}
        out = {}
        for u in self.units:
            for decay in named_groups:
                named = [(name_of[p], p) for p in u.params if decay_of.get(p) == decay and p.numel() > threshold]
                if named:
                    out[f"{u.name}/{decay}"] = g = self._sharded_group(f"{u.name}/{decay}", named)
                    u.groups.append(g)
        for decay, kept in persistent.items():
            if kept:
                out[f"{PERSISTENT}/{decay}"] = replicated_group(self, f"{PERSISTENT}/{decay}", kept)
        return out

    def _sharded_group(self, name, named):
        layout = FlatLayout(named, self.dp.size)
        params = [p for _, p in named]
        g = GroupState(name, layout, params, buckets=tuple(layout.buckets(self.settings.bucket_elements)))
        full = flatten_params(layout, params, self.settings.dtype, self.device)
        s0, s1 = layout.shard_range(self.dp.rank)
        g.param_flat = full[s0:s1].clone()
        g.grads = torch.zeros(layout.shard_numel, dtype=self.settings.dtype, device=self.device)
        g.master = g.param_flat if g.param_flat.dtype == torch.float32 else g.param_flat.float()
        g.norm_ranges = self._norm_ranges(layout, offset=0)
        for p in params:
            p.data = self._empty()
        return g

    def _persistent_groups(self):
        return [g for name, g in self.groups.items() if name.startswith(PERSISTENT + "/")]

    def _empty(self):
        return torch.empty(0, dtype=self.settings.dtype, device=self.device)

    # ------------------------------------------------------------ gather / release

    def _materialise(self, unit, tag):
        if unit.full is not None or not unit.groups:
            return
        unit.full = []
        for g in unit.groups:
            full = torch.empty(g.layout.padded_numel, dtype=self.settings.dtype, device=self.device)
            unit.handles.append(self.dp.all_gather(full, g.param_flat, tag=tag, async_op=True))
            for slot, p in zip(g.layout.slots, g.params):
                p.data = full[slot.start:slot.end].view(slot.shape)
            unit.full.append(full)
        self._live += unit.numel
        self.peak_gathered_elements = max(self.peak_gathered_elements, self._live)

    def _release(self, unit):
        if unit.full is None:
            return
        wait_all(unit.handles)
        for g in unit.groups:
            for p in g.params:
                p.data = self._empty()
        unit.full = None
        self._live -= unit.numel

    def _tag(self):
        return "params_bwd" if self._in_backward else "params" if self.model.training else "params_eval"

    def _enter(self, unit):
        """Make `unit` (and what it borrows) usable; first queue the gathers of the next units."""
        tag = self._tag()
        unit.entered = unit.entered or self._in_backward
        for u in unit.entry:
            self._materialise(u, tag)
        self._prefetch(unit, tag)
        for u in unit.entry:
            wait_all(u.handles)

    def _sequence(self):
        order = self._order if self._order is not None else [u.index for u in self.units]
        order = [i for i in order if self.units[i].entry_numel]
        return order[::-1] if self._in_backward else order

    def _prefetch(self, unit, tag):
        seq = self._sequence()
        if unit.index not in seq:
            return
        start = self._cursor if unit.index in seq[self._cursor:] else 0
        pos = seq.index(unit.index, start)
        self._cursor = pos + 1
        for i in seq[pos + 1:pos + 1 + self.settings.prefetch_units]:
            for u in self.units[i].entry:
                self._materialise(u, tag)

    def _release_all(self):
        for u in self.units:
            self._release(u)

    def _pre_forward(self, unit, module, args):
        self._enter(unit)
        if self._recording is not None and not self._in_backward:
            self._recording.append(unit.index)
        if unit.borrows and torch.is_grad_enabled():  # borrowed units are freed once the input grad exists
            hook_grads(args, partial(self._release_borrowed, unit))

    def _post_forward(self, unit, module, args, output):
        if self._in_backward:
            return  # a recomputation inside backward: freed as the gradients arrive
        for u in unit.entry:
            self._release(u)
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors_in(output)):
            hook_grads(output, partial(self._enter_backward, unit))

    def _enter_backward(self, unit):
        if unit.groups and not unit.pending:
            return  # every gradient of the unit is in already (a second output's hook)
        self._enter(unit)

    def _release_borrowed(self, unit):
        for u in unit.borrows:
            if not u.entered:  # else its own backward is running: it frees itself once its grads are in
                self._release(u)

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
        for u in self.units:
            u.pending, u.entered = {p for g in u.groups for p in g.params}, False
        seq = self._sequence()
        for i in seq[:self.settings.prefetch_units]:
            for u in self.units[i].entry:
                self._materialise(u, "params_bwd")
        try:
            super().backward(loss)
        finally:
            self._in_backward = False
        self.buckets.flush()
        self._release_all()

    def gathered_parameters(self) -> dict:
        """Collective: {name: full TP-local tensor} (a copy), for checks and export."""
        out = {}
        for u in self.units:
            for g in u.groups:
                full = torch.empty(g.layout.padded_numel, dtype=self.settings.dtype, device=self.device)
                self.dp.all_gather(full, g.param_flat, tag="params_inspect")
                for slot in g.layout.slots:
                    out[slot.name] = full[slot.start:slot.end].view(slot.shape).clone()
        for g in self._persistent_groups():
            for slot, p in zip(g.layout.slots, g.params):
                out[slot.name] = p.detach().clone()
        return {n: out[n] for n, _ in self.model.named_parameters() if n in out}

    # ------------------------------------------------------------ backward-time reduction

    def _on_grad_ready(self, param):
        unit = self._unit_of[param]
        if unit.full is None:
            raise RuntimeError("a gradient arrived outside its unit's backward "
                               "(a parameter used in two separate backward passes?)")
        self.buckets.add(param)
        unit.pending.discard(param)
        if not unit.pending:
            self._release(unit)

    # ------------------------------------------------------------ step

    def _reduce_grads(self):
        persistent = self._persistent_groups()
        wait_all([self.dp.all_reduce(g.grads[b.start:b.end], tag="grads", async_op=True)
                  for g in persistent for b in g.buckets])
        for g in persistent:
            g.grads.div_(self.dp.size)

    def _master_grad(self, g):
        return self._as_fp32(g.grads)

    def _publish_params(self):
        # Shards only: the next forward gathers them.
        for g in self.groups.values():
            if g.master.data_ptr() != g.param_flat.data_ptr():
                g.param_flat.copy_(g.master)

    def zero_grad(self):
        for g in self.groups.values():
            g.grads.zero_()

    def state_bytes(self):
        """Model states kept between steps; "persistent_*" are the replicated small parameters."""
        nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
        out = {}
        sharded = [g for u in self.units for g in u.groups]
        for prefix, groups in (("", sharded), (PERSISTENT + "_", self._persistent_groups())):
            out[prefix + "params"] = sum(nbytes(g.param_flat) for g in groups)
            out[prefix + "grads"] = sum(nbytes(g.grads) for g in groups)
            out[prefix + "master_params"] = sum(nbytes(g.master) for g in groups
                                                if g.master.data_ptr() != g.param_flat.data_ptr())
            out[prefix + "optimizer_states"] = sum(
                nbytes(v) for g in groups for v in self.optimizer.state.get(g.master, {}).values()
                if torch.is_tensor(v) and v.dim() > 0)
        return out
