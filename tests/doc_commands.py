"""The `pflbed` commands the documentation's bash blocks show, as the shell would hand them to `pflbed`: what the
tests that run every documented command as written read (`test_docs_commands`, `test_privacy_guide`)."""

from __future__ import annotations

import glob
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def commands(text: str) -> list[list[str]]:
    """The `pflbed` commands of `text`'s bash blocks (continued lines joined, comments dropped, a trailing `&` —
    run in the background — dropped), as argv without the `pflbed`."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if argv[:1] == ["pflbed"]:
                found.append(argv[1:-1] if argv[-1] == "&" else argv[1:])
    return found


def page_python(page: str) -> list[str]:
    """The Python code blocks of a page named from the repository root, as a reader copies them."""
    return re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), re.S)


def page_commands(page: str) -> list[list[str]]:
    """`commands` of a page named from the repository root (`README.md`, `docs/guide/flower.md`)."""
    return commands((ROOT / page).read_text())


def page_command(page: str, marker: str) -> list[str]:
    """The one `pflbed` command of a page holding `marker` (`--out runs/tune/digits-small`), as argv without the
    `pflbed`, its `-c` file named from the repository root: run from a working directory of a test's own."""
    argv = next(a for a in page_commands(page) if marker in shlex.join(a))
    return [str(ROOT / w) if k and argv[k - 1] == "-c" else w for k, w in enumerate(argv)]


def expanded(argv: list[str]) -> list[str]:
    """`argv` with its wildcards expanded in the working directory, as the shell does."""
    return [p for a in argv for p in (sorted(glob.glob(a)) if "*" in a else [a])]


def with_sets(argv: list[str], *sets: str) -> list[str]:
    """`argv` with `--set KEY=VALUE` for each of `sets` appended (later keys win: the short settings a test may
    add to a command it runs as written)."""
    return [*argv, *(a for s in sets for a in ("--set", s))]
