"""The model's own compute with LoRA, without either trainer: forward + backward of one batch of
our ``HFModel`` (adapters injected in place, ``adapter=lora``) against peft's ``PeftModel`` of the
same GPT-2 style folder, bare and wrapped in DDP (one gloo rank), one thread, alternated. It tells
whether a gap between the trainers (benchmarks/hf_bench.py --adapter lora) is in the model or in
the training step around it.

    .venv/bin/python benchmarks/lora_compute_bench.py [--repeats 5] [--batch 8] [--seq-len 128]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--r", type=int, default=8)
    a = ap.parse_args()

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from peft import LoraConfig, get_peft_model
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import GPT2Config, GPT2LMHeadModel

    from training.config.train_config import TrainConfig
    from training.util import free_port
    from training.models.build import build_for_training
    from training.models.spec import ModelSpec

    torch.set_num_threads(1)
    folder = Path(tempfile.mkdtemp(prefix="lora-compute-")) / "gpt2"
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=2048, n_embd=256, n_layer=4, n_head=4)).save_pretrained(folder)
    meta = {"task": "language_modeling", "kind": "tokens", "features": ["tokens"], "vocab_size": 2048,
            "seq_len": a.seq_len}
    cfg = TrainConfig(dataset_uri="x", model=f"hf:{folder}", adapter="lora", lora_r=a.r, lora_alpha=2 * a.r)
    spec = ModelSpec.for_data(cfg.model, meta, hidden=8, depth=1, adapter=cfg.adapter_spec())
    ours, initial = build_for_training(spec, seed=1, strategy="ddp")
    initial(ours, torch.device("cpu"))
    theirs = get_peft_model(GPT2LMHeadModel.from_pretrained(folder), LoraConfig(r=a.r, lora_alpha=2 * a.r,
                                                                                lora_dropout=0.0, task_type="CAUSAL_LM"))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=0, world_size=1)
    x = torch.randint(0, 2048, (a.batch, a.seq_len))
    models = {"ours": ours.train(), "peft": theirs.train()}
    models.update({"ours in DDP": DDP(ours, gradient_as_bucket_view=True), "peft in DDP": DDP(theirs)})

    def step(name):
        m = models[name]
        out = m(x) if name.startswith("ours") else m(input_ids=x).logits
        F.cross_entropy(out.reshape(-1, 2048), x.reshape(-1)).backward()

    times = {name: [] for name in models}
    for _ in range(a.repeats):
        for name in models:
            step(name)  # one untimed
            t = time.perf_counter()
            step(name)
            times[name].append(time.perf_counter() - t)
    for name, ts in times.items():
        print(f"{name:12s} forward+backward {min(ts) * 1e3:7.1f} ms (best of {a.repeats}), "
              f"median {sorted(ts)[len(ts) // 2] * 1e3:7.1f} ms")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
