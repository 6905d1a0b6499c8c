"""Starting a hivemind DHT node for the command line: addresses checked up front, a persistent identity, signals.

Everything a user types (multiaddrs, ports, identity files) is checked here before hivemind sees it, so that a
mistake is reported in one line (``ConfigError``) instead of a traceback from a background process.

Signals: a terminal's Ctrl-C reaches every process of the foreground group, including hivemind's DHT and averager
processes and the Go ``p2pd`` daemon, which would die before this peer could leave the swarm cleanly. Python
processes forked inside ``children_ignore_sigint()`` (``swarm_opt._hivemind.fork``) ignore SIGINT, so only the main
process reacts and shuts them down in order. The daemon does not inherit it (hivemind spawns it through libuv, which
resets every signal), so the DHT process and its daemon live in a process group of their own
(``swarm_opt._hivemind.dht_process``).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from pathlib import Path
from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Tuple

from swarm_opt.errors import ConfigError

if TYPE_CHECKING:
    from swarm_opt.auth import PrivateRun

DEFAULT_HOST_MADDRS = ("/ip4/0.0.0.0/tcp/0",)
DEFAULT_JOIN_TIMEOUT = 60.0
logger = logging.getLogger(__name__)


def parse_maddrs(values: Optional[Sequence[str]], *, option: str, need_peer_id: bool = False) -> List[str]:
    """Check each multiaddr; ``need_peer_id`` for addresses to dial (they must end in ``/p2p/PEER_ID``)."""
    from hivemind.utils.multiaddr import Multiaddr

    checked = []
    for value in values or ():
        try:
            maddr = Multiaddr(value)
        except Exception as e:
            raise ConfigError(f"{option}: '{value}' is not a valid multiaddr ({e}); "
                              f"expected e.g. /ip4/203.0.113.5/tcp/31337/p2p/QmPeerId...") from None
        if need_peer_id and "p2p" not in [p.name for p in maddr.protocols()]:
            raise ConfigError(f"{option}: '{value}' has no /p2p/PEER_ID part; copy the whole address that "
                              f"'swarm-opt dht' printed")
        checked.append(str(maddr))
    return checked


def check_ports_free(host_maddrs: Sequence[str]) -> None:
    """Fail early, in one line, if a fixed TCP port to listen on is taken (hivemind only says its daemon died)."""
    from hivemind.utils.multiaddr import Multiaddr

    for value in host_maddrs:
        maddr = Multiaddr(value)
        names = [p.name for p in maddr.protocols()]
        if "tcp" not in names or not ({"ip4", "ip6"} & set(names)):
            continue
        port = int(maddr.value_for_protocol("tcp"))
        if port == 0:
            continue
        family, host = ((socket.AF_INET, maddr.value_for_protocol("ip4")) if "ip4" in names
                        else (socket.AF_INET6, maddr.value_for_protocol("ip6")))
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise ConfigError(f"port {port} is already in use ({value}); stop what uses it or choose "
                                      f"another port, e.g. /ip4/0.0.0.0/tcp/0 for any free port") from None
                raise ConfigError(f"cannot listen on {value}: {e.strerror or e}") from None


def ensure_identity(path: str) -> str:
    """Create the identity file with hivemind's own key generation if it is missing; return its peer id.

    The key is written to a temporary file and renamed into place, so an interrupted start never leaves a
    truncated identity behind."""
    from hivemind.p2p import P2P, PeerID

    target = Path(path).expanduser()
    if target.is_dir():
        raise ConfigError(f"--identity-path '{path}' is a directory; give a file name, e.g. {path}/dht.id")
    if not target.exists():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
            P2P.generate_identity(str(tmp))  # RSA key as a libp2p protobuf, mode 0o400
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except OSError as e:
            raise ConfigError(f"cannot create the identity file '{path}': {e.strerror or e}") from None
    try:
        return PeerID.from_identity(target.read_bytes()).to_base58()
    except OSError as e:
        raise ConfigError(f"cannot read the identity file '{path}': {e.strerror or e}") from None
    except Exception:
        raise ConfigError(f"'{path}' is not a hivemind identity file; remove it to generate a new one") from None


def start_dht(
    *,
    initial_peers: Sequence[str] = (),
    host_maddrs: Sequence[str] = DEFAULT_HOST_MADDRS,
    announce_maddrs: Sequence[str] = (),
    client_mode: bool = False,
    identity_path: Optional[str] = None,
    private_run: Optional[PrivateRun] = None,
    join_timeout: float = DEFAULT_JOIN_TIMEOUT,
    stop: Optional[threading.Event] = None,
):
    """A started ``hivemind.DHT``; raises ``ConfigError`` with one line on bad input or a failed start. Started from
    the main thread, the DHT and its p2p daemon run in a process group of their own
    (``swarm_opt._hivemind.dht_process``).
    With ``private_run``, only peers holding the same credentials can talk to it (``swarm_opt.auth``).
    When none of ``initial_peers`` answers, it says which and why in one line and, while one of them cannot be
    reached at all (it may be starting, or its link down), tries again with a growing pause for up to
    ``join_timeout`` seconds (0: one try). The DHT re-bootstraps by itself whenever it later loses sight of
    the swarm (``swarm_opt._hivemind.rebootstrap``). Once ``stop`` is set (a command's first Ctrl-C), it gives up
    its wait and raises ``KeyboardInterrupt``, leaving nothing behind."""
    from swarm_opt._hivemind.dht_process import OwnGroupDHT, SturdyDHT
    from swarm_opt._hivemind.rebootstrap import watch_dht

    initial_peers = parse_maddrs(initial_peers, option="--initial-peers", need_peer_id=True)
    host_maddrs = parse_maddrs(host_maddrs, option="--host-maddrs")
    announce_maddrs = parse_maddrs(announce_maddrs, option="--announce-maddrs")
    if not client_mode:
        check_ports_free(host_maddrs)
    if identity_path is not None:
        ensure_identity(identity_path)
    kwargs = dict(initial_peers=initial_peers, client_mode=client_mode, start=False)
    if not client_mode:
        kwargs.update(host_maddrs=host_maddrs)
        if announce_maddrs:
            kwargs.update(announce_maddrs=announce_maddrs)
    if identity_path is not None:
        kwargs.update(identity_path=str(Path(identity_path).expanduser()))
    if private_run is not None:
        kwargs.update(authorizer=private_run.authorizer())
    deadline, pause = time.monotonic() + join_timeout, 2.0
    listening = False  # whether every initial peer's port accepted connections at the last probe
    while True:
        try:
            dht = _started(OwnGroupDHT if threading.current_thread() is threading.main_thread() else SturdyDHT,
                           kwargs, stop)
            watch_dht(dht, initial_peers)
            if not client_mode:  # peers of the run tell newcomers whether they can reach them (swarm-opt doctor)
                _serve_dial_back(dht)
            return dht
        except Exception as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            reason = re.sub(r"\d{4}/\d\d/\d\d \d\d:\d\d:\d\d ", "", reason)  # p2pd's own timestamp
            if not (initial_peers and _is_bootstrap_failure(reason)):
                raise ConfigError(f"could not start the DHT node: {reason}{_hint(initial_peers, private_run)}") \
                    from None
        probes = probe_initial_peers(initial_peers)
        why = "; ".join(f"{maddr} ({answer})" for maddr, answer in probes)
        left = deadline - time.monotonic()
        if all(answer == _LISTENING for _, answer in probes):
            if listening:  # up at the try too: waiting will not change their answer (e.g. a wrong peer id)
                raise ConfigError(f"could not start the DHT node: {reason}: {why}"
                                  f"{_hint(initial_peers, private_run)}") from None
            listening = True  # up now, maybe not at the try (a link that just came back, a node just started)
            continue
        listening = False
        if left < 1.0:
            raise ConfigError(f"could not start the DHT node: {reason} (tried for {join_timeout:.0f} s): "
                              f"{why}{_hint(initial_peers, private_run)}") from None
        pause = min(pause, left)
        logger.warning(f"none of the initial peers answered: {why}; trying again in {pause:.0f} s "
                       f"(for up to {left:.0f} s more)")
        if stop is None:
            time.sleep(pause)
        elif stop.wait(pause):
            raise KeyboardInterrupt
        pause = min(pause * 2, 30.0)


def _started(dht_type: type, kwargs: dict, stop: Optional[threading.Event]) -> Any:
    """A DHT of ``dht_type`` once it is ready. The DHT process ignores Ctrl-C; this one does not: a Ctrl-C while the
    DHT joins the swarm, which may take a while, stops this process (at once, or once ``stop`` is set), and the
    half-started DHT with it."""
    from swarm_opt._hivemind.fork import forking_helper

    with forking_helper() as heap:  # also torch's shared-memory manager, which the DHT's first future starts
        dht = dht_type(**kwargs)
        dht.shared_heap = heap  # told when the DHT shuts down (SturdyDHT.shutdown)
        dht.run_in_background(await_ready=False)
    try:
        while True:
            try:
                dht.wait_until_ready(timeout=None if stop is None else 0.2)
                break
            except FutureTimeoutError:
                if stop.is_set():
                    raise KeyboardInterrupt from None
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt):
            dht.terminate()  # an OwnGroupDHT takes its p2p daemon down with it
            dht.join(5.0)
        heap.ended()
        raise
    return dht


def _is_bootstrap_failure(reason: str) -> bool:
    """Did a DHT fail to start only because none of its initial peers answered? p2pd says so when it cannot dial
    any of them, ``DHTNode.create`` when none answers its ping."""
    return "failed to connect to bootstrap peers" in reason or "none of the initial_peers responded" in reason


def _hint(initial_peers: Sequence[str], private_run: Optional[PrivateRun]) -> str:
    doctor = "; 'swarm-opt doctor --initial-peers ...' tells which address fails and why"
    if initial_peers and private_run is not None:
        return ("; check that --initial-peers are reachable and up, and that this peer holds the run's "
                "credentials (the same --run-secret-file; its peer id in their --allow-peers)" + doctor)
    if initial_peers:
        return ("; check that --initial-peers are reachable and up, and, if the run is private, pass its "
                "secret with --run-secret-file" + doctor)
    return ""


def _serve_dial_back(dht: Any) -> None:
    from swarm_opt._hivemind.dial_back import serve_dial_back

    try:
        dht.run_coroutine(serve_dial_back)
    except Exception as e:  # a nicety: never a reason not to start
        logger.debug(f"Could not serve dial-back requests: {e!r}")


def probe_initial_peers(maddrs: Sequence[str], timeout: float = 3.0) -> List[Tuple[str, str]]:
    """(address, why it did not answer) for each initial peer, from one TCP connection to each: the p2p daemon says
    only that none answered."""
    with ThreadPoolExecutor(max_workers=min(16, max(1, len(maddrs)))) as pool:
        return list(zip(maddrs, pool.map(functools.partial(_probe, timeout=timeout), maddrs)))


_LISTENING = "its port accepts connections, but no DHT peer with this peer id answered there"


def _probe(value: str, timeout: float) -> str:
    from hivemind.utils.multiaddr import Multiaddr

    maddr = Multiaddr(value)
    names = [p.name for p in maddr.protocols()]
    host_protocol = next((name for name in ("ip4", "ip6", "dns", "dns4", "dns6") if name in names), None)
    if host_protocol is None or "tcp" not in names:
        return "no TCP address to probe"
    address = (maddr.value_for_protocol(host_protocol), int(maddr.value_for_protocol("tcp")))
    try:
        with socket.create_connection(address, timeout=timeout):
            return _LISTENING
    except TimeoutError:
        return f"no answer within {timeout:.0f} s"
    except OSError as e:
        return (e.strerror or str(e)).lower()
