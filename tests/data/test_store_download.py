"""A download that fails for want of a network: one line naming the dataset, the short cause, and the manual route
of the not-found message (where to unpack a copy fetched elsewhere). No test here reaches the network: name
resolution itself is made to fail, so the error is the one pooch, requests and urllib3 really raise offline."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import requests

from pflbed.cli import main
from pflbed.data import load_dataset, store
from pflbed.errors import DataError

REAL_DOWNLOAD = store._download  # read at collection, before the autouse fixture turns network downloads off


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The real downloader, on a machine whose name resolution fails (as offline), with an empty cache."""

    def no_dns(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    for proxy in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    monkeypatch.setattr(store, "_download", REAL_DOWNLOAD)
    monkeypatch.delenv("PFLBED_DATA", raising=False)
    monkeypatch.setenv("PFLBED_CACHE", str(tmp_path / "cache"))
    return tmp_path


@pytest.mark.parametrize(("name", "manual"), [
    ("cifar10", "unpack https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz (its folder cifar-10-batches-py/) "
                "into dataset.path or $PFLBED_DATA/cifar10"),
    ("cifar10c", "unpack https://zenodo.org/records/2535967/files/CIFAR-10-C.tar (its folder CIFAR-10-C/) into "
                 "dataset.path or $PFLBED_DATA/cifar10c"),
    ("emnist", "unzip https://biometrics.nist.gov/cs_links/EMNIST/gzip.zip (its folder gzip/) into dataset.path or "
               "$PFLBED_DATA/emnist"),
])  # fmt: skip
def test_an_offline_download_is_one_line_with_the_manual_route(offline: Path, name: str, manual: str) -> None:
    with pytest.raises(DataError) as info:
        load_dataset(name, download=True)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"dataset {name} ("), message
    assert "download of" in message and "failed (no network: name resolution failed for " in message, message
    assert message.endswith(f"; instead, {manual}"), message  # the not-found message's route, less the download
    assert "Max retries" not in message and "HTTPSConnection" not in message, message
    assert not (offline / "cache" / name).exists()  # nothing left behind


def test_the_cli_says_it_in_one_line_and_exits_2(offline: Path, capsys) -> None:
    rc = main(["data", "show", "--set", "dataset.name=cifar10", "--set", "dataset.download=true"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("pflbed: error:")]
    assert rc == 2 and len(err) == 1
    assert "dataset cifar10 (CIFAR-10): download of cifar-10-python.tar.gz failed (no network: name resolution " \
           "failed for www.cs.toronto.edu); instead, unpack https://www.cs.toronto.edu/" in err[0]  # fmt: skip


def _failing(exc: BaseException):
    def download(*args, **kwargs):
        raise exc

    return download


@pytest.mark.parametrize(("exc", "cause"), [
    (requests.ConnectTimeout("pool: timed out"), "www.cs.toronto.edu did not answer in time"),
    (requests.ConnectionError("pool: [Errno 111] Connection refused"), "cannot connect to www.cs.toronto.edu"),
])  # fmt: skip
def test_other_network_failures_say_their_cause(offline: Path, monkeypatch, exc: BaseException, cause: str) -> None:
    monkeypatch.setattr(store, "_download", _failing(exc))
    with pytest.raises(DataError, match=f"dataset cifar10 .*failed \\({cause}\\); instead, unpack ") as info:
        load_dataset("cifar10", download=True)
    assert "dataset.download=true" not in str(info.value)


def test_an_http_error_says_its_status(offline: Path, monkeypatch) -> None:
    response = requests.Response()
    response.status_code, response.reason = 404, "Not Found"
    monkeypatch.setattr(store, "_download", _failing(requests.HTTPError("404 Client Error", response=response)))
    with pytest.raises(DataError, match=r"download of CIFAR-10-C.tar failed \(HTTP 404 Not Found\); instead, unpack"):
        load_dataset("cifar10c", download=True)


def test_fashion_mnist_s_own_download_says_it_the_same_way(offline: Path, monkeypatch) -> None:
    """Fashion-MNIST downloads through its own fetcher (four IDX files, no archive): the same one line."""
    from pflbed.data import fmnist

    monkeypatch.setattr(fmnist, "find_fmnist", lambda path=None: None)  # as on a machine without the Debian package
    with pytest.raises(DataError) as info:
        fmnist.load_fmnist(offline / "fmnist", download=True)
    message = str(info.value)
    assert "\n" not in message and message.startswith("dataset fmnist (Fashion-MNIST): "), message
    assert "no network: name resolution failed" in message and "Max retries" not in message, message
    assert message.endswith("point PFLBED_DATA at a directory holding the four IDX files"), message
