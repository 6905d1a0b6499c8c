"""One real peer in this process (a real DHT on loopback): input validation, mixed precision, schedules, lifetime."""

from __future__ import annotations

import os
from pathlib import Path

import hivemind
import pytest
import torch

import swarm_opt
from swarm_opt import ConfigError, ConfigTypeError
from swarm_opt.simulation import round_values

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(120)]


def make(dht, run_id, model=None, **kwargs):
    model = model or torch.nn.Linear(4, 2)
    kwargs.setdefault("optimizer", lambda p: torch.optim.SGD(p, lr=0.1))
    kwargs.setdefault("params", model.parameters())
    return swarm_opt.Optimizer(dht=dht, run_id=run_id, target_batch_size=kwargs.pop("target", 64),
                               matchmaking_time=1.0, averaging_timeout=5.0, **kwargs), model


def test_bad_arguments_raise_errors_that_name_the_fix(dht):
    model = torch.nn.Linear(2, 1)
    sgd = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    with pytest.raises(ConfigError, match="params is required"):
        swarm_opt.Optimizer(dht=dht, run_id="bad", target_batch_size=8, optimizer=sgd)
    with pytest.raises(ConfigError, match="params is empty"):
        swarm_opt.Optimizer(dht=dht, run_id="bad", target_batch_size=8, optimizer=sgd, params=[])
    with pytest.raises(ConfigError, match="target_batch_size"):
        swarm_opt.Optimizer(dht=dht, run_id="bad", target_batch_size=0, optimizer=sgd, params=model.parameters())
    with pytest.raises(ConfigError, match="batch_size_per_step"):
        swarm_opt.Optimizer(dht=dht, run_id="bad", target_batch_size=8, batch_size_per_step=-1, optimizer=sgd,
                            params=model.parameters())
    with pytest.raises(ConfigTypeError, match="hivemind.DHT"):
        swarm_opt.Optimizer(dht="localhost", run_id="bad", target_batch_size=8, optimizer=sgd,
                            params=model.parameters())
    with pytest.raises(ConfigTypeError, match="optimizer must be"):
        swarm_opt.Optimizer(dht=dht, run_id="bad", target_batch_size=8, optimizer="sgd", params=model.parameters())
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="pass params only with an optimizer factory"):
        swarm_opt.Optimizer(dht=dht, run_id="bad", target_batch_size=8, optimizer=inner, params=model.parameters())
    with pytest.raises(ConfigError, match="scheduler factory"):
        swarm_opt.Optimizer(dht=dht, run_id="bad", target_batch_size=8, optimizer=sgd, params=model.parameters(),
                            scheduler=torch.optim.lr_scheduler.StepLR(inner, 1))
    with pytest.raises(ConfigTypeError, match="strategy"):
        swarm_opt.Optimizer(dht=dht, run_id="bad", target_batch_size=8, optimizer=sgd, params=model.parameters(),
                            strategy="scaffold")
    with pytest.raises(ConfigTypeError, match=r"Groups\(size=...\)"):
        swarm_opt.Optimizer(dht=dht, run_id="bad", target_batch_size=8, optimizer=sgd, params=model.parameters(),
                            strategy=swarm_opt.LocalUpdates(), groups=16)
    with pytest.raises(ConfigError, match="without groups.*groups=None"):  # groups send parameters, not low-rank
        swarm_opt.Optimizer(dht=dht, run_id="bad", target_batch_size=8, optimizer=sgd, params=model.parameters(),
                            groups=swarm_opt.Groups(size=16), compression=swarm_opt.PowerSGD(rank=2))


def test_a_peer_alone_with_groups_is_one_group_and_steps_its_epochs(dht):
    opt, model = make(dht, "alone_in_groups", batch_size_per_step=32, strategy=swarm_opt.LocalUpdates(),
                      groups=swarm_opt.Groups(size=2))
    with opt:
        for _ in range(4):
            opt.zero_grad()
            model(torch.randn(32, 4)).pow(2).mean().backward()
            opt.step()
        assert opt.local_epoch == 2 and opt.last_round.group_size == 1 and not opt.last_round.caught_up


def test_step_without_batch_size_is_rejected_and_nothing_counts(dht):
    opt, model = make(dht, "no_batch_size")
    with opt:
        model(torch.randn(3, 4)).sum().backward()
        with pytest.raises(ConfigError, match=r"step\(batch_size=N\)"):
            opt.step()
        opt.step(batch_size=3)
        assert opt.progress.samples_accumulated == 3
    with pytest.raises(RuntimeError, match="shut down"):
        opt.step(batch_size=3)


def test_scheduler_steps_once_per_global_epoch_and_state_dict_round_trips(dht):
    opt, model = make(dht, "sched", batch_size_per_step=32,
                      scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5))
    with opt:
        for _ in range(6):
            opt.zero_grad()
            model(torch.randn(32, 4)).pow(2).mean().backward()
            opt.step()
        assert opt.local_epoch == 3 and opt.last_round.group_size == 1
        assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)
        state = opt.state_dict()
    again, _ = make(dht, "sched2", model=model,
                    scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5))
    with again:
        again.load_state_dict(state)
        assert again.local_epoch == 3 and again.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)


def test_grad_scaler_skips_non_finite_steps_consistently_and_unscales_first(dht):
    model = torch.nn.Linear(4, 2)
    opt, _ = make(dht, "amp", model=model, target=10_000, batch_size_per_step=8)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x = torch.randn(8, 4)
    with opt:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        assert opt.progress.samples_accumulated == 8
        # the accumulated gradient is the unscaled one
        expected = torch.autograd.grad(model(x).float().pow(2).mean(), model.weight)[0]
        torch.testing.assert_close(round_values(opt.strategy)[0], expected, atol=0.05, rtol=0.05)
        opt.zero_grad()
        scaler.scale(loss.detach().requires_grad_() * float("inf")).backward()  # overflow: the scaler skips step()
        for p in model.parameters():
            p.grad = torch.full_like(p, float("inf"))
        scaler.step(opt)
        scaler.update()
        opt.step()  # without a scaler, non-finite gradients are skipped by swarm_opt itself
        assert opt.progress.samples_accumulated == 8


@pytest.mark.parametrize("scaled, offload", [(False, None), (True, None),
                                              (False, swarm_opt.Offload(pin_memory=False))],
                         ids=["plain", "grad_scaler", "offload"])
def test_clip_grad_norm_clips_the_epochs_accumulated_gradient_once(dht, scaled, offload):
    """Two steps of one epoch with gradients [3, 0] and [0, 4]: the inner step applies their mean [1.5, 2] (norm 2.5)
    clipped to norm 1, [0.6, 0.8] (clipping each step's gradient would apply [0.5, 0.5]); a GradScaler's gradients
    are unscaled before, and with offload the host copies' gradients are clipped. The user's optimizer steps
    unclipped again once the swarm optimizer shut down."""
    model = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    opt, _ = make(dht, f"clip_{scaled}_{offload is not None}", model=model, optimizer=inner, params=None,
                  target=2, batch_size_per_step=1, clip_grad_norm=1.0, offload=offload)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if scaled else None
    with opt:
        for grad in ([3.0, 0.0], [0.0, 4.0]):
            opt.zero_grad()
            loss = (model.weight * torch.tensor([grad])).sum()  # its gradient: grad
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
        assert opt.local_epoch == 1
        torch.testing.assert_close(model.weight.detach(), torch.tensor([[-0.6, -0.8]]))
        assert opt.grad_norm == pytest.approx(2.5)
    assert not inner._optimizer_step_pre_hooks


def test_weights_loaded_after_creation_take_effect(dht):
    model = torch.nn.Linear(4, 2)
    opt, _ = make(dht, "restore", model=model, optimizer=lambda p: torch.optim.SGD(p, lr=0.0), batch_size_per_step=64)
    with opt:
        with torch.no_grad():
            model.weight.fill_(42.0)
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        assert opt.local_epoch == 1
        assert torch.all(model.weight == 42.0)  # hivemind's offloaded copy would have reverted this


def _descendants(pid: int) -> set:
    children = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, set()).add(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.add(child)
            todo.append(child)
    return found


def _command(pid: int) -> bytes:
    """The command line of a live process; b"" once it is gone (a zombie has none either)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _socket_files(pids: set) -> set:
    """The paths of the unix sockets that ``pids`` hold open (from /proc/net/unix: ``... Inode Path``)."""
    inodes = set()
    for pid in pids:
        try:
            links = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
        except OSError:
            continue
        inodes.update(link[len("socket:["):-1] for link in links if link.startswith("socket:["))
    rows = [line.split() for line in Path("/proc/net/unix").read_text().splitlines()[1:]]
    return {row[7] for row in rows if len(row) >= 8 and row[6] in inodes and row[7].startswith("/")}


def test_shutdown_leaves_no_processes_and_no_socket_files_behind():
    """Nor the socket files of the p2p daemon and its clients: hivemind's averager never shut its client down, and a
    file was left in /tmp for every averager ever started (thousands on a machine that runs the tests)."""
    before = _descendants(os.getpid())
    node = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    opt, model = make(node, "lifetime", batch_size_per_step=4)
    assert len(_descendants(os.getpid()) - before) >= 2  # at least the DHT, the averager, their p2pd daemons
    import time

    def ours() -> set:  # torch's shared-memory manager serves the whole process, started by the first shared tensor
        return {pid for pid in _descendants(os.getpid()) - before
                if not _command(pid).startswith(b"torch_shm_manager")}

    files = _socket_files(ours())
    assert len(files) >= 3, files  # the daemon's, the DHT's client, the averager's client
    opt.shutdown()
    opt.shutdown()  # idempotent
    node.shutdown()

    deadline = time.monotonic() + 10
    while ours() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not ours()
    assert not [path for path in files if os.path.exists(path)]


@pytest.mark.parametrize("strategy", ["grad", pytest.param("local", marks=pytest.mark.extended),
                                      pytest.param("scaffold", marks=pytest.mark.extended)])
def test_offloaded_training_equals_training_in_place(dht, strategy):
    """Offload() moves the optimizer onto host copies of the parameters; the arithmetic must not change."""
    make_strategy = {"grad": swarm_opt.GradientAveraging, "local": swarm_opt.LocalUpdates,
                     "scaffold": swarm_opt.Scaffold}[strategy]
    finals = []
    # in place; offloaded with an optimizer factory; offloaded with a ready optimizer (its groups re-pointed)
    for offload, ready in ((None, False), (swarm_opt.Offload(), False), (swarm_opt.Offload(), True)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        inner = dict(optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), params=None) if ready else \
            dict(optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
        opt, _ = make(dht, f"offload_{strategy}_{offload is not None}_{ready}", model=model, batch_size_per_step=16,
                      target=32, strategy=make_strategy(), offload=offload, **inner)
        data = torch.Generator().manual_seed(1)
        with opt:
            if offload is not None:
                assert all(m is not p for m, p in zip(opt.param_groups[0]["params"], model.parameters()))
            for _ in range(8):
                opt.zero_grad()
                model(torch.randn(16, 4, generator=data)).pow(2).mean().backward()
                opt.step()
            assert opt.local_epoch == 4
        finals.append([p.detach().clone() for p in model.parameters()])
    for in_place, *offloaded in zip(*finals):
        for tensor in offloaded:
            torch.testing.assert_close(tensor, in_place, rtol=0, atol=0)
    torch.manual_seed(0)
    initial = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).parameters()
    assert any((p - q).abs().max() > 1e-3 for p, q in zip(finals[0], initial))  # training did move the model


def test_offload_keeps_weights_and_state_the_user_loads(dht):
    """hivemind's offloaded optimizer reverts weights loaded into the model after its creation (lr=0: 42 -> 0.36);
    ours takes them up at the next step, for gradient averaging (params change at rounds) and local updates."""
    for strategy in (swarm_opt.GradientAveraging(), swarm_opt.LocalUpdates()):
        model = torch.nn.Linear(4, 2)
        opt, _ = make(dht, f"offload_restore_{strategy.name}", model=model, batch_size_per_step=64,
                      optimizer=lambda p: torch.optim.SGD(p, lr=0.0), strategy=strategy, offload=swarm_opt.Offload())
        with opt:
            model(torch.randn(2, 4)).sum().backward()
            opt.step()  # a round: masters and model agree
            model.load_state_dict({"weight": torch.full((2, 4), 42.0), "bias": torch.zeros(2)})
            opt.zero_grad()
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            assert opt.local_epoch == 2
            assert torch.all(model.weight == 42.0)
            assert torch.all(opt.param_groups[0]["params"][0] == 42.0)  # the host copy followed the model


def test_offload_needs_a_factory_or_an_optimizer_that_has_not_stepped(dht):
    model = torch.nn.Linear(2, 1)
    stepped = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    stepped.step()
    with pytest.raises(ConfigError, match="has not stepped yet"):
        swarm_opt.Optimizer(dht=dht, run_id="bad", target_batch_size=8, offload=swarm_opt.Offload(), optimizer=stepped)
    with pytest.raises(ConfigError, match="needs the parameters"):
        swarm_opt.Optimizer(dht=dht, run_id="bad", target_batch_size=8, offload=swarm_opt.Offload(),
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    with pytest.raises(ConfigTypeError, match="Offload"):
        swarm_opt.Optimizer(dht=dht, run_id="bad", target_batch_size=8, offload=True, params=model.parameters(),
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    with pytest.raises(ConfigTypeError, match="pin_memory"):
        swarm_opt.Offload(pin_memory="yes")


_LEAVE_AFTER_THE_DHT = """
import hivemind, torch, swarm_opt
node = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
model = torch.nn.Linear(4, 2)
opt = swarm_opt.Optimizer(dht=node, run_id="dht_first", target_batch_size=16, batch_size_per_step=4,
                          params=model.parameters(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
node.shutdown()
opt.shutdown()
print(opt._averager._engine.exitcode)
"""


def test_leaving_after_the_dht_is_gone_is_quiet():
    """The averager process removes its handlers from the DHT's p2p daemon when it stops; if the daemon went first
    (the DHT was shut down, or its process died), hivemind printed a FileNotFoundError traceback from a thread.
    In a fresh interpreter: pytest's own threading.excepthook would swallow the traceback in the forked child."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _LEAVE_AFTER_THE_DHT], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "0", (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and "Error" not in done.stderr, done.stderr


_LEAVE_WHILE_THE_DHT_IS_BUSY = """
import os, time
from multiprocessing import resource_sharer
import hivemind, torch, swarm_opt

fetch = resource_sharer._ResourceSharer.get_connection
def fetch_or_report(ident):  # the DHT process fetching the reply pipe of a call from the process that sent it
    try:
        return fetch(ident)
    except Exception as e:
        print("lost a call:", repr(e), flush=True)
        raise
resource_sharer._ResourceSharer.get_connection = staticmethod(fetch_or_report)

async def hold(dht, node):
    time.sleep(1.5)  # the DHT process's loop is busy: calls wait in its pipe, unread

node = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
model = torch.nn.Linear(4, 2)
opt = swarm_opt.Optimizer(dht=node, run_id="busy_dht", target_batch_size=16, batch_size_per_step=16,
                          params=model.parameters(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
model(torch.randn(16, 4)).sum().backward()
opt.step()  # a founder: it offers its state
node.run_coroutine(hold, return_future=True)
time.sleep(0.5)
opt._averager._engine.allow_state_sharing = False  # the averager process withdraws its offer: a DHT call
time.sleep(0.3)
opt._averager.shutdown()  # its process exits while that call still waits in the DHT's pipe
try:  # read after the averager's call: the DHT has handled that one by the time it answers this one
    node.get("anything", return_future=True).result(timeout=10)
except Exception as e:
    print("no answer:", repr(e), flush=True)
print("dht alive:", node.is_alive(), flush=True)
opt.shutdown()
node.shutdown()
"""


def test_an_averager_leaving_while_the_dht_is_busy_loses_none_of_its_calls():
    """Each hivemind DHT call carries a future whose reply pipe the DHT process fetches from the calling process when
    it reads the call. An averager process that exited with a call still unread made the DHT process fail that
    fetch: a lost call, or (EOFError, which hivemind's read loop does not catch) a dead DHT, on which every later
    Optimizer of the process hung (seen in this module about one run in three). It now waits, bounded, until the
    DHT has read its calls."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _LEAVE_WHILE_THE_DHT_IS_BUSY], capture_output=True, text=True,
                          timeout=90)
    assert done.returncode == 0 and "dht alive: True" in done.stdout, (done.stdout, done.stderr)
    assert "lost a call" not in done.stdout, done.stdout


_PEER_UNTIL_CTRL_C = """
import signal, sys, threading, time
import torch, swarm_opt
from hivemind.utils import get_dht_time
from swarm_opt._hivemind.node import start_dht

interrupted = threading.Event()
signal.signal(signal.SIGINT, lambda *_: interrupted.set())
dht = start_dht(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
model = torch.nn.Linear(4, 2)
opt = swarm_opt.Optimizer(dht=dht, run_id="ctrl_c", target_batch_size=16, batch_size_per_step=4,
                          params=model.parameters(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
print("ready", flush=True)
for _ in range(600):  # short waits: a signal that lands on another thread runs its handler at the next one
    if interrupted.wait(0.1):
        break
else:
    sys.exit("no Ctrl-C came")
time.sleep(0.5)  # whatever Ctrl-C kills dies meanwhile
expires = get_dht_time() + 60
dht.store("after_ctrl_c", "still here", expiration_time=expires, return_future=True).result(timeout=20)
print("dht", dht.get("after_ctrl_c", latest=True, return_future=True).result(timeout=20).value, flush=True)
opt.shutdown()
dht.shutdown()
"""


def _start_script(source: str):
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", source], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    assert proc.stdout.readline().strip() == "ready", proc.communicate(timeout=30)
    return proc


def test_ctrl_c_in_a_terminal_leaves_the_network_up_until_the_peer_has_left():
    """A terminal sends Ctrl-C to the whole foreground process group. The user's process must decide when to leave:
    hivemind's p2p daemon (spawned through libuv, which resets ignored signals) died at once, under a peer still
    finishing its step. start_dht() runs the DHT and its daemon in a process group of their own. torch's
    shared-memory manager, started by the DHT's first future, leaves the group too, but only once it runs: it is
    born with SIGINT blocked, so that a Ctrl-C before it left cannot kill it half-way through its handshake (its
    caller then waited for ever)."""
    import signal

    proc = _start_script(_PEER_UNTIL_CTRL_C)
    managers = [pid for pid in _descendants(proc.pid) if _command(pid).startswith(b"torch_shm_manager")]
    assert managers, "the peer started no torch_shm_manager"
    for pid in managers:
        status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        assert (int(status["SigBlk"], 16) | int(status["SigIgn"], 16)) & (1 << (signal.SIGINT - 1)), status
    try:
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0 and "dht still here" in out, (out, err)
    assert "Traceback" not in err, err


def test_a_peer_killed_alone_leaves_no_processes_behind():
    """SIGKILL to the user's process only (not its group): the averager process, the DHT process (in a group of its
    own) and its p2p daemon end with it instead of living on as orphans."""
    import signal
    import time

    proc = _start_script(_PEER_UNTIL_CTRL_C)
    helpers = {pid for pid in _descendants(proc.pid) if not _command(pid).startswith(b"torch_shm_manager")}
    assert len(helpers) >= 3, helpers  # DHT, p2pd, averager
    proc.kill()
    proc.wait(10)
    deadline = time.monotonic() + 10
    while {pid for pid in helpers if _command(pid)} and time.monotonic() < deadline:
        time.sleep(0.1)
    left = {pid: _command(pid) for pid in helpers if _command(pid)}
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, left


def test_ctrl_c_still_reaches_the_training_loop_after_creating_an_optimizer(dht):
    """hivemind's averager start-up sets SIGINT to 'ignore' in the calling process: a training script would no
    longer stop on Ctrl-C. Ours restores the caller's handler; only the averager process ignores SIGINT."""
    import signal

    before = signal.getsignal(signal.SIGINT)
    opt, _ = make(dht, "sigint")
    with opt:
        assert signal.getsignal(signal.SIGINT) is before
        child = opt._averager._engine.pid
        ignored = int(next(line for line in Path(f"/proc/{child}/status").read_text().splitlines()
                           if line.startswith("SigIgn:")).split()[1], 16)
        assert ignored & (1 << (signal.SIGINT - 1)), "the averager process must leave Ctrl-C to its parent"



def test_the_gloo_lane_refuses_an_aggregation_it_cannot_apply(dht):
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ConfigError, match="drop transport= or aggregation="):
        swarm_opt.Optimizer(dht=dht, run_id="lane_agg", target_batch_size=8, params=model.parameters(),
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.1), transport=swarm_opt.Gloo(),
                            aggregation=swarm_opt.CenteredClip())
