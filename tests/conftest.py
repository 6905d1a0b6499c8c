import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "swarm: real multi-peer swarms on loopback (separate processes)")
    config.addinivalue_line("markers", "slow: takes more than a minute")
    config.addinivalue_line("markers", "extended: long swarm scenarios the default run skips to stay within CI's "
                                       "budget; run them with `bash scripts/test.sh -m extended`")
