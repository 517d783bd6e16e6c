"""README.md and docs/*.md are a contract: every ```bash and ```python block runs here as printed.

The blocks run in the order a reader meets them, in one fresh copy of the repository (its tracked
and unignored files, as a clone has them) that uses this checkout's .venv: bash blocks in one
shell session whose environment carries from block to block (so `eval "$(k3 cluster env)"` reaches
the `ray job submit` after it), python blocks as scripts in the copy's root. The only changes to a
block are the placeholders a reader fills in (PLACEHOLDERS: a checkpoint path, an export
directory); `cat.png` is a real photograph (scikit-image's). A block that cannot run here carries a
visible `> **Not run by the tests:** <why>` note in the document itself, which the fast tier
checks. A block fails when it exits non-zero or prints an OpenAI error body.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import session_env
from readme_blocks import RUNNABLE, Block, read_blocks

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCKS = [b for doc in DOCS for b in read_blocks(doc) if b.lang in RUNNABLE]
TO_RUN = [b for b in BLOCKS if b.note is None]
# what a reader substitutes, and what the test puts there (names under the session's tmp dir)
PLACEHOLDERS = {
    "/path/to/Kimi-K3": "Kimi-K3",  # a tiny checkpoint in the K3 release layout (MXFP4 experts)
    "/path/to/Kimi-Linear-48B-A3B-Instruct": "Kimi-Linear",  # a tiny one saved by transformers
    "/tmp/k3-export": "k3-export",
    "/tmp/export": "export",
}
STEP_LOSS = re.compile(r"step\s+\d+/\d+\s+loss\s+([0-9.]+)")  # the job's line per --log-every steps
FAULT = re.compile(r"FATAL|SIGSEGV|Segmentation fault|core dumped|Killed|OOM|MemoryError|Cannot load|Fatal Python")
# a block's own limit, under pytest-timeout's 900 s, so that a slow block fails with its output and
# the job it submitted is stopped rather than left running beside the next block
BLOCK_TIMEOUT_S = 780
PLACEHOLDER_LIKE = re.compile(r"<[A-Za-z][\w -]*>")  # `<gcs address>`: something only the reader knows


def test_every_block_runs_or_says_why_not():
    assert len(TO_RUN) >= 15, f"only {len(TO_RUN)} README/docs blocks run: the parser lost some"
    for b in BLOCKS:
        if b.note is not None:
            assert len(b.note.split()) >= 6, f"{b.name}: the 'Not run by the tests' note must say why: {b.note!r}"
            continue
        left = b.code
        for placeholder in PLACEHOLDERS:
            left = left.replace(placeholder, "")
        assert "/path/to/" not in left and not PLACEHOLDER_LIKE.search(left), (
            f"{b.name}: a placeholder the test cannot fill; add it to PLACEHOLDERS or write the block runnable")


def test_a_block_without_a_note_is_found_and_a_note_needs_its_reason(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("# t\n\n> **Not run by the tests:** needs a live Grafana, none here.\n\n```bash\nk3 monitor push\n```\n\n"
                   "```python\nprint(1)\n```\n\n```yaml\na: 1\n```\n")
    blocks = read_blocks(doc)
    assert [(b.lang, b.note) for b in blocks] == [
        ("bash", "needs a live Grafana, none here."), ("python", None), ("yaml", None)]
    assert blocks[0].section == "t" and blocks[1].code == "print(1)\n"
    doc.write_text("```bash\nnever closed\n")
    with pytest.raises(ValueError, match="never closed"):
        read_blocks(doc)


class Reader:
    """One reader's terminal: a fresh copy of the repository and a shell environment that carries."""

    def __init__(self, root: Path, tmp: Path):
        self.root, self.tmp = root, tmp
        # a new terminal's environment, not what earlier tests of the session left in os.environ
        self.env = {k: v for k, v in session_env.START.items() if not k.startswith(("RAY_", "PYTEST_"))}
        self.env_file = tmp / "env"
        self.log: list[str] = []

    def fill(self, code: str) -> str:
        for placeholder, name in PLACEHOLDERS.items():
            code = code.replace(placeholder, str(self.tmp / name))
        return code

    def run(self, block: Block) -> subprocess.CompletedProcess:
        code = self.fill(block.code)
        if block.lang == "bash":
            cmd, stdin = ["bash", "-euo", "pipefail", "-c", f"{code}\nenv -0 > {self.env_file}\n"], None
        else:
            cmd, stdin = [str(self.root / ".venv" / "bin" / "python"), "-"], code
        try:
            out = subprocess.run(cmd, input=stdin, cwd=self.root, env=self.env, capture_output=True, text=True,
                                 timeout=BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:  # shown as a failure with what it printed so far
            text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
            out = subprocess.CompletedProcess(cmd, -9, text(e.stdout),
                                              text(e.stderr) + f"\n[timed out after {BLOCK_TIMEOUT_S} s]")
        if block.lang == "bash" and out.returncode == 0:
            pairs = (kv.partition("=") for kv in self.env_file.read_text().split("\0") if kv)
            self.env = {k: v for k, _, v in pairs}
        self.log.append(f"--- {block.name}\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
        return out

    def stop_running_jobs(self) -> str:
        """Stops every job of the README's cluster that is still running: a `ray job submit` block
        that failed or timed out leaves its job training, which would slow every later block."""
        script = ("from ray.job_submission import JobSubmissionClient\n"
                  "c = JobSubmissionClient()\n"
                  "for j in c.list_jobs():\n"
                  "    if not j.status.is_terminal():\n"
                  "        c.stop_job(j.submission_id); print(j.submission_id, j.status)\n")
        out = subprocess.run([str(self.root / ".venv" / "bin" / "python"), "-c", script], cwd=self.root,
                             env=self.env, capture_output=True, text=True, timeout=120)
        return (out.stdout + out.stderr).strip()

    def ray_worker_faults(self) -> str:
        """The lines of the README cluster's worker logs that say why a process died (a failed
        job's output says only that an actor died)."""
        state = self.root / ".cache" / "k3-cluster" / "state.json"
        if not state.is_file():
            return ""
        logs = Path(json.loads(state.read_text()).get("session_dir", "/nonexistent")) / "logs"
        faults = [f"{f.name}: {line}" for f in sorted(logs.glob("*.err")) + sorted(logs.glob("*.out"))
                  for line in f.read_text(errors="replace").splitlines() if FAULT.search(line)]
        return "\n".join(faults[-40:])

    def stop_what_the_readme_started(self) -> None:
        for args in (["monitor", "down"], ["cluster", "down"]):
            subprocess.run([str(self.root / ".venv" / "bin" / "k3"), *args], cwd=self.root, env=self.env,
                           capture_output=True, timeout=120)


def _checkout(dest: Path) -> Path:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout.split("\0")
    for f in filter(None, files):
        if (REPO / f).is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, dest / f)
    (dest / ".venv").symlink_to(REPO / ".venv")
    # the copy's own .cache (its cluster and monitor state), sharing only what `make` unpacked
    for shared in ("prometheus",):
        if (REPO / ".cache" / shared).exists():
            (dest / ".cache").mkdir(exist_ok=True)
            (dest / ".cache" / shared).symlink_to(REPO / ".cache" / shared)
    return dest


def _kimi_linear_checkpoint(path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from k3.model.hf_kimi import kimi_linear_torch_only

    kimi_linear_torch_only()
    cfg = transformers.KimiLinearConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
        v_head_dim=16, num_local_experts=8, num_experts_per_tok=2, n_shared_experts=1, linear_head_dim=16,
        linear_num_heads=4, layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    import torch

    torch.manual_seed(0)
    transformers.KimiLinearForCausalLM(cfg).save_pretrained(path)


@pytest.fixture(scope="module")
def reader(tmp_path_factory):
    from PIL import Image
    from skimage import data

    from release_reference import release_tensors, tiny_release_config, write_release_checkpoint

    tmp = tmp_path_factory.mktemp("reader")
    root = _checkout(tmp / "k3")
    cfg = tiny_release_config()
    write_release_checkpoint(tmp / "Kimi-K3", cfg, release_tensors(cfg))
    _kimi_linear_checkpoint(tmp / "Kimi-Linear")
    Image.fromarray(data.chelsea()).save(root / "cat.png")
    r = Reader(root, tmp)
    yield r
    r.stop_what_the_readme_started()


def _openai_errors(stdout: str) -> list[str]:
    errors = []
    for line in stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                body = json.loads(line)
            except ValueError:
                continue
            if isinstance(body, dict) and "error" in body:
                errors.append(line)
    return errors


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.parametrize("block", TO_RUN, ids=[b.name for b in TO_RUN])
def test_block_runs_as_printed(block, reader):
    out = reader.run(block)
    shown = f"{block.name} ({block.section}) failed:\n{block.code}\n--- stdout\n{out.stdout[-4000:]}\n--- stderr\n{out.stderr[-4000:]}"
    if out.returncode != 0 and "ray job submit" in block.code:
        shown += f"\n--- jobs still running, stopped\n{reader.stop_running_jobs()}"
        shown += f"\n--- faults in the cluster's worker logs\n{reader.ray_worker_faults()}"
        shown += f"\n--- variables the session's tests changed (kept out of the reader's shell): " \
                 f"{session_env.changed_since_start()}"
    assert out.returncode == 0, shown
    assert not _openai_errors(out.stdout), shown
    logs = out.stdout + out.stderr
    if "ray job submit" in block.code:  # the job trained and left its checkpoints where the README says
        name = re.search(r"--name (\S+)", block.code).group(1)
        assert "succeeded" in logs.lower() and "summary " in logs, shown
        assert sorted((reader.root / "runs" / name).glob("checkpoint_*")), shown
    if "--context-parallel 2" in block.code:
        assert "context_parallel 2" in logs, shown
    if "--name my-run" in block.code:
        losses = [float(loss) for loss in STEP_LOSS.findall(logs)]
        assert len(losses) >= 2 and losses[-1] < losses[0], f"the loss did not fall: {losses}"
        steps = [m.group(0) for m in re.finditer(r"step\s+\d+/\d+", logs)]
        assert len(steps) == len(set(steps)), f"a step's line was printed more than once: {steps}"
        # DeepSpeed's ZeRO step calls a deprecated torch.distributed function every step: its
        # warning is shown once per worker (2), not at every interval
        assert logs.count("FutureWarning") <= 2, shown
    if "curl" in block.code and "/v1/" in block.code:  # an answer, not only a zero exit status
        assert '"choices"' in out.stdout, shown
    if "k3 report" in block.code:
        assert (reader.root / "runs" / "my-run" / "report" / "index.html").is_file(), shown

