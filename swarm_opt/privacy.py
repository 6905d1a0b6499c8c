"""Sample-level differential privacy (DP-SGD) with Opacus: where it is sound in a swarm, and the ε each peer spent.

Each peer makes its own model, optimizer and data loader private with Opacus and passes the private optimizer as the
swarm's inner optimizer, with an ``OpacusPrivacy`` that names the δ to report ε at (``pip install swarm_opt[dp]``)::

    engine = opacus.PrivacyEngine(accountant="rdp")
    model, dp_sgd, loader = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                                data_loader=loader, noise_multiplier=1.1, max_grad_norm=1.0)
    privacy = swarm_opt.OpacusPrivacy(engine, delta=1e-5)
    opt = swarm_opt.Optimizer(dht=dht, run_id="run", target_batch_size=4096, optimizer=dp_sgd,
                              strategy=swarm_opt.LocalUpdates(), privacy=privacy)
    for x, y in loader:
        ...; loss.backward(); opt.step(batch_size=dp_sgd.expected_batch_size)   # rounds log "ε 2.31 at δ 1e-05"

When it is sound
----------------
A peer's ε is what its own accountant says, over its own DP-SGD steps, if and only if everything the peer lets out
(the tensors of every round, the state it serves newcomers, what it gathers and publishes) is computed from the
outputs of those steps alone: post-processing, which costs no privacy. Rounds then add nothing to ε, and the models
coming back from groupmates are post-processing of *their* private steps. Per strategy:

* ``LocalUpdates`` (FedAvg): every ``step()`` is a DP-SGD step (Opacus clips each sample's gradient to
  ``max_grad_norm`` and adds Gaussian noise inside the inner step); a round averages the resulting parameters (and
  optimizer statistics, themselves built from noised gradients). Sound.
* ``Scaffold``: the correction ``p ← p − η (c − c_i)`` after each DP-SGD step uses controls computed from earlier
  rounds' parameter differences ``(x − y_i) / Σ η``, all post-processing; the extra tensor a round averages is too.
  Sound. (The controls then carry the DP noise of the steps they summarise; that is variance, not a leak.) Opacus's
  ``BatchMemoryManager`` is not supported with it: its skipped virtual steps would count as completed steps.
* ``DiLoCo``: DP-SGD inner steps; the outer step applies ``x − mean(y_i)``, post-processing. Sound.
* ``FedProx(mu > 0)`` and ``FedProx(adaptive=...)`` (whose μ grows): refused. Its proximal term is added to
  ``p.grad`` before the inner step, but Opacus's ``DPOptimizer`` replaces ``p.grad`` with the clipped, noised
  per-sample gradients: the term would be dropped without a word (privacy intact, algorithm silently FedAvg).
  Adding it after the noise would be sound (it does not read the data) but is FedProx's to do.
* ``GradientAveraging`` (with or without ``Overlap``): refused. It averages the raw ``p.grad`` accumulated over the
  round's local steps and calls the inner step once per round, after the exchange: the gradients that leave the peer
  are neither clipped nor noised, and the round's DP step would use the per-sample gradients of the last micro-batch
  only. Private gradient averaging would clip and noise each local step's gradient before accumulating it.
* Any other strategy: refused until someone has checked it the same way.

Two more things a peer lets out, and what to do about them: the samples it reports (progress records, averaging
weights) are the ``batch_size`` given to ``step()``; with Opacus's Poisson sampling the actual size of a batch depends
on who is in the data set, which the accountant does not cover, so pass the *expected* batch size
(``dp_sgd.expected_batch_size``), as Opacus itself normalises by it. And the loss in the log line is computed on private
data without noise: it stays in the local log, never on the network.

ε is Opacus's accountant's, ``engine.get_epsilon(delta)``, over this peer's steps at its own sample rate and noise; a
peer that catches up by downloading the swarm's state keeps its ε (it took no step on its data). The accountant's
history is this peer's own and never travels (it is not part of the optimizer's state, which newcomers download);
checkpoint it yourself, or a resumed peer would report only the ε of its steps since the restart::

    ckpt.maybe_save(opt, model, extra={"privacy": privacy.state_dict()})
    restored = ckpt.restore(opt, model)
    if restored is not None:
        privacy.load_state_dict(restored["extra"]["privacy"])
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict

from swarm_opt.errors import ConfigError, ConfigTypeError, IncompatibleStateError

__all__ = ["OpacusPrivacy"]


def _opacus() -> Any:
    try:
        import opacus
    except ImportError as e:
        raise ImportError("differential privacy needs Opacus: pip install 'swarm_opt[dp]'") from e
    return opacus


@dataclass(frozen=True)
class OpacusPrivacy:
    """A peer's DP-SGD with Opacus: checks that the swarm's strategy keeps it private (see the module docstring) and
    reports the privacy spent, ε at ``delta``, in every round's log line.

    :param engine: the ``opacus.PrivacyEngine`` whose ``make_private`` made the inner optimizer.
    :param delta: the δ to report ε at, in (0, 1); typically below 1 / (samples in this peer's data set).
    """

    engine: Any
    delta: float
    #: the last ε and the accountant's history it was computed from, and each (noise, rate)'s RDP of one step
    _last: Dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.engine, _opacus().PrivacyEngine):
            raise ConfigTypeError(f"OpacusPrivacy needs the opacus.PrivacyEngine that made the private optimizer, "
                                  f"got {self.engine!r}")
        if isinstance(self.delta, bool) or not isinstance(self.delta, (int, float)) or not 0 < self.delta < 1:
            raise ConfigError(f"OpacusPrivacy(delta={self.delta!r}) must be in (0, 1), e.g. 1e-5 (below 1 / the "
                              f"number of samples of this peer's data set)")

    def epsilon(self) -> float:
        """The privacy this peer has spent so far: ε at ``delta`` over its DP-SGD steps (0 before the first).

        With Opacus's RDP accountant (its default), the RDP of one step is computed once per (noise, sample rate)
        and scaled by the steps, as the accountant does in every call (~30 ms, at every round on every peer):
        the same ε, bit for bit. Other accountants are asked once per history."""
        accountant = self.engine.accountant
        history = accountant.history
        if not history:
            return 0.0
        key = repr(history)  # a few (noise, rate, steps) entries: Opacus merges repeated steps
        if self._last.get("history") != key:
            if accountant.mechanism() == "rdp":
                from opacus.accountants.analysis import rdp

                orders, one_step = accountant.DEFAULT_ALPHAS, self._last.setdefault("rdp", {})
                for noise, rate, _ in history:
                    if (noise, rate) not in one_step:
                        one_step[(noise, rate)] = rdp.compute_rdp(q=rate, noise_multiplier=noise, steps=1,
                                                                  orders=orders)
                total = sum([one_step[(noise, rate)] * steps for noise, rate, steps in history])
                epsilon = rdp.get_privacy_spent(orders=orders, rdp=total, delta=self.delta)[0]
            else:
                epsilon = self.engine.get_epsilon(self.delta)
            self._last.update(history=key, epsilon=float(epsilon))
        return self._last["epsilon"]

    def state_dict(self) -> Dict[str, Any]:
        """The accountant's history (what ε is computed from), for this peer's checkpoints."""
        return dict(self.engine.accountant.state_dict())

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore ``state_dict()``'s output (a checkpoint of this peer's own privacy spending)."""
        if not isinstance(state, dict) or not isinstance(state.get("history"), list):
            raise IncompatibleStateError("expected OpacusPrivacy.state_dict()'s output (an accountant's history)")
        self.engine.accountant.load_state_dict(state)

    def log_suffix(self) -> str:
        """What a round's log line says about privacy."""
        epsilon = self.epsilon()
        return f", ε {epsilon:.6g} at δ {self.delta:g}" if math.isfinite(epsilon) else f", ε ∞ at δ {self.delta:g}"

    def check(self, strategy: Any, inner: Any) -> None:
        """Refuse an inner optimizer that is not Opacus-private, or a strategy that would let un-noised data out."""
        self.check_optimizer(inner)
        self.check_strategy(strategy)

    def check_optimizer(self, inner: Any) -> None:
        """Refuse an inner optimizer that is not Opacus-private (``engine.make_private(...)``'s)."""
        opacus = _opacus()
        if not isinstance(inner, opacus.optimizers.DPOptimizer):
            raise ConfigError(f"privacy=OpacusPrivacy(...) needs the private optimizer that engine.make_private(...) "
                              f"returned as optimizer=, got {type(inner).__name__}")

    def check_strategy(self, strategy: Any) -> None:
        """Refuse a strategy that would let un-noised data out (``Strategy.privacy_refusal``: a class declares
        ``dp_safe`` for itself)."""
        refusal = strategy.privacy_refusal()
        if refusal is not None:
            raise ConfigError(refusal)
