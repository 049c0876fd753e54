"""The data store's own rules (`pflbed.data.store`): a fetch is all or nothing, an archive unpacks only inside its
folder and never over a copy already there, a verified archive the user put there stays, and every failure is one
line that names the file and says why."""

from __future__ import annotations

import hashlib
import http.server
import io
import shutil
import socket
import tarfile
import threading
from pathlib import Path

import pytest
import requests

from pflbed.data import store
from pflbed.errors import DataError

from .. import data_formats as fx

REAL_DOWNLOAD = store._download  # read at collection, before the autouse fixture turns network downloads off


def _md5(path: Path) -> str:
    return "md5:" + hashlib.md5(path.read_bytes()).hexdigest()


def _archive(tmp_path: Path, top: str, files: dict[str, bytes]) -> store.Remote:
    """A tar.gz whose top folder `top` holds `files`, as a `file://` remote with its digest."""
    folder = tmp_path / "src" / top
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    (tmp_path / "mirror").mkdir(exist_ok=True)
    archive = fx.tar_gz(folder, tmp_path / "mirror" / f"{top}.tar.gz")
    return store.Remote(archive.as_uri(), _md5(archive))


def _plain(tmp_path: Path, name: str, data: bytes) -> store.Remote:
    (tmp_path / "mirror").mkdir(exist_ok=True)
    path = tmp_path / "mirror" / name
    path.write_bytes(data)
    return store.Remote(path.as_uri(), _md5(path))


def test_a_fetch_that_fails_late_removes_everything_it_wrote(tmp_path: Path) -> None:
    """Two archives unpacked (each archive deleted once unpacked), a plain file kept, then a checksum mismatch:
    the folders, the file and the directories the fetch created all go; only the error remains."""
    a = _archive(tmp_path, "first", {"x.bin": b"1"})
    b = _archive(tmp_path, "second", {"y.bin": b"2"})
    plain = _plain(tmp_path, "labels.txt", b"3")
    bad = store.Remote(_plain(tmp_path, "last.bin", b"4").url, "md5:" + "0" * 32)
    dest = tmp_path / "new" / "deeper" / "dest"
    with pytest.raises(DataError) as info:
        store.fetch([a, plain, b, bad], dest)
    actual = hashlib.md5(b"4").hexdigest()
    assert str(info.value) == (f"{dest / 'last.bin'}: MD5 checksum mismatch (got {actual}, expected {'0' * 32}) "
                               f"for {bad.url}; discarded")  # fmt: skip
    assert not (tmp_path / "new").exists()


def test_a_fetch_keeps_a_verified_archive_the_user_put_there(tmp_path: Path) -> None:
    remote = _archive(tmp_path, "top", {"x.bin": b"1"})
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / remote.name).write_bytes((tmp_path / "mirror" / remote.name).read_bytes())
    assert store.fetch([remote], dest) == dest
    assert sorted(p.name for p in dest.iterdir()) == ["top", "top.tar.gz"]
    assert (dest / "top" / "x.bin").read_bytes() == b"1"


def test_a_fetch_whose_clean_up_cannot_remove_a_directory_still_raises(tmp_path: Path, monkeypatch) -> None:
    bad = store.Remote(_plain(tmp_path, "f.bin", b"4").url, "md5:" + "0" * 32)

    def busy(self: Path) -> None:
        raise OSError("busy")

    monkeypatch.setattr(Path, "rmdir", busy)
    with pytest.raises(DataError, match="MD5 checksum mismatch"):
        store.fetch([bad], tmp_path / "a" / "b")


def test_a_checksum_error_in_a_wording_not_known_still_says_it_in_one_line(tmp_path: Path, monkeypatch) -> None:
    """pooch words its mismatch differently across releases (1.8 changed it); a wording the pattern does not know
    falls back to pooch's own message, on one line, rather than to a traceback or a blank."""
    import pooch

    def mismatch(*args, **kwargs):
        raise ValueError("digest\nis not what it should be")

    monkeypatch.setattr(pooch, "retrieve", mismatch)
    remote = store.Remote("https://example.org/a.bin", "sha256:" + "0" * 64)
    with pytest.raises(DataError) as info:
        store._retrieve(remote, tmp_path)
    assert str(info.value) == (f"{tmp_path / 'a.bin'}: SHA256 checksum mismatch (digest is not what it should be) "
                               "for https://example.org/a.bin; discarded")  # fmt: skip


def test_a_clean_up_the_system_refuses_never_hides_the_outcome(tmp_path: Path, monkeypatch) -> None:
    """Removing a folder can fail (a file held open, a read-only mount): the unpack's own hidden folder left
    behind does not fail a fetch that worked, and a failed fetch still says why it failed, not why its clean-up
    did. `rmtree` here fails as it does on such a folder unless told to carry on."""

    def held(path, ignore_errors=False, **kwargs) -> None:
        if not ignore_errors:
            raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(shutil, "rmtree", held)
    remote = _archive(tmp_path, "top", {"x.bin": b"1"})
    assert (store.fetch([remote], tmp_path / "ok") / "top" / "x.bin").read_bytes() == b"1"
    bad = store.Remote(_plain(tmp_path, "f.bin", b"4").url, "md5:" + "0" * 32)
    with pytest.raises(DataError, match="f.bin: MD5 checksum mismatch"):
        store.fetch([remote, bad], tmp_path / "new")


def test_an_archive_unpacks_only_inside_its_folder(tmp_path: Path) -> None:
    """A member named `../escape.txt` is refused (tarfile's `data` filter), and nothing is written anywhere."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name in ("top/ok.txt", "../escape.txt"):
            info = tarfile.TarInfo(name)
            info.size = 2
            tf.addfile(info, io.BytesIO(b"hi"))
    archive = tmp_path / "mirror" / "evil.tar.gz"
    archive.parent.mkdir()
    archive.write_bytes(buf.getvalue())
    dest = tmp_path / "a" / "dest"
    with pytest.raises(DataError) as info:
        store.fetch([store.Remote(archive.as_uri(), _md5(archive))], dest)
    message = str(info.value)
    assert message.startswith(f"{dest / 'evil.tar.gz'}: truncated or corrupt archive (") and "\n" not in message
    assert message.endswith("); nothing unpacked") and "escape.txt" in message
    assert not (tmp_path / "a" / "escape.txt").exists() and not (tmp_path / "a").exists()


def test_an_archive_never_unpacks_over_a_folder_already_there(tmp_path: Path) -> None:
    remote = _archive(tmp_path, "top", {"x.bin": b"new"})
    dest = tmp_path / "dest"
    (dest / "top").mkdir(parents=True)
    (dest / "top" / "x.bin").write_bytes(b"mine")
    with pytest.raises(DataError) as info:
        store.fetch([remote], dest)
    assert str(info.value) == f"{dest / 'top'}: already exists (an incomplete copy?); move it away to unpack top.tar.gz"
    assert (dest / "top" / "x.bin").read_bytes() == b"mine" and sorted(p.name for p in dest.iterdir()) == ["top"]


def test_a_missing_mirror_file_and_an_unwritable_destination_say_so(tmp_path: Path) -> None:
    gone = (tmp_path / "gone.bin").as_uri()
    with pytest.raises(DataError) as info:
        store.fetch([store.Remote(gone, "md5:" + "0" * 32)], tmp_path / "dest")
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'dest' / 'gone.bin'}: download of {gone} failed (") and "\n" not in message
    assert "No such file or directory" in message
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(DataError) as info:
        store.fetch([], tmp_path / "file" / "dest")
    assert str(info.value) == f"{tmp_path / 'file' / 'dest'}: cannot create download directory (Not a directory)"


class _NamedLikeUrllib3(Exception):
    """urllib3 keeps the socket's error in `reason`, outside `args`, `__cause__` and `__context__`."""

    def __init__(self, reason: BaseException) -> None:
        super().__init__("pool: max retries")
        self.reason = reason


class NameResolutionError(Exception):  # urllib3's name for a failed look-up, matched by name
    pass


OFFLINE = "no network: name resolution failed for h.example"
ONCE = ValueError()


@pytest.mark.parametrize(("exc", "cause"), [
    (requests.RequestException(_NamedLikeUrllib3(socket.gaierror(-2, "no"))), OFFLINE),
    (requests.RequestException(NameResolutionError("x")), OFFLINE),
    (requests.RequestException(socket.gaierror(-2, "no"), ValueError(KeyError("k"))), OFFLINE),  # a sibling after
    (requests.RequestException(ValueError(socket.gaierror(-2, "no"), ONCE, ONCE)), OFFLINE),  # after a repeat
    (requests.RequestException("a   plain\nfailure"), "a plain failure"),
    (requests.ConnectionError("refused", response=requests.Response()), "cannot connect to h.example"),
])  # fmt: skip
def test_a_network_failure_s_cause_is_found_wherever_requests_keeps_it(exc: BaseException, cause: str) -> None:
    assert store.network_cause(exc, "https://h.example/f.tar") == cause


def test_the_cause_chain_is_bounded_and_visits_each_error_once() -> None:
    """An error repeated in the chain is walked once, errors after it are still walked; at most 32 are."""
    deep: BaseException = socket.gaierror(-2, "no")
    for _ in range(32):
        deep = ValueError(deep)
    assert store.network_cause(requests.RequestException(deep), "https://h.example/f") != (
        "no network: name resolution failed for h.example")  # the 33rd error is not reached
    assert len(store._chain(requests.RequestException(deep))) == 32
    twice = ValueError()
    assert len(store._chain(ValueError(KeyError(), twice, twice))) == 3  # then KeyError, after the repeat


def test_an_http_status_without_a_reason_has_no_trailing_space() -> None:
    response = requests.Response()
    response.status_code, response.reason = 404, None
    assert store.network_cause(requests.HTTPError("x", response=response), "https://h.example/f") == "HTTP 404"


def test_a_real_http_download_from_a_local_server_is_verified(tmp_path: Path, monkeypatch) -> None:
    """pooch's own HTTP downloader (no progress bar: a failure stays one line), against a server on this machine;
    then a 404 from it says its status."""
    (tmp_path / "served").mkdir()
    (tmp_path / "served" / "f.bin").write_bytes(b"payload")

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(tmp_path / "served"), **kwargs)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    for proxy in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    monkeypatch.setattr(store, "_download", REAL_DOWNLOAD)
    url = f"http://127.0.0.1:{server.server_port}/f.bin"
    try:
        dest = store.fetch([store.Remote(url, "md5:" + hashlib.md5(b"payload").hexdigest())], tmp_path / "dest")
        assert (dest / "f.bin").read_bytes() == b"payload"
        with pytest.raises(DataError) as info:
            store.fetch([store.Remote(url.replace("f.bin", "g.bin"), "md5:" + "0" * 32)], tmp_path / "dest2")
    finally:
        server.shutdown()
        server.server_close()
    assert str(info.value) == "download of g.bin failed (HTTP 404 File not found)"


def test_where_a_dataset_is_looked_for_and_said_to_be_missing(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("PFLBED_CACHE")
    monkeypatch.delenv("PFLBED_DATA", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert store.cache_root() == tmp_path / "home" / ".cache" / "pflbed"
    cache = tmp_path / "home" / ".cache" / "pflbed" / "mnist"
    assert str(store.not_found("mnist", "MNIST", None, "get it")) == (
        f"dataset mnist (MNIST) not found (looked in {cache}; no PFLBED_DATA); get it")
    monkeypatch.setenv("PFLBED_DATA", str(tmp_path / "data"))
    assert str(store.not_found("mnist", "MNIST", None, "get it")) == (
        f"dataset mnist (MNIST) not found (looked in {tmp_path / 'data' / 'mnist'}, {cache}); get it")
    remote = _plain(tmp_path, "never.bin", b"")
    with pytest.raises(DataError, match=r"^dataset mnist \(MNIST\) not found \(looked in "):  # no download asked for
        store.locate("mnist", "MNIST", None, (), lambda d: False, "get it", remotes=[remote])
    assert not cache.exists()


def test_a_file_is_taken_gzipped_only_where_that_is_allowed(tmp_path: Path) -> None:
    (tmp_path / "x.gz").write_bytes(b"")
    assert store.file_in(tmp_path, "x", "test") == tmp_path / "x.gz"
    with pytest.raises(DataError) as info:
        store.file_in(tmp_path, "x", "test", gz=False)
    assert str(info.value) == f"{tmp_path / 'x'}: no such file: the test copy in {tmp_path} is incomplete"
    with pytest.raises(DataError) as info:
        store.file_in(tmp_path, "y", "test")
    assert str(info.value) == f"{tmp_path / 'y'}: no such file (nor y.gz): the test copy in {tmp_path} is incomplete"


def test_a_stamp_names_each_file_and_a_missing_one_says_so(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"abc")
    assert [(p, size) for p, _, size in store.stamp([tmp_path / "a"])] == [(str(tmp_path / "a"), 3)]
    with pytest.raises(DataError) as info:
        store.stamp([tmp_path / "b"])
    assert str(info.value) == f"{tmp_path / 'b'}: cannot stat (No such file or directory)"
    assert store.one_line(EOFError()) == "EOFError" and store.one_line(ValueError(" a \n b ")) == "a b"


def test_an_archive_unpacks_into_a_hidden_folder_beside_its_destination(tmp_path: Path, monkeypatch) -> None:
    """Beside it, so that moving the folder into place is a rename on one file system (not a copy out of /tmp),
    and hidden and named after the archive, so that a look-up never takes it for the dataset."""
    import tempfile

    made = []
    real = tempfile.mkdtemp

    def spy(**kwargs) -> str:
        made.append(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(tempfile, "mkdtemp", spy)
    remote = _archive(tmp_path, "top", {"x.bin": b"1"})
    store.fetch([remote], tmp_path / "dest")
    assert made == [{"prefix": ".top.tar.gz.", "suffix": ".unpack", "dir": tmp_path / "dest"}]
    assert sorted(p.name for p in (tmp_path / "dest").iterdir()) == ["top"]


def test_an_http_download_has_a_timeout_and_no_progress_bar(monkeypatch) -> None:
    """A server that accepts and never answers must not hang a run (pooch's default is no timeout), and a bar
    would interleave with the run's own progress lines."""
    import pooch

    made = []

    class Spy:
        def __init__(self, **kwargs) -> None:
            made.append(kwargs)

        def __call__(self, url, output_file, pooch_, check_only=False):
            return "fetched"

    monkeypatch.setattr(pooch, "HTTPDownloader", Spy)
    assert REAL_DOWNLOAD("https://h.example/f", "out", None) == "fetched"
    assert made == [{"progressbar": False, "timeout": made[0]["timeout"]}] and 0 < made[0]["timeout"] <= 120
