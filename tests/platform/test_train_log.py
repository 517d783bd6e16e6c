"""The training job's log line: one per interval, the fields a reader scans for."""
from __future__ import annotations

import logging

from k3.platform.train.worker import _quiet_worker_logs, log_line
from k3.platform.train.trainer import StepResult


def test_log_line_fields():
    r = StepResult(loss=4.25, grad_norm=0.812, lr=2e-3, maxvio=[0.1, 0.9, 0.3], tokens=4096, step_s=1.0,
                   wait_s=0.0, all_to_all_s=0.0)
    line = log_line(r, step=50, total=200, tps=1234.5, elapsed_s=100.0, steps_done=50)
    assert line == ("step    50/200  loss 4.2500  tok/s 1,234  lr 2.00e-03  grad_norm 0.812  maxvio 0.90@L1  "
                    "eta 5m00s")


def test_ray_train_report_dumps_are_quiet():
    from ray.train.v2._internal.execution import context

    _quiet_worker_logs()
    assert logging.getLogger(context.__file__).getEffectiveLevel() >= logging.WARNING


def test_a_warning_repeated_every_step_is_shown_once():
    """Libraries open `warnings.catch_warnings()` every step, and each block that exits resets the
    "once" filter; the worker's log still shows each warning once (the old filter showed it 3x)."""
    import subprocess
    import sys

    code = """
import warnings
from k3.platform.train.worker import _quiet_worker_logs
_quiet_worker_logs()
_quiet_worker_logs()  # a second call (a restarted loop) keeps one wrapper
def step(i):
    with warnings.catch_warnings():
        pass
    warnings.warn("`all_gather_into_tensor` is deprecated", FutureWarning)
    warnings.warn(f"step {i} is new", UserWarning)
for i in range(3):
    step(i)
"""
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stderr
    assert err.count("is deprecated") == 1, err
    assert [f"step {i} is new" in err for i in range(3)] == [True] * 3, err
