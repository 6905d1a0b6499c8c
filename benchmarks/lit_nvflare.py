"""``lit_plain.py`` with NVFlare's Lightning client API, as NVFlare's hello-lightning client does it: patch the
trainer, then one ``trainer.fit`` per round while the server runs (FedAvg or SCAFFOLD: the server's recipe decides).
NVFlare's simulator runs this script for every site (``vs_nvflare.py``)."""
import lit_mnist
import nvflare.client.lightning as flare
import pytorch_lightning as pl

args = lit_mnist.parse_args()
flare.init()
args.rank = int(flare.get_site_name().split("-")[-1]) - 1  # NVFlare's sites are site-1 ... site-N
module = lit_mnist.classifier(pl)(seed=args.seed, lr=args.lr)
# max_epochs=1: with max_epochs=-1 NVFlare 2.9.0's patch re-reads max_steps as the round's length after every round, so
# the local steps double each round (5, 10, 20, 40); a positive max_epochs makes it read them once
trainer = pl.Trainer(max_epochs=1, max_steps=args.steps, precision=args.precision, accelerator="cpu", devices=1,
                     callbacks=[lit_mnist.rounds_callback(pl, args)], logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)
flare.patch(trainer)
data = lit_mnist.loader(args)
while flare.is_running():
    flare.receive()
    trainer.fit(module, data)
