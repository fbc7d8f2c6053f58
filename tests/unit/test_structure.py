"""The tree's import rules, read from the source (ast): no cycles, the engine model-agnostic, pretrain's floors
and wings, megatron's internals reached only through megatron_patches/ and the model wing (pretrain/model/), nothing patched on CUDA."""
import ast
import tomllib
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("zero3d", "optim", "analysis", "model_shape", "pretrain", "megatron_patches", "slurm", "configs")
# megatron-core's public, documented entry points; everything else under megatron.core is internal.
MEGATRON_PUBLIC = ("megatron.core.parallel_state", "megatron.core.tensor_parallel", "megatron.core.pipeline_parallel",
                   "megatron.core.datasets", "megatron.core.dist_checkpointing")
MEGATRON_INTERNALS_ALLOWED = ("megatron_patches/", "pretrain/model/")


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


def top_package(module: str) -> str:
    return module.split(".")[0]


def test_engine_imports_no_analysis_pretrain_or_megatron():
    """The engine is model-agnostic: no analysis (analysis/, the GPT's shape in model_shape/), no pretrain, no megatron."""
    for name, path in modules().items():
        if top_package(name) != "zero3d":
            continue
        bad = [m for m, _ in imports(path)
               if top_package(m) in ("analysis", "model_shape", "pretrain", "megatron", "megatron_patches", "slurm")]
        assert bad == [], f"{path.relative_to(REPO)} imports {bad}"


# pretrain's floors, lowest first: a module imports pretrain modules of its own floor or of floors below it.
# Ground: what every floor reads (the config tree, its self-checking sections and the blend grammar, errors, metrics sinks,
# the run summary). The model families (pretrain/families/: each HF class's [model] keys, names and layouts, read by the
# HF import and export and by hf_config) right above it, so that every wing and entry may read them. Wings by concern,
# each a package. The model above them; the training step (pretrain/step.py, with
# the pipeline schedule it runs) above the model, the loop above the step; the probe runs the loop's own step and
# builds as the loop does, so it stands above the loop; the command-line entry modules on top, imported by nothing.
PRETRAIN_FLOORS = (
    ("ground", ("pretrain", "pretrain.atomic", "pretrain.config", "pretrain.sections", "pretrain.errors",
                "pretrain.metrics",
                "pretrain.summary", "pretrain.blend", "pretrain.schedule")),
    ("families wing", ("pretrain.families",)),
    ("data wing", ("pretrain.data",)),
    ("runtime wing", ("pretrain.runtime",)),
    ("checkpoint wing", ("pretrain.checkpoint",)),
    ("model wing", ("pretrain.model",)),
    ("step", ("pretrain.step", "pretrain.pipeline")),
    ("loop", ("pretrain.train", "pretrain.memory_check", "pretrain.plan")),
    ("probe wing", ("pretrain.probe",)),
    ("entry", ("pretrain.__main__", "pretrain.export", "pretrain.hf_config", "pretrain.preprocess", "pretrain.probe.__main__",
               "pretrain.launcher", "pretrain.config_reference")),
)
WINGS = ("families", "data", "runtime", "checkpoint", "model", "probe")


def floor_of(name: str) -> int | None:
    """Index in PRETRAIN_FLOORS of the most specific entry naming the module (itself, or the wing holding it)."""
    wings = tuple(f"pretrain.{w}" for w in WINGS)
    best, best_len = None, -1
    for i, (_, members) in enumerate(PRETRAIN_FLOORS):
        for member in members:
            named = name == member or (member in wings and name.startswith(member + "."))
            if named and len(member) > best_len:
                best, best_len = i, len(member)
    return best


def pretrain_imports(known: dict) -> list[tuple[str, str]]:
    """(importer, imported) for every import of one pretrain module by another, through either spelling."""
    out = []
    for m, path in known.items():
        if not m.startswith("pretrain"):
            continue
        for module, names in imports(path):
            for target in [module] + [f"{module}.{n}" for n in names]:
                t = own_module(target, known)
                if t and t.startswith("pretrain") and t != m and (m, t) not in out:
                    out.append((m, t))
    return out


def test_no_relative_imports():
    """The floor rules read absolute imports; a relative one would walk past them unseen."""
    relative = [f"{path.relative_to(REPO)}:{node.lineno}" for path in modules().values()
                for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.ImportFrom) and node.level > 0]
    assert relative == []


def test_every_pretrain_module_has_a_floor():
    unplaced = [m for m in modules() if m.startswith("pretrain") and floor_of(m) is None]
    assert unplaced == [], f"add each to PRETRAIN_FLOORS: {unplaced}"


def test_pretrain_imports_only_its_own_floor_or_below():
    upward = [f"{m} ({PRETRAIN_FLOORS[floor_of(m)][0]}) imports {t} ({PRETRAIN_FLOORS[floor_of(t)][0]})"
              for m, t in pretrain_imports(modules()) if floor_of(t) > floor_of(m)]
    assert upward == []


def test_entry_modules_are_imported_by_nothing():
    entries = PRETRAIN_FLOORS[-1][1]
    known = modules()
    importers = [f"{path.relative_to(REPO)} imports {t}" for m, path in known.items() for module, names in imports(path)
                 for t in [module] + [f"{module}.{n}" for n in names] if t in entries]
    assert importers == []


def test_wings_are_packages_with_a_one_line_docstring():
    for wing in WINGS:
        init = REPO / "pretrain" / wing / "__init__.py"
        tree = ast.parse(init.read_text())
        assert len(tree.body) == 1 and isinstance(tree.body[0], ast.Expr), f"{init}: only a docstring"
        assert len(init.read_text().strip().splitlines()) == 1, f"{init}: a one-line docstring"


def test_setuptools_ships_every_package():
    """A non-editable install copies only the packages pyproject.toml lists: every folder with an __init__.py."""
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    present = {".".join(p.parent.relative_to(REPO).parts) for top in ("zero3d", "optim", "analysis", "model_shape",
                                                                      "pretrain", "megatron_patches")
               for p in (REPO / top).rglob("__init__.py")}
    assert present - listed == set()


def test_the_image_copies_every_shipped_package():
    """The Dockerfile copies the tree package by package: each top-level package pyproject.toml ships is one of its
    COPY lines (optim/ once was not, and the image's `-e .` install would have lacked it)."""
    listed = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    copied = [line.split()[1] for line in (REPO / "Dockerfile").read_text().splitlines() if line.startswith("COPY ")]
    assert sorted({name.split(".")[0] for name in listed} - set(copied)) == []


def test_zero3d_and_the_analysis_import_no_pretrain():
    bad = [f"{path.relative_to(REPO)} imports {m}" for name, path in modules().items()
           if top_package(name) in ("zero3d", "optim", "analysis", "model_shape")
           for m, _ in imports(path) if top_package(m) == "pretrain"]
    assert bad == []


def test_the_optimizers_sit_below_the_engine():
    """optim/ (the update rules, their keys, OptimizerConfig) knows nothing of ZeRO: the engine imports it, it imports
    nothing of the project but itself."""
    project = ("zero3d", "analysis", "model_shape", "pretrain", "megatron_patches", "slurm", "configs", "megatron")
    bad = [f"{path.relative_to(REPO)} imports {m}" for name, path in modules().items()
           if top_package(name) == "optim" for m, _ in imports(path) if top_package(m) in project]
    assert bad == []


def test_the_model_shape_is_the_lowest_floor():
    """model_shape/ (GPTShape, its FLOPs) is what the config and the analysis both read: it imports nothing of the
    project but itself, and no torch."""
    project = ("zero3d", "analysis", "pretrain", "megatron_patches", "slurm", "configs", "torch", "megatron")
    bad = [f"{path.relative_to(REPO)} imports {m}" for name, path in modules().items()
           if top_package(name) == "model_shape" for m, _ in imports(path) if top_package(m) in project]
    assert bad == []


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
    """The CPU patches (the fused SwiGLU run eagerly for the probe's CUDA stand-ins: 4 lines), the gloo groups, the
    version check and the compile seam (compile.py: megatron's one warning inside its layers counted as given) within
    220 lines; the lean import (lean.py) within 70 more."""
    files = {p.name: len(p.read_text().splitlines()) for p in (REPO / "megatron_patches").glob("*.py")}
    lean = files.pop("lean.py")
    assert sum(files.values()) <= 220 and lean <= 70, f"megatron_patches/: {files}, lean.py {lean} lines"


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


def readme_tree_paths() -> list[Path]:
    """Every file or folder the README's tree table names; a bare `name.py` is in the folder named before it."""
    text = (REPO / "README.md").read_text()
    table = text[text.index("## The tree"):].split("\n## ")[0]
    paths = []
    for row in (line for line in table.splitlines() if line.startswith("| ") and "`" in line):
        where = row.split(" | ")[1]
        folder = None
        for token in where.split("`")[1::2]:
            if "/" in token:
                path = REPO / token
                folder = path if token.endswith("/") else path.parent
            else:
                path = folder / token if token.endswith(".py") and folder else REPO / token
            paths.append(path)
    return paths


def test_readme_tree_names_files_that_exist_and_every_pretrain_module():
    named = readme_tree_paths()
    missing = [str(p.relative_to(REPO)) for p in named if not p.exists()]
    assert missing == []
    unnamed = [str(p.relative_to(REPO)) for p in sorted((REPO / "pretrain").rglob("*.py"))
               if p.name != "__init__.py" and p not in named and p.parent not in named]
    assert unnamed == [], "add these to the README's tree table"


def _source_lines(prefix: str):
    """(relative path, line number, line) of every line of the .py files under `prefix`."""
    for path in sorted((REPO / prefix).rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            yield f"{path.relative_to(REPO)}", number, line


def test_engine_asks_its_placement_never_whether_one_exists():
    """The engine always holds a placement (zero3d/placement.py); code does not branch on an offload being absent."""
    import re
    pattern = re.compile(r"\b(offload|placement)\s+is\s+(not\s+)?None\b|\b(self|engine)\.offload\b")
    found = [f"{path}:{n}: {line.strip()}" for prefix in ("zero3d", "pretrain") for path, n, line in _source_lines(prefix)
             if pattern.search(line)]
    assert found == []


def test_no_unittest_mock_in_pretrain():
    """The probe reaches the engine through EngineSettings' seams, never by patching module globals."""
    found = [f"{path}:{n}" for path, n, line in _source_lines("pretrain") if "mock" in line and "import" in line]
    assert found == []


def test_shard_grab_bag_is_gone_and_engine_modules_name_what_they_hold():
    assert not (REPO / "zero3d" / "shard.py").exists()
    assert not (REPO / "zero3d" / "state.py").exists() and not (REPO / "zero3d" / "checkpointing.py").exists()


def test_torch_mem_tracker_privates_have_one_home():
    """torch's private memory-tracker classes are imported in pretrain/probe/rank_memory.py only."""
    found = [path for name, path in modules().items() for module, _ in imports(path)
             if module.startswith("torch.distributed._tools") and name != "pretrain.probe.rank_memory"]
    found += [path for name, path in modules().items() for module, names in imports(path)
              if "_MemRefType" in names and name != "pretrain.probe.rank_memory"]
    assert found == []


def test_collective_foundations_sit_below_the_engine():
    """comm, topology and quantize (the ZeRO++ collectives) import nothing of the engine that uses them."""
    engine = ("zero3d.engine", "zero3d.whole_params", "zero3d.buckets", "zero3d.placement", "zero3d.stage")
    bad = [f"{path.relative_to(REPO)} imports {m}" for name, path in modules().items()
           if name.startswith("zero3d.comm")
           for m, _ in imports(path) if m.startswith(engine)]
    assert bad == []


def test_the_runtime_wing_reads_no_data_module():
    """The runtime reports data and tokenizer errors through the error hierarchy (pretrain/errors.py), never by
    importing the data wing to recognise them (issue #35)."""
    reads = [f"{m} imports {t}" for m, t in pretrain_imports(modules())
             if m.startswith("pretrain.runtime") and t.startswith("pretrain.data")]
    assert reads == []


def test_files_are_renamed_into_place_only_by_the_atomic_helper():
    """One tmp-file-and-rename writer (pretrain/atomic.py); a checkpoint's directories (recovery.py) are renamed
    as a whole, not written."""
    renames = [f"{path}:{n}: {line.strip()}" for prefix in ("pretrain", "zero3d", "slurm")
               for path, n, line in _source_lines(prefix)
               if ("os.replace(" in line or "os.rename(" in line) and path != "pretrain/atomic.py"]
    assert renames == []


def test_the_checkpointer_is_handed_the_model_and_engine_once():
    """Issue #35: the Checkpointer holds the model and engine from its construction; its calls take neither, and
    choosing the checkpoint to resume (before the model exists) needs no Checkpointer at all."""
    import inspect

    from pretrain.checkpoint.checkpointer import Checkpointer
    assert list(inspect.signature(Checkpointer.__init__).parameters)[1:4] == ["save_dir", "model", "engine"]
    for name, fn in inspect.getmembers(Checkpointer, inspect.isfunction):
        if name != "__init__":
            assert not {"model", "engine"} & set(inspect.signature(fn).parameters), name


MODE_KEYS = ("secondary_partition", "hybrid", "quantize_weights", "quantize_gradients")


def test_the_stages_never_read_a_communication_mode():
    """The ZeRO++ modes reach the engine once, as its CommPlan (zero3d/comm/plan.py): no stage, bucket, gather or
    engine module reads a mode's config key, builds a node Comm or quantizes (issue #35)."""
    engine_files = ["engine.py", "whole_params.py", "stage0.py", "stage1.py", "stage2.py", "stage3.py", "buckets.py",
                    "gather.py", "placement.py"]
    found = []
    for name in engine_files:
        tree = ast.parse((REPO / "zero3d" / name).read_text())
        found += [f"{name}:{node.lineno} reads .{node.attr}" for node in ast.walk(tree)
                  if isinstance(node, ast.Attribute) and node.attr in MODE_KEYS + ("intra_group", "inter_group")]
        found += [f"{name} imports {m}" for m, _ in imports(REPO / "zero3d" / name)
                  if m in ("zero3d.comm.quantize", "zero3d.comm.hierarchical", "zero3d.comm.modes")]
    assert found == []


def test_one_in_flight_handle_type():
    """Every asynchronous collective zero3d issues returns a comm.core.PendingCollective (its optional `then` step
    does what a second handle class did: copy into place, dequantize)."""
    waits = [f"{path.relative_to(REPO)}:{node.name}" for path in (REPO / "zero3d").rglob("*.py")
             for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)
             and {"wait", "is_completed"} <= {f.name for f in node.body if isinstance(f, ast.FunctionDef)}]
    assert waits == ["zero3d/comm/core.py:PendingCollective"]


def test_one_vocabulary_of_communication_modes():
    """The mode names ("+hpZ", "qwZ+hpZ+qgZ", ...) are built in zero3d/comm/modes.py only; the analysis, the planner
    and the memory check read them through CommModes, never by matching strings."""
    found = [f"{path.relative_to(REPO)}:{i}" for top in ("zero3d", "analysis", "pretrain")
             for path in (REPO / top).rglob("*.py") if path.name != "modes.py"
             for i, line in enumerate(path.read_text().splitlines(), 1)
             if any(f'"{s}"' in line or f"'{s}'" in line for s in ("+hpZ", "+hybrid", "+qwZ", "+qgZ", "qwZ+hpZ+qgZ",
                                                                    "hpZ", "qwZ", "qgZ"))]
    assert found == []


# Modules under zero3d/ that may read the environment, each with its stated reason (none: zero3d takes every
# setting as an argument; the launcher's variables are read by pretrain/runtime/rendezvous.py).
ZERO3D_ENVIRONMENT_READERS: dict[str, str] = {}


def _reads_environment(tree: ast.AST) -> bool:
    names = {"environ", "environb", "getenv", "getenvb"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in names or isinstance(node, ast.Name) and node.id in names:
            return True
        if isinstance(node, ast.ImportFrom) and node.module == "os" and names & {a.name for a in node.names}:
            return True
    return False


def test_zero3d_never_reads_the_environment():
    """Issue #35: no module under zero3d/, optim/, analysis/ or model_shape/ reads os.environ / os.getenv."""
    readers = [str(path.relative_to(REPO)) for top in ("zero3d", "optim", "analysis", "model_shape")
               for path in sorted((REPO / top).rglob("*.py"))
               if _reads_environment(ast.parse(path.read_text()))]
    assert [r for r in readers if r not in ZERO3D_ENVIRONMENT_READERS] == []


# The one layout builder: the process group, megatron's groups and the node sub-groups are made here only.
LAYOUT_BUILDERS = {
    "pretrain/runtime/layout.py": "init_layout: the process group (start_launched, or the probe's start_fake) and "
                                  "megatron's groups",
    "zero3d/comm/topology.py": "build_node_topology: the DP group's intra-/inter-node sub-groups",
}
# Groups outside the layout, each with its reason.
SIDE_GROUPS = {"pretrain/checkpoint/checkpointer.py": "one gloo group of the whole world for the checkpoint's "
                                                      "host-side agreement"}
GROUP_CALLS = ("initialize_model_parallel", "init_process_group", "new_group")


def group_calls() -> list[tuple[str, str]]:
    """(file, function) of every call of GROUP_CALLS in the shipped packages, by the called name."""
    found = []
    for package in ("pretrain", "zero3d", "optim", "megatron_patches", "slurm"):
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call):
                    name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                    if name in GROUP_CALLS:
                        found.append((str(path.relative_to(REPO)), name))
    return found


def test_one_layout_builder_for_real_and_fake_process_groups():
    """Issue #35: training and the probe build their layout with one builder; the probe passes only its start."""
    calls = group_calls()
    outside = [(f, n) for f, n in calls if f not in LAYOUT_BUILDERS and not (n == "new_group" and f in SIDE_GROUPS)]
    assert outside == []
    assert [f for f, n in calls if n == "initialize_model_parallel"] == ["pretrain/runtime/layout.py"]
    assert not [f for f, n in calls if f.startswith("pretrain/probe/")]


def test_adam_is_named_in_its_spec_only():
    """Issue #35: AdamW's state names, its legacy manifest key and its 12 bytes per parameter (fp32 master + two
    moments) live in optim/adamw.py's ADAMW alone; everything else asks the engine's OptimizerSpec. A "12" (not
    a format width) on a line that speaks of bytes, Ψ, K, masters, moments or the optimizer counts as the
    assumption. Excluded: analysis/paper_tables.py, which reproduces the paper's Tables I/II, whose
    captions say the paper's K = 12 (its numbers come from the estimator's PRECISIONS, derived from ADAMW)."""
    import re
    words = r"(?i:byte|Ψ|psi|\bK\b|master|moment|optimi[sz]er|adam)"
    twelve = re.compile(rf"(?<![<>^:])\b12\b.*{words}|{words}.*(?<![<>^:])\b12\b")  # not a format width (:>12)
    found = [f"{path}:{n}: {line.strip()}" for prefix in ("zero3d", "optim", "analysis", "model_shape", "pretrain")
             for path, n, line in _source_lines(prefix)
             if path not in ("optim/adamw.py", "analysis/paper_tables.py")
             and ("exp_avg" in line or "adam_step" in line or twelve.search(line))]
    assert found == []


def _calls(prefix: str) -> list[tuple[str, int, str]]:
    """(relative path, line number, callee as written, e.g. "engine.step") of every call in the .py files under `prefix`."""
    return [(str(path.relative_to(REPO)), node.lineno, ast.unparse(node.func))
            for path in sorted((REPO / prefix).rglob("*.py")) for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call)]


def test_one_module_composes_the_training_step():
    """Issue #35: the engine's step is called from pretrain/step.py alone, so the loop and the probe run one step (the
    micro-batches, the step sums, the agreed flags); the probe marks its phases through the step's hook and calls
    none of the step's parts itself."""
    engine_steps = {path for path, _, callee in _calls("pretrain") if callee.endswith("engine.step")}
    assert engine_steps == {"pretrain/step.py"}
    parts = ("forward_backward", "run_micro_batches", "finish_step", "engine.step", "lr_at")
    probe = [f"{path}:{n}: {callee}" for path, n, callee in _calls("pretrain/probe") if callee.endswith(parts)]
    assert probe == []


# pretrain/families/: the family modules, and the modules every family shares
FAMILY_MACHINERY = ("__init__", "family", "registry", "table")


def test_a_family_is_its_module_and_one_registry_line():
    """Issue #54: a model family is one module of pretrain/families/ and one line of the registry's FAMILY_MODULES;
    its HF class name appears in no other pretrain module (the HF import and export, hf_config and the docs' table
    read the registry), and it imports nothing of pretrain beyond the ground floor and its own package (its layer-spec
    choices are `[model]` keys, which the model wing builds)."""
    from pretrain.families.registry import FAMILIES, FAMILY_MODULES
    folder = REPO / "pretrain" / "families"
    modules_found = sorted(p.stem for p in folder.glob("*.py") if p.stem not in FAMILY_MACHINERY)
    assert sorted(FAMILY_MODULES) == modules_found
    registry = (folder / "registry.py").read_text()
    assert all(registry.count(f'\n    "{name}",\n') == 1 for name in FAMILY_MODULES)  # one line each
    for name, family in zip(FAMILY_MODULES, FAMILIES):
        assert type(family).__module__ == f"pretrain.families.{name}"
        named = [f"{path}:{n}" for path, n, line in _source_lines("pretrain") if family.architecture in line
                 and path != f"pretrain/families/{name}.py"]
        assert named == [], f"{family.architecture} is named outside pretrain/families/{name}.py"
        ground = dict(PRETRAIN_FLOORS)["ground"]
        reads = [m for m, _ in imports(folder / f"{name}.py") if m.startswith("pretrain")
                 and not m.startswith("pretrain.families") and m not in ground]
        assert reads == [], f"pretrain/families/{name}.py imports {reads}"
    hf_reads = [m for m, _ in imports(REPO / "pretrain" / "checkpoint" / "hf.py") if m.startswith("pretrain.families")]
    assert hf_reads == ["pretrain.families.registry"]
