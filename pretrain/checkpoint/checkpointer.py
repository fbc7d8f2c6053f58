"""Checkpoints: each element written once (PyTorch DCP), resharded on load, written in the background.

<save_dir>/step_<N>/ holds DCP's files (`__<rank>_0.distcp`, `.metadata`), one `rng/rank_<r>.json` per
rank and `checkpoint.json` (step, data position, scaler, identity, and the size and SHA-256 of every
file). A save writes into step_<N>.tmp: each rank writes and fsyncs its files (rank 0 then `pending.json`,
checkpoint.json without the file list) and, last, `written/rank_<r>.json` (its files' sizes and hashes). Once every rank's part is written, which the step after it learns in its one
all-reduce, rank 0 writes checkpoint.json, renames the directory and then moves `latest`. A crash before
that leaves a .tmp that start-up publishes when every rank's record is there and its files have their
recorded sizes, and removes otherwise (`recover_interrupted`). See the README's checkpoint section.
"""
import base64
import hashlib
import logging
import shutil
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from pretrain.checkpoint.read import (DCP_METADATA, FORMAT, MANIFEST, ROPE_SCALING_KEYS, check_optimizer, file_record,
                                      load_dcp, optimizer_fields, read_dcp_metadata, read_json, saved_optimizer)
from pretrain.checkpoint.recovery import (LATEST, PENDING, find_usable, publish_step_dir, write_json_durably,
                                          written_record)
from pretrain.checkpoint.tensors import (global_shapes, model_templates, parameter_names, saved_states,
                                         sharded_state)
from pretrain.config import Config
from pretrain.errors import CheckpointError
from pretrain.runtime.agreement import from_rank0
from pretrain.runtime.layout import Layout, layout_text
from pretrain.sections import ModelConfig
from zero3d import sharded_state as engine_state
from zero3d.comm.gloo import lower_gloo_poller_priority

log = logging.getLogger("pretrain.checkpoint")

__all__ = ["Checkpointer", "CheckpointError", "layout_signature", "optimizer_record", "run_identity", "LATEST"]


def layout_signature(cfg: Config, topo: Layout) -> dict:
    """The layout a checkpoint was written with (a resume may use another; per-rank RNG then re-derived)."""
    return {"world_size": topo.world_size, "tensor": topo.tp, "pipeline": topo.pp, "data": topo.dp, "context": topo.cp,
            "stage": cfg.zero.stage, "dtype": cfg.precision.dtype,
            # hybrid sharding: shards node-local (over gpus_per_node's DP ranks), replicated across nodes
            "hybrid": cfg.zero.hybrid, "gpus_per_node": topo.gpus_per_node}


def run_identity(m: ModelConfig, tensor_parallel: int, tokenizer_model: Path, data_prefix: str) -> dict:
    """What a checkpoint must agree with to be resumed: the model's shape, the tokenizer and the data
    (`data_prefix`: the prefixes the run reads, space-separated; blend weights may change)."""
    return {"model": {"num_layers": m.num_layers, "hidden_size": m.hidden_size,
                      "num_attention_heads": m.num_attention_heads, "ffn_hidden_size": m.ffn_size,
                      "seq_length": m.seq_length, "tie_embeddings": m.tie_embeddings,
                      "padded_vocab_size": m.padded_vocab_size(tensor_parallel), **architecture_identity(m)},
            "vocab_size": m.vocab_size, "data_prefix": str(data_prefix),
            "tokenizer_sha256": hashlib.sha256(Path(tokenizer_model).read_bytes()).hexdigest()}


def architecture_identity(m: ModelConfig) -> dict:
    """The decoder's architecture keys a resume must match (read.ARCHITECTURE_BEFORE_KEYS and
    read.added_architecture_keys: checkpoints older than these keys); RoPE's base and scaling only where RoPE is on,
    the scaling's other values only where it scales."""
    rope = m.position_embedding == "rope"
    scaled = rope and m.rope_scaling_factor is not None
    return {"position_embedding": m.position_embedding, "rope_base": m.rope_base if rope else None,
            "rope_scaling_factor": m.rope_scaling_factor if rope else None, "mlp": m.mlp, "norm": m.norm,
            "norm_epsilon": m.norm_epsilon, "num_query_groups": m.shape.groups, "qk_layernorm": m.qk_layernorm,
            "bias": m.bias, "qkv_bias": m.qkv_bias, "head_dim": own_head_dim(m), "sliding_window": m.sliding_window,
            **{key: getattr(m, key) if scaled else None for key in ROPE_SCALING_KEYS}}


def own_head_dim(m: ModelConfig) -> Optional[int]:
    """model.head_dim where it is not hidden / heads (None there: a head size the heads already say)."""
    return None if m.head_dim is None or m.head_dim * m.num_attention_heads == m.hidden_size else m.head_dim


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _tensor_b64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def optimizer_record(settings) -> tuple:
    """(optimizer name, state dtype) of an engine's settings: what a checkpoint's optimizer states must suit."""
    return settings.optimizer_spec.name, settings.optimizer.state_dtype


def rng_state() -> dict:
    """This rank's generators (CPU, megatron's tracker, CUDA) as base64 JSON."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    state = {"cpu": _b64(torch.get_rng_state()),
             "tracker": {k: _b64(v) for k, v in get_cuda_rng_tracker().get_states().items()}}
    if torch.cuda.is_available():
        state["cuda"] = _b64(torch.cuda.get_rng_state())
    return state


def set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    torch.set_rng_state(_tensor_b64(state["cpu"]))
    get_cuda_rng_tracker().set_states({k: _tensor_b64(v) for k, v in state["tracker"].items()})
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(_tensor_b64(state["cuda"]))


def rederive_rng(seed: int, step: int) -> None:
    """Generators for a layout the saved ones do not fit: seeded from (seed, step), as at start-up."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    torch.manual_seed(seed + step)
    model_parallel_cuda_manual_seed(seed + step)


def _cause(err: BaseException) -> str:
    """One line for a failed write: DCP's CheckpointException unwrapped to its ranks' causes."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        return "; ".join(_cause(exc) for exc, _ in failures.values())
    return f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"


class Checkpointer:
    """Collective save/load of one run's model and engine states (every rank makes the same calls); which
    checkpoint to load is chosen before the model exists (pretrain/checkpoint/recovery.py: find_usable)."""

    def __init__(self, save_dir: Path, model, engine, keep: int = 0, async_save: bool = True,
                 timeout_minutes: float = 10.0, max_failed_saves: int = 3):
        if keep < 0:
            raise ValueError(f"keep = {keep}: the number of checkpoints to keep must be >= 0 (0 keeps all)")
        self.save_dir, self.keep, self.async_save = Path(save_dir), keep, async_save
        self.model, self.engine = model, engine  # the states it saves and loads, handed over once
        self._timeout = timedelta(minutes=timeout_minutes)
        self._group = None  # a gloo group of its own: the writer thread's collectives
        self._templates = None
        self._names = None
        self._pending = None
        self._report: dict = {}
        self.max_failed_saves, self.failed_saves = max_failed_saves, 0  # consecutive failed saves
        self._closing = False  # the run's last save: no next interval to retry it at

    # ------------------------------------------------------------ save

    def _writer_group(self):
        if self._group is None:
            self._group = dist.new_group(backend="gloo", timeout=self._timeout)
            lower_gloo_poller_priority()
        return self._group

    def _model_templates(self) -> dict:
        if self._templates is None:
            with engine_state.parameter_shapes(self.engine):
                self._templates = model_templates(self.model)
        return self._templates

    def save(self, step: int, meta: dict) -> None:
        """Collective. Blocks for the previous save's completion and this one's copy of the states;
        the write goes on in a background thread (`async_save`), or finishes here."""
        t0 = time.perf_counter()
        self.wait()
        engine = self.engine
        engine.finish_param_sync()  # stages 1/2 may still be gathering the parameters of the last step
        rank = dist.get_rank()
        final, tmp = self.save_dir / f"step_{step:08d}", self.save_dir / f"step_{step:08d}.tmp"

        def prepare() -> Optional[str]:
            try:
                self.save_dir.mkdir(parents=True, exist_ok=True)
                for leftover in self.save_dir.glob("*.tmp"):  # crash leftovers of an earlier save
                    shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
                (tmp / "rng").mkdir(parents=True)
            except OSError as err:
                return f"cannot prepare {tmp}: {err}"
            return None
        error = from_rank0(prepare)
        if error is not None:
            return self._save_failed(tmp, error)
        templates = self._model_templates()
        if self._names is None:  # every stage's parameter names, for the export
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, parameter_names(templates))
            self._names = {k: v for names in everyone for k, v in names.items()}
        with engine.materialized_states():  # NVMe offload: the states read from their files meanwhile
            staged = [engine_state.StatePiece(p.name, p.shape, p.lo, p.hi,
                                              {k: v.detach().to("cpu", copy=True) for k, v in p.tensors.items()})
                      for p in engine_state.pieces_to_write(engine)]  # the device-to-host copy
            steps = engine_state.optimizer_step_count(engine)
        state = sharded_state(staged, templates, ("param", *engine_state.training_states(engine)), writing=True)
        meta = {**meta, "format": FORMAT, "step": step,
                **optimizer_fields(engine.settings.optimizer_spec, steps, engine.settings.optimizer.state_dtype),
                "scaler": engine.scaler.state_dict(), "parameter_names": self._names}
        rng = rng_state()
        group = self._writer_group()
        result: dict = {}
        thread = threading.Thread(target=self._write, args=(state, tmp, rank, rng, group, result, meta),
                                  daemon=True)
        thread.start()
        self._pending = (thread, result, tmp, final, meta)
        self._report["ckpt/stall_s"] = time.perf_counter() - t0
        if not self.async_save:
            self.wait()
            self._report["ckpt/stall_s"] = time.perf_counter() - t0

    @staticmethod
    def _write(state, tmp: Path, rank: int, rng: dict, group, result: dict, meta: dict) -> None:
        """Writer thread: DCP save over the writer group (every rank enters it, whatever fails after); fsync
        and hash this rank's files; rank 0 writes pending.json; last, this rank's `written/rank_<r>.json`,
        the mark that its part is complete on disk."""
        t0 = time.perf_counter()
        try:
            dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True, thread_count=1),
                     process_group=group)
            write_json_durably(tmp / "rng" / f"rank_{rank:05d}.json", rng)
            if rank == 0:
                write_json_durably(tmp / PENDING, meta)
            group_rank = dist.get_rank(group)
            names = [p.name for p in tmp.glob(f"__{group_rank}_*.distcp")] + [f"rng/rank_{rank:05d}.json"]
            if group_rank == 0:
                names.append(DCP_METADATA)
            result["files"] = {name: file_record(tmp / name) for name in names}
            written_record(tmp, rank, result["files"])
        except BaseException as err:  # noqa: BLE001 - DCP's CheckpointException too; reported by wait() on every rank
            result["error"] = f"rank {rank}: {_cause(err)}"
        result["write_s"] = time.perf_counter() - t0

    def written(self) -> bool:
        """This rank's part of the pending save is finished (written or failed): a local look, no collective.
        The loop sums it over every rank in the step's all-reduce and calls `wait()` when all are."""
        return self._pending is not None and not self._pending[0].is_alive()

    def wait(self) -> None:
        """Collective: finish the pending save — every rank's part durable, then checkpoint.json, the
        rename and `latest` (rank 0), then retention. Raises on every rank if any rank's write failed."""
        if self._pending is None:
            return
        thread, result, tmp, final, meta = self._pending
        self._pending = None
        thread.join()
        results = [None] * dist.get_world_size()
        dist.all_gather_object(results, result)
        errors = [r["error"] for r in results if "error" in r]
        if errors:
            return self._save_failed(tmp, "; ".join(errors))
        files = {name: record for r in results for name, record in r["files"].items()}

        def publish() -> Optional[str]:
            try:
                self._publish(tmp, final, {**meta, "files": files})
            except OSError as err:
                return f"cannot complete checkpoint {final}: {err}"
            return None
        error = from_rank0(publish)
        if error is not None:
            return self._save_failed(tmp, error)
        self.failed_saves = 0
        self._report["ckpt/failed_saves"] = 0
        self._report["ckpt/write_s"] = max(r["write_s"] for r in results)
        self._report["ckpt/bytes"] = sum(rec["bytes"] for rec in files.values()) + (final / MANIFEST).stat().st_size

    def _save_failed(self, tmp: Path, cause: str) -> None:
        """Collective, with the cause agreed: a failed save is logged, its partial files removed and the run
        goes on (`latest` and older checkpoints untouched); max_failed_saves in a row stop it (exit 3)."""
        self.failed_saves += 1
        self._report["ckpt/failed_saves"] = self.failed_saves
        if dist.get_rank() == 0:
            try:
                if tmp.exists():
                    shutil.rmtree(tmp)
            except OSError as err:
                cause += f" (its partial files could not be removed: {err})"
            log.warning(f"checkpoint save failed ({self.failed_saves} of train.max_failed_saves = "
                        f"{self.max_failed_saves} in a row): {cause}; `latest` still names the previous one, "
                        "retrying at the next save")
        if self._closing:
            raise CheckpointError(f"the run's last checkpoint save failed: {cause}", str(self.save_dir),
                                  "free space or fix the permissions of train.save_dir and resume; `latest` names "
                                  "the last complete checkpoint")
        if self.failed_saves >= self.max_failed_saves:
            raise CheckpointError(f"{self.failed_saves} checkpoint saves in a row failed, the last: {cause}",
                                  str(self.save_dir), "free space or fix the permissions of train.save_dir, or "
                                  "raise train.max_failed_saves; `latest` names the last complete checkpoint")

    def _publish(self, tmp: Path, final: Path, manifest: dict) -> None:
        """Rank 0: checkpoint.json, the directory renamed into place, `latest`, old checkpoints pruned."""
        publish_step_dir(tmp, final, manifest, self.keep)

    def close(self) -> None:
        """Collective: wait for the last save (at the end of a run); its failure is an error, as nothing
        would retry it."""
        self._closing = True
        try:
            self.wait()
        finally:
            self._closing = False

    def report(self) -> dict:
        """ckpt/stall_s, ckpt/write_s, ckpt/bytes of the latest saves (empty before the first)."""
        return dict(self._report)

    # ------------------------------------------------------------ load

    def load_latest(self, identity: dict, layout: dict, seed: int) -> Optional[dict]:
        """Collective: restore the newest usable checkpoint into this (any) layout; None when there is none.
        Returns {"step", "consumed_samples", "path", "notes"} (see find_usable and load)."""
        usable = find_usable(self.save_dir, identity, optimizer_record(self.engine.settings))
        return None if usable is None else self.load(usable, layout, seed)

    def load(self, usable: dict, layout: dict, seed: int) -> dict:
        """Collective: restore the checkpoint `find_usable` chose. Returns {"step", "consumed_samples", "path", "notes"}."""
        step_dir, manifest, engine = usable["path"], usable["manifest"], self.engine
        _, steps = saved_optimizer(manifest)
        check_optimizer(step_dir, manifest, *optimizer_record(engine.settings))  # find_usable's check, if it was skipped
        with engine.materialized_states():  # NVMe offload: written back to their files on exit
            self._load_states(step_dir)
            engine_state.set_optimizer_step_count(engine, steps)
        notes = usable["notes"] + self._restore_scalars(manifest, layout, seed, step_dir)
        return {"step": manifest["step"], "consumed_samples": manifest.get("consumed_samples"),
                "path": step_dir, "notes": notes}

    def _load_states(self, step_dir: Path) -> None:
        templates = self._model_templates()
        states = engine_state.training_states(self.engine)
        saved = read_dcp_metadata(step_dir).state_dict_metadata  # verified above; read without pickle
        held = saved_states(saved)
        missing = [s for s in states if s not in held]
        if missing:  # before any tensor is allocated or read
            raise CheckpointError(f"{step_dir}: holds no {', '.join(f'optim/{s}/' for s in missing)} tensors; "
                                  f"this run's {self.engine.settings.optimizer_spec.name} optimizer resumes from "
                                  f"{', '.join(states)}; the checkpoint holds {', '.join(held) or 'none'}")
        state = sharded_state(engine_state.pieces_to_load(self.engine), templates, states, writing=False)
        for key, shape in global_shapes(templates, states).items():
            if key in state and key not in saved:
                raise CheckpointError(f"{step_dir}: tensor {key!r} is not in the checkpoint (another model?)")
            if key in state and tuple(saved[key].size) != shape:
                raise CheckpointError(f"{step_dir}: tensor {key!r} has global shape {tuple(saved[key].size)} "
                                      f"in the checkpoint, this model needs {shape}")
        load_dcp(state, step_dir, process_group=self._writer_group())
        engine_state.publish_loaded_state(self.engine)

    def _restore_scalars(self, manifest: dict, layout: dict, seed: int, step_dir: Path) -> list[str]:
        if manifest["scaler"]:
            self.engine.scaler.load_state_dict(manifest["scaler"])
        saved = manifest["layout"]
        if {k: saved.get(k) for k in RNG_LAYOUT} == {k: layout.get(k) for k in RNG_LAYOUT}:
            path, error = step_dir / "rng" / f"rank_{dist.get_rank():05d}.json", None
            try:
                set_rng_state(read_json(path))
            except CheckpointError as err:
                error = str(err)
            except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as err:  # valid JSON, wrong content
                error = f"{path} is malformed: not this rank's generator states ({type(err).__name__}: {err})"
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, error)  # every rank stops together on any rank's bad file
            if any(everyone):
                raise CheckpointError("; ".join(e for e in everyone if e),
                                      fix=f"remove {step_dir} to resume the previous checkpoint, or set "
                                          "train.resume = false")
            return []
        rederive_rng(seed, manifest["step"])
        note = (f"RNG states re-derived from seed {seed} + step {manifest['step']}: the checkpoint's per-rank "
                f"generators fit its layout ({layout_text(saved)}), not this one ({layout_text(layout)})")
        if dist.get_rank() == 0:
            log.warning(note)
        return [note]


RNG_LAYOUT = ("world_size", "tensor", "pipeline", "data")
