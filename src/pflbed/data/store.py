"""Where a dataset's files are found, and how its official archive is fetched, verified and unpacked.

Look-up, for dataset `name` (the first directory that holds the dataset's files wins, so `origin` always says
which copy a run used):

1. the `path` argument (`dataset.path`): authoritative, no fallback;
2. `$PFLBED_DATA/<name>`;
3. the download cache, `$PFLBED_CACHE/<name>` (default `~/.cache/pflbed/<name>`).

Each directory is also tried with the official archive's own top folder appended (`cifar-10-batches-py`,
`CIFAR-10-C`, …), and `$PFLBED_DATA/<top folder>` is tried as well, so unpacking the archive into any of them is
all it takes.

Downloads happen only on request (`dataset.download=true`) and go through pooch: each file is streamed to a
temporary name, checked against its pinned digest (SHA-256, or the MD5 the publisher lists where that is all it
lists) and only then renamed into place. An archive is unpacked into a temporary folder beside its destination
and moved into place only once complete; the archive is then deleted. Any failure — a checksum mismatch, a
truncated archive, a network error (said in a few words: offline, unreachable, HTTP status) — is one `DataError`
naming the file, and leaves nothing behind that this call wrote; `locate` adds the dataset's name and the manual
route of its not-found message, so an offline user knows where to unpack a copy fetched elsewhere.
"""

from __future__ import annotations

import os
import re
import shutil
import tarfile
import tempfile
import urllib.parse
import urllib.request
import zipfile
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pflbed.errors import DataError

ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".zip")


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def is_file_name(text: str) -> bool:
    """Whether a name read from a dataset's listing is a plain file name: no folder part, no `..`, not absolute.
    A listing joined onto its image folder must not reach out of it (into the training images, or anywhere)."""
    return Path(text).name == text and text != ".."  # "." has no name: the first test


def cache_root() -> Path:
    """`$PFLBED_CACHE`, else `~/.cache/pflbed`."""
    return Path(os.environ.get("PFLBED_CACHE") or str(Path.home() / ".cache" / "pflbed")).expanduser()


def cache_dir(name: str) -> Path:
    """Where dataset `name` is downloaded to when no `path` is given."""
    return cache_root() / name


def candidates(name: str, path: str | os.PathLike[str] | None, tops: Sequence[str] = ()) -> list[Path]:
    """Directories to try for dataset `name`, in look-up order (see the module docstring)."""

    def with_tops(directory: Path) -> list[Path]:
        return [directory, *(directory / t for t in tops)]

    if path is not None:
        return with_tops(Path(path).expanduser())
    dirs: list[Path] = []
    env = os.environ.get("PFLBED_DATA")
    if env:
        root = Path(env).expanduser()
        dirs += [*with_tops(root / name), *(root / t for t in tops)]
    return dirs + with_tops(cache_dir(name))


def find(
    name: str, path: str | os.PathLike[str] | None, tops: Sequence[str], holds: Callable[[Path], bool]
) -> Path | None:
    """The first candidate directory for which `holds(directory)` is true, or None; never downloads."""
    for directory in candidates(name, path, tops):
        if directory.is_dir() and holds(directory):
            return directory
    return None


def not_found(name: str, title: str, path: str | os.PathLike[str] | None, how: str) -> DataError:
    """The one-line error for a dataset that no candidate directory holds: where it looked, how to get it."""
    if path is not None:
        where = str(Path(path).expanduser())
    else:
        env = os.environ.get("PFLBED_DATA")
        where = f"{Path(env).expanduser() / name}, {cache_dir(name)}" if env else f"{cache_dir(name)}; no PFLBED_DATA"
    return DataError(f"dataset {name} ({title}) not found (looked in {where}); {how}")


def spellings(stem: str, gz: bool = True) -> tuple[str, ...]:
    """The names file `stem` goes by, in the order tried: raw (cheaper to read), gzipped (when `gz`), and, for an
    IDX file, with a dot before `idx` (`train-images.idx3-ubyte`): the name MNIST's `.gz` files store inside, which
    7-Zip and desktop unpackers restore instead of the archive's own name."""
    names = (stem, f"{stem}.gz") if gz else (stem,)
    dotted = re.sub(r"-(idx\d-ubyte)$", r".\1", stem)
    return (*names, dotted) if dotted != stem else names


def has_any(*names: str) -> Callable[[Path], bool]:
    """A `holds` test: the directory holds at least one of the files `names` (each under its `spellings`)."""
    return lambda d: any((d / n).is_file() for stem in names for n in spellings(stem))


def file_in(directory: Path, stem: str, what: str, gz: bool = True) -> Path:
    """`directory/stem` under the first of its `spellings` present (raw, gzipped when `gz`, dotted); a one-line
    error naming it if none is there."""
    for name in spellings(stem, gz):
        if (directory / name).is_file():
            return directory / name
    missing = f"{directory / stem}: no such file{f' (nor {stem}.gz)' if gz else ''}"
    raise DataError(f"{missing}: the {what} copy in {directory} is incomplete")


def stamp(paths: Iterable[Path]) -> tuple[tuple[str, int, int], ...]:
    """(path, mtime_ns, size) per file: part of a load cache's key, so a replaced file misses the cache."""
    out = []
    for p in sorted(paths):
        try:
            st = p.stat()
        except OSError as exc:
            raise DataError(f"{p}: cannot stat ({exc.strerror or one_line(exc)})") from None
        out.append((str(p), st.st_mtime_ns, st.st_size))
    return tuple(out)


# --- downloads ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Remote:
    """One file of an official distribution: its URL and pinned digest (`"sha256:<hex>"` or `"md5:<hex>"`)."""

    url: str
    known_hash: str
    fname: str = ""  # the local file name; default: the URL's last path component

    @property
    def name(self) -> str:
        return self.fname or urllib.parse.urlparse(self.url).path.rsplit("/", 1)[-1]

    @property
    def is_archive(self) -> bool:
        return self.name.endswith(ARCHIVE_SUFFIXES)


def _download(url: str, output_file: Any, pooch: Any, check_only: bool = False) -> Any:
    """pooch downloader: `file://` URLs are copied (local mirrors, tests); anything else goes to pooch's HTTP one."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme == "file":
        source = Path(urllib.request.url2pathname(parsed.path))
        if check_only:
            return source.is_file()
        shutil.copyfile(source, output_file)  # an OSError is reported by `_retrieve`, naming the file
        return None
    from pooch import HTTPDownloader

    return HTTPDownloader(progressbar=False, timeout=60)(url, output_file, pooch, check_only=check_only)


def _retrieve(remote: Remote, dest: Path) -> Path:
    """`remote` into `dest` via pooch, verified; kept if already there with the right digest."""
    import pooch
    import requests

    target = dest / remote.name
    pooch.get_logger().setLevel("WARNING")  # its "Downloading data from …" line would make a failure two lines
    try:
        got = pooch.retrieve(remote.url, known_hash=remote.known_hash, fname=remote.name, path=dest,
                             downloader=_download, progressbar=False)  # fmt: skip
    except ValueError as exc:  # pooch: the digest of the downloaded file differs from the pinned one
        algorithm = remote.known_hash.split(":", 1)[0].upper()
        found = re.search(r"expected (?:\w+:)?(\w+),? (?:but )?got (\w+)", str(exc))  # pooch 1.8+'s wording
        detail = f"got {found[2]}, expected {found[1]}" if found else one_line(exc)
        raise DataError(f"{target}: {algorithm} checksum mismatch ({detail}) for {remote.url}; discarded") from None
    except requests.RequestException as exc:  # the network's failure: the local file name would be noise
        raise DataError(f"download of {remote.name} failed ({network_cause(exc, remote.url)})") from None
    except (OSError, DataError) as exc:
        raise DataError(f"{target}: download of {remote.url} failed ({one_line(exc)})") from None
    return Path(got)


def _chain(exc: BaseException) -> list[BaseException]:
    """`exc` and the errors inside it: causes, contexts, exception arguments and urllib3's `reason` (requests wraps
    urllib3's `MaxRetryError`, which wraps the socket's error)."""
    seen: list[BaseException] = []
    todo = [exc]
    while todo and len(seen) < 32:
        e = todo.pop()
        if any(e is s for s in seen):
            continue
        seen.append(e)
        inner = [e.__cause__, e.__context__, getattr(e, "reason", None), *e.args]
        todo += [i for i in inner if isinstance(i, BaseException)]
    return seen


def network_cause(exc: BaseException, url: str) -> str:
    """A failed request's cause in a few words: the raw error is a screenful of pool and retry details, and what
    a user needs to know is whether the machine is offline, the server is unreachable or the file is gone."""
    import socket

    import requests

    host = urllib.parse.urlparse(url).hostname or url
    chain = _chain(exc)
    if any(isinstance(e, socket.gaierror) or type(e).__name__ == "NameResolutionError" for e in chain):
        return f"no network: name resolution failed for {host}"
    if any(isinstance(e, requests.Timeout | TimeoutError) for e in chain):
        return f"{host} did not answer in time"
    response = getattr(exc, "response", None)
    if isinstance(exc, requests.HTTPError) and response is not None:
        return f"HTTP {response.status_code} {response.reason or ''}".rstrip()
    if isinstance(exc, requests.ConnectionError):
        return f"cannot connect to {host}"
    return one_line(exc)


def download_failed(name: str, title: str, how: str, exc: DataError) -> DataError:
    """A failed download as one line naming the dataset, with the manual route of its not-found message (less
    the download, which just failed)."""
    manual = re.sub(r",? or (set dataset\.download=true|load with download=True)\b.*$", "", how)
    return DataError(f"dataset {name} ({title}): {exc}; instead, {manual}")


def _unpack(archive: Path, dest: Path) -> list[Path]:
    """Unpack `archive` into `dest` all or nothing: into a hidden temporary folder first, then moved into place."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{archive.name}.", suffix=".unpack", dir=dest))
    try:
        try:
            if archive.name.endswith(".zip"):
                with zipfile.ZipFile(archive) as zf:
                    zf.extractall(tmp)
            else:
                with tarfile.open(archive) as tf:
                    tf.extractall(tmp, filter="data")  # refuses absolute paths, `..` and links out of the tree
        except (tarfile.TarError, zipfile.BadZipFile, EOFError, zlib.error, OSError) as exc:
            raise DataError(f"{archive}: truncated or corrupt archive ({one_line(exc)}); nothing unpacked") from None
        tops = sorted(tmp.iterdir())
        clash = next((dest / t.name for t in tops if (dest / t.name).exists()), None)
        if clash is not None:
            raise DataError(f"{clash}: already exists (an incomplete copy?); move it away to unpack {archive.name}")
        moved = []
        for top in tops:
            os.replace(top, dest / top.name)
            moved.append(dest / top.name)
        return moved
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def fetch(remotes: Sequence[Remote], dest: str | os.PathLike[str]) -> Path:
    """Fetch `remotes` into `dest` (each verified), unpack archives there, and return `dest`.

    All or nothing: on any failure, every file and folder this call created is removed again (files that were
    already there, verified, stay), so a later look-up never finds a half-written copy.
    """
    dest = Path(dest).expanduser()
    created_dirs = [p for p in (dest, *dest.parents) if not p.exists()]
    written: list[Path] = []
    try:
        try:
            dest.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DataError(f"{dest}: cannot create download directory ({exc.strerror or one_line(exc)})") from None
        for remote in remotes:
            existed = (dest / remote.name).exists()
            got = _retrieve(remote, dest)
            if not existed:
                written.append(got)
            if remote.is_archive:
                written += _unpack(got, dest)
                if not existed:  # a verified archive the user put there stays; one this call fetched goes
                    got.unlink()
    except BaseException:
        for path in reversed(written):
            _remove(path)
        for directory in created_dirs:  # innermost first
            try:
                directory.rmdir()
            except OSError:
                break
        raise
    return dest


def locate(
    name: str, title: str, path: str | os.PathLike[str] | None, tops: Sequence[str], holds: Callable[[Path], bool],
    how: str, download: bool = False, remotes: Sequence[Remote] = (),
) -> Path:  # fmt: skip
    """The directory holding dataset `name`; with `download`, fetched into `path` (or the cache) if none does.

    `remotes` empty means there is no official archive: `download` then says how to get the data instead.
    """
    directory = find(name, path, tops, holds)
    if directory is None and download:
        if not remotes:
            raise DataError(f"dataset {name} ({title}) not found and has no official archive to download; {how}")
        try:
            fetch(remotes, Path(path).expanduser() if path is not None else cache_dir(name))
        except DataError as exc:
            raise download_failed(name, title, how, exc) from None
        directory = find(name, path, tops, holds)
    if directory is None:
        raise not_found(name, title, path, how)
    return directory
