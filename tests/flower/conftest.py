import uuid

import pytest

from .processes import MARK


@pytest.fixture
def deployment_mark(monkeypatch) -> str:
    """A mark in this test's environment, inherited by every process its deployments start (`processes.py`)."""
    mark = uuid.uuid4().hex
    monkeypatch.setenv(MARK, mark)
    return mark
