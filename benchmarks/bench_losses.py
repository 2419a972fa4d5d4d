"""Forward+backward time of our raw_vthm and proxy_anchor against pytorch-metric-learning's
MultiSimilarityMiner + MultiSimilarityLoss and ProxyAnchorLoss, on CPU, embedding 512, K=4,
batch 128/256/512/1024 (median of repeats after warm-up), with the ratio printed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from training.losses import build_loss


def timed(step, repeats: int) -> float:
    for _ in range(3):
        step()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def training_step(loss_fn, base: torch.Tensor, labels: torch.Tensor, miner=None):
    """One forward+backward from fresh leaf embeddings (the miner, if any, runs inside it)."""

    def run() -> None:
        x = base.clone().requires_grad_(True)
        value = loss_fn(x, labels, miner(x, labels)) if miner is not None else loss_fn(x, labels)
        value.backward()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    from pytorch_metric_learning import losses as pml_losses
    from pytorch_metric_learning import miners as pml_miners

    torch.set_num_threads(2)
    repeats = 5 if args.quick else 30
    dim, per_class = 512, 4
    print(f"CPU forward+backward, embedding {dim}, K={per_class}, median of {repeats} (ms); ratio = pml / ours")
    print(
        f"{'batch':>6} {'raw_vthm':>9} {'pml MS+miner':>13} {'ratio':>6} "
        f"{'proxy_anchor':>13} {'pml PA':>8} {'ratio':>6}"
    )
    for batch in (128, 256, 512, 1024):
        classes = batch // per_class
        labels = torch.arange(classes).repeat_interleave(per_class)
        base = torch.randn(batch, dim)
        ours_ms = build_loss("raw_vthm")
        miner = pml_miners.MultiSimilarityMiner(epsilon=0.1)
        pml_ms = pml_losses.MultiSimilarityLoss(alpha=2, beta=50, base=0.5)
        ours_pa = build_loss("proxy_anchor", num_classes=classes, embedding_dim=dim)
        pml_pa = pml_losses.ProxyAnchorLoss(classes, dim, margin=0.1, alpha=32)
        pml_pa.proxies.data.copy_(ours_pa.proxies.data)

        t = {
            "raw": timed(training_step(ours_ms, base, labels), repeats),
            "pml_ms": timed(training_step(pml_ms, base, labels, miner), repeats),
            "pa": timed(training_step(ours_pa, base, labels), repeats),
            "pml_pa": timed(training_step(pml_pa, base, labels), repeats),
        }
        print(
            f"{batch:>6} {t['raw'] * 1e3:9.2f} {t['pml_ms'] * 1e3:13.2f} {t['pml_ms'] / t['raw']:5.2f}× "
            f"{t['pa'] * 1e3:13.2f} {t['pml_pa'] * 1e3:8.2f} {t['pml_pa'] / t['pa']:5.2f}×"
        )


if __name__ == "__main__":
    main()
