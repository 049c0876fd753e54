"""pflbed's version, in a module of its own so that any layer can record it without importing the package's
`__init__` (which imports the engine lazily for `pflbed.run`)."""

__version__ = "0.1.0"

# torch.load(weights_only=True) is how pflbed reads every file another party may have made (a run directory a
# joining site loads, checkpoints, states, pretrained weights); before 2.6 it could be made to run code
# (CVE-2025-32434). The installed torch is checked when pflbed is imported, without importing torch.
SAFE_TORCH = (2, 6)


def torch_is_safe(version: str) -> bool:
    """Whether torch `version` (e.g. "2.13.0+cpu", "2.6.0a0") has a `weights_only` loading that holds."""
    import re

    found = re.match(r"(\d+)\.(\d+)", version)
    return found is not None and (int(found[1]), int(found[2])) >= SAFE_TORCH


def check_torch() -> None:
    """ImportError, one line, when the installed torch's safe loading does not hold."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("torch")
    except PackageNotFoundError:
        return  # torch's own import will say it is missing
    if not torch_is_safe(found):
        need = ".".join(map(str, SAFE_TORCH))
        raise ImportError(f"pflbed needs torch >= {need} (its weights_only loading, which pflbed relies on to read "
                          f"files others made, can run code before {need}); found torch {found}")  # fmt: skip
