"""What each Ray Train worker runs: `train_loop_per_worker`.

A worker builds a `k3.platform.train.trainer.Trainer` (its model shard holding only its experts,
DeepSpeed ZeRO-1/2 for the rest, one balancing strategy), feeds it its split of the token shards
through Ray Data (and, for a multimodal preset, image/video examples from its slice of the media
set on the steps `MediaSchedule` names), prints one log line per `log_every` steps and reports
metrics and checkpoints through `ray.train.report` (the layout: k3.platform.train.config).
"""
from __future__ import annotations

import logging
import math
import os
import shutil
import signal
import tempfile
import time
import warnings
from pathlib import Path

import torch

from k3.model.directory import stage_dir

from .config import TrainConfig
from .data import read_manifest, read_tokenizer


# -- the worker ---------------------------------------------------------------------------------
class _EachWarningOnce(logging.Filter):
    """Lets each distinct warning through once. A warnings filter of "once" is not enough: every
    `warnings.catch_warnings()` block that exits resets what "once" remembers, and libraries open
    such blocks every step (torch.distributed's deprecated all_gather_into_tensor, which
    DeepSpeed's ZeRO step calls, warned at every log interval)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if text in self.seen:
            return False
        self.seen.add(text)
        return True


def _quiet_worker_logs() -> None:
    """One log line per interval: no per-report metric dicts from Ray Train, each warning once
    (warnings go through logging's `py.warnings` logger, which the filter above guards)."""
    warnings.simplefilter("always")  # the logging filter decides what is shown
    logging.captureWarnings(True)
    logger = logging.getLogger("py.warnings")
    if not any(isinstance(f, _EachWarningOnce) for f in logger.filters):
        handler = logging.StreamHandler()  # stderr, as warnings print; the line as warnings format it
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.addFilter(_EachWarningOnce())
        logger.propagate = False
    names = ["deepspeed", "DeepSpeed"]
    try:  # Ray Train logs every report's whole metrics dict at INFO, on a logger named by its file path
        from ray.train.v2._internal.execution import context as train_context

        names.append(train_context.__file__)
    except ImportError:  # another Ray layout: its lines stay
        pass
    for name in names:
        logging.getLogger(name).setLevel(logging.WARNING)


def log_line(r, step: int, total: int, tps: float, elapsed_s: float, steps_done: int) -> str:
    """One training log line: step, loss, tokens/s, lr, grad norm, worst-layer MaxVio, ETA."""
    eta = elapsed_s / max(1, steps_done) * (total - step)
    worst = max(range(len(r.maxvio)), key=lambda i: r.maxvio[i]) if r.maxvio else None
    mv = f"maxvio {r.maxvio[worst]:.2f}@L{worst}" if worst is not None else "maxvio -"
    return (f"step {step:5d}/{total}  loss {r.loss:.4f}  tok/s {tps:,.0f}  lr {r.lr:.2e}  grad_norm "
            f"{r.grad_norm:.3f}  {mv}  eta {int(eta) // 60}m{int(eta) % 60:02d}s")


class StepData:
    """What each step of one worker trains on: its split of the token shards in a fixed order per
    epoch (so a resumed run sees the same batches) and, for a multimodal preset, image/video
    examples on the steps `MediaSchedule` names. `batch(step)` -> a raw batch for `make_batch`."""

    def __init__(self, trainer, shard, start_step: int) -> None:
        import ray.data

        cfg = trainer.cfg
        ray.data.DataContext.get_current().enable_progress_bars = False
        self.shard, self.micro_batch, self.seed = shard, cfg.micro_batch, cfg.seed
        self.per_epoch = shard.count() // cfg.micro_batch
        if self.per_epoch == 0:
            raise ValueError(f"worker {trainer.rank}: too few sequences for one micro batch of {cfg.micro_batch}")
        self.media = trainer.media_schedule() if trainer.multimodal and cfg.text_every > 1 else None
        text_steps = self.media.text_steps_before(start_step) if self.media else start_step
        self.epoch, pos = divmod(text_steps, self.per_epoch)
        self._text = self._epoch(self.epoch, skip=pos)

    def _epoch(self, epoch: int, skip: int):
        it = self.shard.iter_torch_batches(batch_size=self.micro_batch, drop_last=True,
                                           local_shuffle_buffer_size=4 * self.micro_batch,
                                           local_shuffle_seed=self.seed * 1000 + epoch, dtypes=torch.long)
        for i, b in enumerate(it):
            if i >= skip:
                yield b

    def batch(self, step: int) -> dict:
        if self.media is not None and not self.media.is_text_step(step):
            return {"examples": self.media.examples(step)}
        try:
            return next(self._text)
        except StopIteration:
            self.epoch += 1
            self._text = self._epoch(self.epoch, skip=0)
            return next(self._text)


class FaultDrill:
    """Testing (cfg.fail_at_step): rank 1 (rank 0 when alone) dies once, in the run's first attempt
    only, at the start of a step (`os._exit(1)`) or with SIGKILL midway through writing the
    checkpoint at its end (cfg.fail_in). The restarted group resumes from the last checkpoint."""

    def __init__(self, cfg: TrainConfig, rank: int, world: int, restored: bool) -> None:
        self.armed = cfg.fail_at_step is not None and rank == min(1, world - 1) and not restored
        self.step, self.where = cfg.fail_at_step, cfg.fail_in

    def at(self, step: int, where: str) -> None:
        if not (self.armed and step == self.step and where == self.where):
            return
        if where == "save":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(1)


class StepLog:
    """One worker's record of the run: the history (kept in checkpoints), one log line per
    `log_every` steps (rank 0), the metrics and checkpoints handed to `ray.train.report`."""

    def __init__(self, trainer, start_step: int, history: list[dict], restored_at: list[int],
                 drill: FaultDrill) -> None:
        from k3.platform.ops.metrics import TrainMetrics

        self.trainer, self.cfg, self.rank, self.drill = trainer, trainer.cfg, trainer.rank, drill
        # restored_at: the step of each checkpoint this run's worker group started from (a restart
        # after a failure, or --resume), kept in the checkpoints and the run summary
        self.start_step, self.history, self.restored_at = start_step, history, restored_at
        self.metrics = TrainMetrics(enabled=self.rank == 0)
        manifest = read_manifest(self.cfg.data) if self.rank == 0 else None
        self.tokenizer_json = read_tokenizer(self.cfg.data, manifest) if manifest is not None else None
        # kept in each checkpoint: --resume refuses other rows (k3.platform.train.launch.check_resume)
        self.data_hash = manifest.rows_hash() if manifest is not None else None
        self.checkpoint_step = start_step  # a resumed run starts from its last checkpoint
        if start_step > 0:
            self.metrics.count_restart()
        self.t_start = self.t_last = time.perf_counter()
        self.tokens, self.compute_s, self.wait_s = 0, 0.0, 0.0  # since the last report

    def record(self, step: int, r, epoch: int) -> None:
        """After step `step` (from 0) returned `r`: history, and at an interval a log line, a
        report and (every checkpoint_every steps and at the end) a checkpoint."""
        import ray.train

        cfg = self.cfg
        self.history.append({"step": step + 1, "loss": r.loss, "maxvio": r.maxvio, "tokens": r.tokens, "lr": r.lr,
                             "grad_norm": r.grad_norm, "step_s": r.step_s, "wait_s": r.wait_s,
                             "all_to_all_s": r.all_to_all_s,
                             # router bias spread per MoE layer after the step (`k3 report` plots it)
                             "bias_spread": r.extra.get("bias_spread", [])})
        self.tokens += r.tokens
        self.compute_s += r.step_s - r.wait_s
        self.wait_s += r.wait_s
        # every step (a gauge not set again within two export intervals disappears from Prometheus)
        self.metrics.update({"step": step + 1, "loss": r.loss, "lr": r.lr, "grad_norm": r.grad_norm,
                             "tokens_per_s": r.tokens / r.step_s if r.step_s > 0 else 0.0,
                             "maxvio": r.maxvio, "maxvio_mean": sum(r.maxvio) / len(r.maxvio) if r.maxvio else 0.0,
                             "bias_spread": r.extra.get("bias_spread", []), "compute_s": r.step_s - r.wait_s,
                             "coordinator_wait_s": r.wait_s, "all_to_all_s": r.all_to_all_s,
                             "checkpoint_step": self.checkpoint_step})
        last = step + 1 == cfg.steps
        save = (step + 1) % cfg.checkpoint_every == 0 or last
        if not ((step + 1) % cfg.log_every == 0 or last or save):
            return
        now = time.perf_counter()
        tps = self.tokens / (now - self.t_last)
        report = {"step": step + 1, "loss": r.loss, "lr": r.lr, "tokens_per_s": tps, "grad_norm": r.grad_norm,
                  "maxvio_mean": sum(r.maxvio) / len(r.maxvio) if r.maxvio else 0.0, "maxvio": r.maxvio,
                  **self.trainer.balance.metrics(self.trainer.model), "epoch": epoch, "compute_s": self.compute_s,
                  "coordinator_wait_s": self.wait_s, "all_to_all_s": r.all_to_all_s}
        if self.rank == 0:
            print(log_line(r, step + 1, cfg.steps, tps, now - self.t_start, step + 1 - self.start_step), flush=True)
        self.t_last, self.tokens, self.compute_s, self.wait_s = now, 0, 0.0, 0.0
        tmp = self.write_checkpoint(step, report) if save else None
        if tmp is not None:
            self.checkpoint_step = step + 1
            self.metrics.update({"checkpoint_s": report["checkpoint_s"], "checkpoint_step": self.checkpoint_step})
        ray.train.report(report, checkpoint=None if tmp is None else ray.train.Checkpoint.from_directory(str(tmp)))
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)

    def write_checkpoint(self, step: int, report: dict) -> Path:
        """This rank's part of the checkpoint after step `step`, in a local directory that
        `ray.train.report` persists (named for this process: the next save on the node removes the
        directory of a worker killed before its report)."""
        t0 = time.perf_counter()
        tmp = stage_dir(Path(tempfile.gettempdir()) / f"k3-checkpoint-rank{self.rank}")
        self.trainer.save(tmp, {"step": step + 1, "history": self.history, "restored_at": self.restored_at,
                                "data_hash": self.data_hash},
                          tokenizer_json=self.tokenizer_json, midway=lambda: self.drill.at(step, "save"))
        report["checkpoint_s"] = time.perf_counter() - t0
        return tmp


def train_loop_per_worker(loop_config: dict) -> None:
    """What each Ray Train worker runs: process group, Trainer (resumed from the latest
    checkpoint after a restart), then one train_step per step until cfg.steps."""
    import ray.train

    from k3.platform.ops.extensions import init_distributed
    from k3.platform.train.trainer import Trainer

    _quiet_worker_logs()
    cfg = TrainConfig(**loop_config["config"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(max(1, int(os.environ.get("K3_THREADS_PER_WORKER", "1"))))
    init_distributed("nccl" if cfg.use_gpu else "gloo")  # may build DeepSpeed's shm op: one ninja always
    device = torch.device(f"cuda:{torch.cuda.current_device()}") if cfg.use_gpu else torch.device("cpu")
    trainer = Trainer(cfg, rank, world, device).build()
    start_step, history, restored_at = 0, [], []
    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            st = trainer.load(Path(d))
        start_step, history, restored_at = st["step"], st["history"], [*st.get("restored_at", []), st["step"]]
    trainer.start()
    data = StepData(trainer, loop_config["splits"][trainer.dp_rank], start_step)  # a CP group reads one split
    drill = FaultDrill(cfg, rank, world, restored=ckpt is not None)
    log = StepLog(trainer, start_step, history, restored_at, drill)
    for step in range(start_step, cfg.steps):
        drill.at(step, "step")
        r = trainer.train_step(trainer.make_batch(data.batch(step)), step)
        log.record(step, r, data.epoch)


def summarize(history: list[dict]) -> dict:
    if not history:
        return {}
    first, last = history[0], history[-1]
    n = len(last["maxvio"])
    tail = history[-max(1, len(history) // 5):]
    return {"steps": last["step"], "first_loss": first["loss"], "final_loss": last["loss"],
            "maxvio_final_per_layer": last["maxvio"],
            "maxvio_tail_mean_per_layer": [sum(h["maxvio"][i] for h in tail) / len(tail) for i in range(n)],
            "loss_is_finite": all(math.isfinite(h["loss"]) for h in history)}
