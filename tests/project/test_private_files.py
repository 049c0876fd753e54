"""Files only their owner may read (keys, client states, checkpoints), private from their first byte, and a torch
whose safe loading holds (issue: a deployment that holds against a curious party on the same machine, and a
joining site that loads a run directory the server made)."""

import os
import stat
import tomllib
from pathlib import Path

import pytest
import torch

from pflbed import private_files
from pflbed.private_files import private_dir, save_private, write_private_bytes
from pflbed.version import SAFE_TORCH, check_torch, torch_is_safe

from ..planted import Planted

ROOT = Path(__file__).resolve().parents[2]


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


@pytest.fixture
def open_umask():
    """The most permissive umask: what the files get is then what pflbed asks for, not what the umask allows."""
    old = os.umask(0)
    yield
    os.umask(old)


def _modes_at_creation(monkeypatch) -> list[tuple[str, int]]:
    """Every file's mode as the process creates it (`os.open` with O_CREAT, as `mkstemp` and `open` do): a file
    written then `chmod`ed shows its first mode here."""
    seen: list[tuple[str, int]] = []
    real = os.open

    def watched(path, flags, mode=0o777, *a, **kw):
        fd = real(path, flags, mode, *a, **kw)
        if flags & os.O_CREAT:
            seen.append((str(path), stat.S_IMODE(os.fstat(fd).st_mode)))
        return fd

    monkeypatch.setattr(os, "open", watched)
    return seen


def test_a_private_file_is_0600_from_its_creation_and_its_temporary_name_unpredictable(tmp_path, open_umask,
                                                                                      monkeypatch):  # fmt: skip
    seen = _modes_at_creation(monkeypatch)
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    save_private({"w": torch.ones(3)}, a)
    write_private_bytes(b, b"secret")
    assert _mode(a) == _mode(b) == 0o600
    assert seen and all(m == 0o600 for _, m in seen), seen
    assert {Path(p).parent for p, _ in seen} == {tmp_path}  # beside its destination: the rename stays on one disk
    assert b.read_bytes() == b"secret"
    tmp_names = [Path(p).name for p, _ in seen]
    assert all(n.startswith(".a.pt.") or n.startswith(".b.pt.") for n in tmp_names)
    assert len({n for n in tmp_names}) == len(tmp_names)  # random, not `.tmp<pid>`
    assert str(os.getpid()) not in "".join(tmp_names)
    assert torch.equal(torch.load(a, weights_only=True)["w"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pt", "b.pt"]  # no temporary file left


def test_a_failed_write_leaves_the_previous_file_and_no_temporary_one(tmp_path):
    p = write_private_bytes(tmp_path / "k", b"old")

    def fail(f):
        f.write(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        private_files.write_private(p, fail)
    assert p.read_bytes() == b"old" and [x.name for x in tmp_path.iterdir()] == ["k"]


def test_private_directories_are_0700_with_every_missing_parent(tmp_path, open_umask):
    d = private_dir(tmp_path / "x" / "y" / "z")
    assert [_mode(p) for p in (tmp_path / "x", tmp_path / "x" / "y", d)] == [0o700] * 3
    for mode in (0o755, 0o750, 0o705, 0o640):  # a key directory an earlier version made 0755, or other open modes
        (tmp_path / f"old-{mode:o}").mkdir(mode=mode)
        assert _mode(private_dir(tmp_path / f"old-{mode:o}")) == 0o700, oct(mode)


def test_a_directory_not_ours_is_left_as_it_is(tmp_path, open_umask, monkeypatch):
    """An existing directory of another user's (a shared data folder, its owner here another uid) keeps its mode:
    it is not ours to change, and changing it would fail for anyone but root."""
    (tmp_path / "shared").mkdir(mode=0o755)
    owner = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: owner + 1)
    assert _mode(private_dir(tmp_path / "shared")) == 0o755


def test_tls_and_node_keys_are_private_from_their_creation(tmp_path, open_umask, monkeypatch):
    pytest.importorskip("cryptography")
    from pflbed.flower.certificates import write_certificates, write_node_keys

    seen = _modes_at_creation(monkeypatch)
    _, _, key = write_certificates(tmp_path / "certs")
    keys = write_node_keys(tmp_path / "keys", 2)
    assert _mode(tmp_path / "certs") == _mode(tmp_path / "keys") == 0o700
    private = [key, *(k for k, _ in keys)]
    assert all(_mode(p) == 0o600 for p in private)
    for p in private:  # created 0600 (never readable by others, not even before a chmod)
        modes = [m for q, m in seen if Path(q).name.startswith(f".{p.name}.") or Path(q).name == p.name]
        assert modes == [0o600], (p.name, seen)


def test_a_node_s_client_states_are_private_files_in_private_directories(tmp_path, open_umask, monkeypatch):
    from types import SimpleNamespace

    from pflbed.flower.node_states import NodeStates

    algo = SimpleNamespace(ctx=SimpleNamespace(device="cpu"))
    seen = _modes_at_creation(monkeypatch)
    states = NodeStates(tmp_path / "states", "{}", algo)
    states.save(3, 1, {"head": torch.ones(2)}, keep=0)
    path = states.dir / "client-3" / "round-1.pt"
    assert _mode(path) == 0o600 and all(m == 0o600 for _, m in seen)
    assert _mode(states.dir) == _mode(path.parent) == _mode(tmp_path / "states") == 0o700
    assert torch.equal(states.load(3, 1)["head"], torch.ones(2))


def test_a_node_loads_a_client_state_without_unpickling_anything_else(tmp_path):
    """A state file replaced by one holding an arbitrary object (another local user, a restored backup): the node
    refuses it and runs nothing (`weights_only`), rather than executing what the file names."""
    import pickle
    from types import SimpleNamespace

    from pflbed.flower.node_states import NodeStates

    states = NodeStates(tmp_path / "states", "{}", SimpleNamespace(ctx=SimpleNamespace(device="cpu")))
    states.save(3, 1, {"head": torch.ones(2)}, keep=0)
    marker = tmp_path / "ran"
    torch.save({"head": Planted(marker)}, states.dir / "client-3" / "round-1.pt")
    with pytest.raises(pickle.UnpicklingError):
        states.load(3, 1)
    assert not marker.exists()


def test_a_checkpoint_holding_client_states_is_private(tmp_path, open_umask):
    from pflbed.results.checkpoint import checkpoint_path, save_checkpoint

    save_checkpoint(tmp_path, 2, {"w": torch.zeros(1)}, {0: {"head": torch.ones(1)}}, [], {})
    assert _mode(checkpoint_path(tmp_path)) == 0o600 and _mode(checkpoint_path(tmp_path).parent) == 0o700


@pytest.mark.parametrize("version, safe", [("2.5.1", False), ("2.4.0", False), ("1.13.1", False),
                                           ("2.6.0", True), ("2.6.0a0+git", True), ("2.13.0+cpu", True),
                                           ("3.0.0", True), ("unknown", False)])  # fmt: skip
def test_a_torch_before_2_6_is_refused_for_its_weights_only_loading(version, safe, monkeypatch):
    import importlib.metadata

    def installed(name: str) -> str:  # torch is at `version`; nothing else is installed
        if name != "torch":
            raise importlib.metadata.PackageNotFoundError(name)
        return version

    assert torch_is_safe(version) is safe
    monkeypatch.setattr(importlib.metadata, "version", installed)
    if safe:
        check_torch()
    else:
        with pytest.raises(ImportError) as exc:
            check_torch()
        assert str(exc.value) == ("pflbed needs torch >= 2.6 (its weights_only loading, which pflbed relies on to "
                                  "read files others made, can run code before 2.6); found torch " + version)


def test_without_torch_installed_its_own_import_says_so(monkeypatch):
    import importlib.metadata

    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert check_torch() is None


def test_the_package_requires_a_torch_whose_safe_loading_holds():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_dep,) = [d for d in deps if d.replace(" ", "").startswith("torch>=")]
    low = tuple(int(x) for x in torch_dep.replace(" ", "")[len("torch>="):].split(",")[0].split(".")[:2])
    assert low >= SAFE_TORCH == (2, 6)


def test_the_package_requires_a_python_whose_tarfile_filters_archives():
    """Archives are unpacked with `tarfile`'s "data" filter (PEP 706: no absolute paths, `..` or links out of the
    tree), which Python has from 3.11.4 on: an older 3.11 would fail at the first archive, after the download."""
    import tarfile

    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    low = tuple(int(x) for x in spec.replace(" ", "").removeprefix(">=").split("."))
    assert low >= (3, 11, 4)
    assert hasattr(tarfile, "data_filter")
