"""k3.platform.train.worker: Training on Ray: the worker's Trainer, expert parallelism, DeepSpeed, data, checkpoints."""
