"""A plain Lightning script: one client trains the MNIST-5k classifier on its shard alone (``lit_mnist.py``).
``lit_nvflare.py`` and ``lit_swarm.py`` are this script federated; ``vs_nvflare.py`` counts the lines they change."""
import lightning.pytorch as pl
import lit_mnist

args = lit_mnist.parse_args()
module = lit_mnist.classifier(pl)(seed=args.seed, lr=args.lr)
trainer = pl.Trainer(max_steps=args.steps * args.rounds, precision=args.precision, accelerator="cpu", devices=1,
                     callbacks=[lit_mnist.rounds_callback(pl, args)], logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)
trainer.fit(module, lit_mnist.loader(args))
