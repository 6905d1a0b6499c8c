"""``lit_plain.py`` as a swarm_opt peer: one callback, no server. ``vs_nvflare.py`` starts one process per peer;
``lit_mnist.initial_peers`` hands them the first peer's addresses (what a user shares by hand). The run's length is
the swarm's: the benchmark's callback stops at epoch ``--rounds`` (a peer that stopped at a step count could leave
before the last round it computed a share of)."""
import lightning.pytorch as pl
import lit_mnist

import swarm_opt
from swarm_opt.lightning import SwarmCallback

args = lit_mnist.parse_args()
module = lit_mnist.classifier(pl)(seed=args.seed, lr=args.lr)
swarm = SwarmCallback(run_id="vs_nvflare", initial_peers=lit_mnist.initial_peers(args), batch_size=args.batch_size,
                      target_batch_size=args.peers * args.steps * args.batch_size,
                      strategy=getattr(swarm_opt, args.strategy)(), tracker=swarm_opt.TrackerConfig(shares="equal"))
trainer = pl.Trainer(max_steps=-1, precision=args.precision, accelerator="cpu", devices=1,
                     callbacks=[swarm, lit_mnist.rounds_callback(pl, args)], logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)
trainer.fit(module, lit_mnist.loader(args))
