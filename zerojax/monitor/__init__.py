"""A run you can watch: per-step metrics (loss, learning rate, gradient norm, loss scale,
step time, tokens/s, MFU, device memory) read a step late, and writers for the terminal,
JSON lines, CSV, TensorBoard and Weights & Biases.

    monitor = zj.monitor.Monitor([zj.monitor.Console(every=10), zj.monitor.JSONL("run.jsonl")],
                                 tokens_per_step=batch * seq_len, flops_per_token=cfg.flops_per_token())
    step = monitor.watch(zj.make_train_step(loss_fn, tx, mesh=mesh, config=config))
    for batch in batches:
        state, metrics = step(state, batch)
    monitor.close()
"""

from zerojax.monitor.monitor import Monitor
from zerojax.monitor.writers import CSV, JSONL, Console, History, ProgressBar, TensorBoard, WandB, Writer

__all__ = ["CSV", "JSONL", "Console", "History", "Monitor", "ProgressBar", "TensorBoard", "WandB", "Writer"]
