"""Forked local gloo ranks for the dist tier, with megatron imported first so every fork inherits it."""
# Forking a parent that imported megatron costs ~0.2 s a rank; spawning ranks that import it, ~10 s.
import megatron.core  # noqa: F401
import megatron.core.models.gpt  # noqa: F401

from local_ranks import free_port, run_ranks  # noqa: F401
