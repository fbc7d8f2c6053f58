"""The tree's import rules, read from the source (ast): no cycles, the engine model-agnostic, megatron's
internals reached only through megatron_patches/ and pretrain/model.py, nothing patched on CUDA."""
import ast
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("zero3d", "pretrain", "megatron_patches", "slurm", "configs")
# megatron-core's public, documented entry points; everything else under megatron.core is internal.
MEGATRON_PUBLIC = ("megatron.core.parallel_state", "megatron.core.tensor_parallel", "megatron.core.pipeline_parallel",
                   "megatron.core.datasets", "megatron.core.dist_checkpointing")
MEGATRON_INTERNALS_ALLOWED = ("megatron_patches/", "pretrain/model.py", "pretrain/attention.py", "pretrain/loss.py")


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
            found[name] = path
    return found


def imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, imported names) for every absolute import in the file, at any depth."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, [alias.name for alias in node.names]))
    return out


def own_module(name: str, known: dict) -> str | None:
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def test_no_import_cycles():
    known = modules()
    graph = {m: set() for m in known}
    for m, path in known.items():
        for module, names in imports(path):
            for target in [module] + [f"{module}.{n}" for n in names]:
                t = own_module(target, known)
                if t and t != m and not m.startswith(t + "."):
                    graph[m].add(t)
    state, cycles = {}, []

    def visit(u, stack):
        state[u] = "open"
        for v in sorted(graph[u]):
            if state.get(v) == "open":
                cycles.append(" -> ".join(stack[stack.index(v):] + [u, v]) if v in stack else f"{u} -> {v}")
            elif v not in state:
                visit(v, stack + [u])
        state[u] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert cycles == []


def test_engine_imports_no_analysis_pretrain_or_megatron():
    for name, path in modules().items():
        if not name.startswith("zero3d.") or name.startswith("zero3d.analysis"):
            continue
        bad = [m for m, _ in imports(path)
               if m.startswith(("zero3d.analysis", "pretrain", "megatron", "megatron_patches", "slurm"))]
        assert bad == [], f"{path.relative_to(REPO)} imports {bad}"


def test_megatron_internals_only_in_patches_and_model():
    offenders = []
    for name, path in modules().items():
        rel = str(path.relative_to(REPO))
        if rel.startswith(MEGATRON_INTERNALS_ALLOWED):
            continue
        for module, names in imports(path):
            if module != "megatron" and not module.startswith("megatron."):
                continue
            public = module in ("megatron", "megatron.core") or module.startswith(MEGATRON_PUBLIC)
            if not public or any(n.startswith("_") for n in names):
                offenders.append(f"{rel}: {module} {names}")
    assert offenders == []


def test_megatron_patches_stay_small():
    lines = sum(len(p.read_text().splitlines()) for p in (REPO / "megatron_patches").glob("*.py"))
    assert lines <= 150, f"megatron_patches/ has {lines} lines"


def test_cuda_mode_patches_nothing_and_cpu_mode_is_undone():
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.tensor_parallel.random as mrandom

    import megatron_patches
    was_applied = megatron_patches.cpu_patches_applied()
    megatron_patches.undo_cpu_patches()
    before = (torch.cuda.current_device, torch.Tensor.cuda, mrandom._CUDA_RNG_STATE_TRACKER,
              mrandom._get_cuda_rng_state, schedules.torch)
    try:
        megatron_patches.apply("cuda")
        assert not megatron_patches.cpu_patches_applied()
        megatron_patches.apply("cpu")
        assert megatron_patches.cpu_patches_applied() and torch.cuda.current_device() == "cpu"
        megatron_patches.undo_cpu_patches()
        after = (torch.cuda.current_device, torch.Tensor.cuda, mrandom._CUDA_RNG_STATE_TRACKER,
                 mrandom._get_cuda_rng_state, schedules.torch)
        assert all(a is b for a, b in zip(after, before))
        with megatron_patches.tied_embeddings_stay_on_cpu():
            t = torch.ones(1)
            assert t.cuda() is t
        assert torch.Tensor.cuda is before[1]
    finally:
        if was_applied:
            megatron_patches.apply("cpu")
