import os
import time
from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "swarm: real multi-peer swarms on loopback (separate processes)")
    config.addinivalue_line("markers", "slow: takes more than a minute")
    config.addinivalue_line("markers", "extended: long swarm scenarios the default run skips to stay within CI's "
                                       "budget; run them with `bash scripts/test_extended.sh`")
    config.addinivalue_line("markers", "solo: an extended scenario whose swarm alone fills a 2-core machine; "
                                       "`scripts/test_extended.sh` runs it after the others, by itself")


@pytest.fixture(autouse=True)
def restored_environment():
    """Every test leaves the process environment as it found it: Lightning's Trainer writes its rank variables
    (``LOCAL_RANK``, ``WORLD_SIZE``, ...) into it and keeps them, and a swarm test later in the same worker passes its
    environment to its peers, where Hugging Face's ``TrainingArguments`` takes them for a torchrun launch."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


def descendants() -> set:
    """Live (non-zombie) processes descended from this one, read from /proc; torch's process-wide shared-memory
    manager, which torch starts once and keeps for the life of the process, does not count."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if fields[0] != "Z" and not stat.split(" (", 1)[1].startswith("torch_shm_manag"):
                parents[int(entry)] = int(fields[1])
    found, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


@pytest.fixture
def no_leftovers():
    before = descendants()
    yield
    deadline = time.monotonic() + 10
    while descendants() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not descendants() - before, "the swarm callback left processes behind"
