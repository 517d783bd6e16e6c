"""The demo: train k3-tiny on the bundled corpus for a few minutes, then sample from it.

    python jobs/demo.py [--minutes 3] [--out runs/demo]

Steps, top to bottom: gather the corpus (the Python standard library's source; nothing is
downloaded), train a byte-level BPE tokenizer, tokenize into fixed-length sequences, train
k3-tiny (every K3 feature on) in this process with AdamW + cosine schedule, save the
checkpoint, print samples. This runs in-process until the Ray training job exists.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from k3.model import K3ForCausalLM, SamplingConfig, generate, get_preset
from k3.platform.corpus import stdlib_corpus
from k3.platform.optim import build_adamw, cosine_lr, set_lr
from k3.platform.tokenizer import special_ids, train_bpe

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--minutes", type=float, default=3.0, help="training time budget")
p.add_argument("--seq-len", type=int, default=256, help="tokens per training sequence")
p.add_argument("--batch", type=int, default=8, help="sequences per step")
p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
p.add_argument("--corpus-bytes", type=int, default=8_000_000, help="bytes of stdlib source to use")
p.add_argument("--out", default="runs/demo", help="where the checkpoint and tokenizer go")
p.add_argument("--seed", type=int, default=0)
args = p.parse_args()
torch.manual_seed(args.seed)
torch.set_num_threads(max(1, torch.get_num_threads()))
out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)

# 1. Corpus and tokenizer.
t0 = time.time()
corpus = stdlib_corpus(args.corpus_bytes)
cfg = get_preset("k3-tiny")
tok = train_bpe(corpus.texts(), vocab_size=cfg.vocab_size)
ids = special_ids(tok)
cfg = cfg.replace(bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"])
tok.save(str(out / "tokenizer.json"))
stream = []
for enc in tok.encode_batch(list(corpus.texts())):
    stream.extend(enc.ids + [ids["eos"]])
data = torch.tensor(stream)
n_seq = len(data) // args.seq_len
data = data[: n_seq * args.seq_len].view(n_seq, args.seq_len)
held_out = data[-16:]  # last sequences never trained on
data = data[:-16]
print(f"corpus: {len(corpus.files)} files, {corpus.bytes / 1e6:.1f} MB from {corpus.source}; "
      f"{len(stream):,} tokens, {len(data)} sequences of {args.seq_len}; prep {time.time() - t0:.1f}s", flush=True)

# 2. Train for the time budget (the schedule assumes the measured speed of the first steps).
model = K3ForCausalLM(cfg)
opt = build_adamw(model, args.lr)
budget = args.minutes * 60
step, seen, t_start = 0, 0, time.time()
est_total = 10_000
while True:
    elapsed = time.time() - t_start
    if elapsed >= budget:
        break
    if step == 5:
        est_total = max(20, int(budget / (elapsed / 5)))
    batch = data[torch.randint(0, len(data), (args.batch,))]
    set_lr(opt, cosine_lr(step, est_total, warmup_steps=min(50, est_total // 10), peak=args.lr))
    loss = model(batch, labels=batch).loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    step += 1
    seen += batch.numel()
    if step % 25 == 0 or step == 1:
        print(f"step {step:5d}  loss {loss.item():.3f}  grad_norm {gnorm:.2f}  "
              f"tok/s {seen / (time.time() - t_start):,.0f}  elapsed {time.time() - t_start:.0f}s", flush=True)

model.eval()
with torch.no_grad():
    val = model(held_out, labels=held_out).loss.item()
print(f"trained {step} steps, {seen:,} tokens; held-out loss {val:.3f} (ppl {math.exp(val):.1f})")
torch.save(model.state_dict(), out / "model.pt")
cfg.to_json(out / "config.json")
(out / "summary.json").write_text(json.dumps({"steps": step, "tokens": seen, "held_out_loss": val}, indent=2))

# 3. Samples.
prompts = ["def ", "import os\n", "class ", "    for i in range("]
news = generate(model, [tok.encode(pr).ids for pr in prompts],
                SamplingConfig(max_new_tokens=60, temperature=0.8, top_p=0.95, seed=args.seed,
                               stop_token_ids=(ids["eos"],)))
for pr, new in zip(prompts, news):
    print("-" * 60)
    print(pr + tok.decode(new))
print("-" * 60)
print(f"checkpoint: {out}/model.pt  config: {out}/config.json  tokenizer: {out}/tokenizer.json")
