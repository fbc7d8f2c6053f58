"""Refuses megatron-core versions the patches were not tested on."""
from importlib.metadata import PackageNotFoundError, version

# The patches read private names of megatron-core; they were written and tested against these.
MEGATRON_TESTED = ("0.16.",)


def check_megatron_version() -> str:
    try:
        found = version("megatron-core")
    except PackageNotFoundError:
        raise RuntimeError("megatron-core is not installed; zero3d needs megatron-core==0.16.1 "
                           "(pip install -e .)") from None
    if not found.startswith(MEGATRON_TESTED):
        raise RuntimeError(
            f"megatron-core {found} is not supported by megatron_patches: tested on "
            f"{', '.join(v + 'x' for v in MEGATRON_TESTED)}. Install megatron-core==0.16.1.")
    return found
