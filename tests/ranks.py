"""Forked local gloo ranks for the dist tier, with megatron imported first so every fork inherits it."""
# Forking a parent that imported megatron costs ~0.2 s a rank; spawning ranks that import it, ~10 s.
import megatron.core  # noqa: F401
import megatron.core.models.gpt  # noqa: F401
# What building a model imports on first use (megatron's layer specs, pretrain's attention, loss and context-parallel
# modules): ~0.05 CPU-s a rank, paid once here instead of in every forked rank.
import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
import pretrain.model.attention  # noqa: F401
import pretrain.model.context  # noqa: F401
import pretrain.model.loss  # noqa: F401

from local_ranks import free_port, run_ranks  # noqa: F401
