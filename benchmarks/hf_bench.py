"""Fine-tuning a Hugging Face ``hf:`` model on 2 ranks: the trainer against Hugging Face's own
``transformers.Trainer`` (DDP through accelerate, under torchrun, gloo on CPU); same model folder,
same token windows, same global batch and sequence length, fp32, same recipe. Goal: trainer / HF
>= 1.1 (median of the per-round ratios).

    .venv/bin/python benchmarks/hf_bench.py [--steps 60] [--warmup 10] [--repeats 3] [--batch-size 16] [--seq-len 128]
    .venv/bin/python benchmarks/hf_bench.py --n-embd 384 --n-layer 6 --vocab 4096   # a larger model
    .venv/bin/python benchmarks/hf_bench.py --adapter lora --lora-r 8   # LoRA: ours vs Trainer + peft, vs our full

With ``--adapter lora`` both sides train the same LoRA adapters (``lora_r``, alpha 2r, dropout 0,
peft's default targets: GPT-2's ``c_attn``): ours with ``adapter=lora``, HF's Trainer on
``peft.get_peft_model`` of the same folder; each round also runs our full fine-tune of the same
model, and the summary gives LoRA's throughput and peak memory (the ranks' resident set, from
``train_summary.json``) against it.

``transformers`` and ``accelerate`` (which ``peft`` brings) are in requirements.txt; ``peft`` runs both LoRA sides.

Set up once, outside any timing: a GPT-2 style checkpoint folder (``GPT2Config`` + random weights,
``save_pretrained``, with a byte-level BPE ``tokenizer.json`` trained on the help text), the help
text as Parquet (``make-data --kind text``), and its token windows of ``seq_len + 1`` tokens
(``python -m training tokenize --model hf:FOLDER``, the folder's own tokenizer). Both sides then
train on exactly those windows from exactly those weights.

Ours: ``python -m training train`` under torchrun with ``model=hf:FOLDER token_shards=...
strategy=ddp precision=fp32``, no MLflow, ``checkpoint_every=0`` (the final checkpoint and
export happen after the timed steps), a progress line every ``--warmup`` steps.

HF's (``--hf-worker``, this file under torchrun): ``AutoModelForCausalLM.from_pretrained(FOLDER)``
and ``Trainer`` with ``TrainingArguments(use_cpu=True, ddp_backend="gloo", max_steps, per-device
batch = global / 2, the same lr, weight decay, warm-up steps, lr_scheduler_type="cosine_with_min_lr"
with min_lr_rate=0.1 (our cosine decays to 10%), max_grad_norm, seed, save_strategy="no",
report_to=[], dataloader_num_workers=0, drop_last, logging every ``--warmup`` steps)``, its default
optimizer (``adamw_torch_fused``, as ours) and otherwise its defaults. The windows are a plain torch
``Dataset`` returning ``{"input_ids": w[:-1], "labels": w[1:], "shift_labels": w[1:]}``: with
``shift_labels`` HF's causal-LM loss scores the same ``seq_len`` next tokens of each window as ours
(``labels=input_ids`` would score only ``seq_len - 1``).

Not identical, by construction: HF serves the data through its own DataLoader (a
DistributedSampler, per-sample ``__getitem__`` and default collation) where ours indexes the
in-memory windows with its own sampler (a different, equally random order); HF's warm-up starts
from lr 0 where ours starts at lr/warmup_steps; HF leaves biases and LayerNorm weights out of weight
decay (two parameter groups); HF's defaults add an all-gather of the token count per step
(``average_tokens_across_devices``), ``find_unused_parameters=True`` in its DDP wrapper (``--hf-no-find-unused``
turns it off) and ``use_cache`` in the forward; ours adds its comm timing hook, per-step record,
preemption agreement and window metrics.

Dropout is 0 in the folder's config (``--dropout``) by default, so that both sides do the same
work whatever their handling of it (both train with the model in training mode).

Timing: both skip the first ``--warmup`` steps and time the rest on rank 0 as wall time from the
end of step ``warmup`` to the end of the last step (ours from its ``steps.jsonl`` timestamps, HF's
from a ``TrainerCallback`` at ``on_step_end``; DDP's all-reduce keeps the ranks in step, and
logging every ``--warmup`` steps is inside the interval on both sides). The progress lines'
samples/s are whole numbers, too coarse at tens of samples/s, so they only give ours' loss here.
Rounds alternate (ours, HF, ours, HF, ...) in one invocation so drift in the machine's load hits
both; each line shows the 1-minute load average.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.overhead_bench import PROGRESS  # noqa: E402 (after the path is set)
from training.distributed.launch import TRAIN, torchrun_command  # noqa: E402
from training.util import free_port  # noqa: E402

HF_LINE = re.compile(r"^HF_BENCH (\{.*\})$", re.M)
LOSS = re.compile(r"^step \d+/\d+ \| loss ([0-9.]+) \|", re.M)


def _env() -> dict[str, str]:
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("MLFLOW_RUN_ID", None)
    return env


def _torchrun(world: int, args: list[str], entry=TRAIN) -> str:
    cmd = torchrun_command(args, nproc_per_node=world, master_port=free_port(), entry=entry)
    out = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(out.stdout[-3000:] + out.stderr[-3000:])
    return out.stdout + out.stderr


def make_folder(path: Path, a) -> Path:
    """A GPT-2 style causal LM folder as ``save_pretrained`` writes it (random weights, fine-tuned
    from by both sides) with a BPE tokenizer of ``a.vocab`` tokens trained on the help text."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    from training.data.synthetic import python_help_paragraphs
    from training.data.tokenizer import EOT, train_bpe

    tok = train_bpe(python_help_paragraphs(), a.vocab)
    eot = tok.token_to_id(EOT)
    config = GPT2Config(vocab_size=tok.get_vocab_size(), n_positions=max(a.seq_len, 128), n_embd=a.n_embd,
                        n_layer=a.n_layer, n_head=a.n_head, bos_token_id=eot, eos_token_id=eot,
                        resid_pdrop=a.dropout, embd_pdrop=a.dropout, attn_pdrop=a.dropout)
    torch.manual_seed(0)
    hf_logging.disable_progress_bar()
    GPT2LMHeadModel(config).save_pretrained(path)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOT, bos_token=EOT).save_pretrained(path)
    return path


def prepare(a, tmp: Path) -> tuple[Path, str, int, int]:
    """(model folder, token_shards URI, train windows, parameters), made once."""
    folder = make_folder(tmp / "gpt2", a)
    data = tmp / "data"
    run = dict(check=True, capture_output=True, text=True, cwd=ROOT, env=_env())
    subprocess.run([sys.executable, "-m", "training", "make-data", "--kind", "text", "--out", str(data)], **run)
    out = subprocess.run([sys.executable, "-m", "training", "tokenize", "--dataset-uri", str(data), "--text-column",
                          "text", "--model", f"hf:{folder}", "--seq-len", str(a.seq_len), "--out", str(tmp / "store")],
                         **run)
    built = json.loads(out.stdout.strip().splitlines()[-1])
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        params = sum(_numel(f.get_slice(k).get_shape()) for k in f.keys())  # tied weights stored once
    return folder, built["token_shards"], built["splits"]["train"]["windows"], params


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def recipe(a) -> dict:
    return {"lr": a.lr, "weight_decay": a.weight_decay, "warmup_steps": a.lr_warmup, "grad_clip": a.grad_clip,
            "seed": a.seed}


def ours_rate(a, folder: Path, shards: str, tmp: Path, i: int, adapter: str = "none") -> tuple[float, float, float]:
    """(samples/s after the warm-up steps, last window's loss, peak resident set of the largest rank)
    of our trainer."""
    out_dir = tmp / f"out{i}-{adapter}"
    sets = {"model": f"hf:{folder}", "dataset_uri": tmp / "data", "text_column": "text", "token_shards": shards,
            "seq_len": a.seq_len, "batch_size": a.batch_size, "steps": a.steps, "strategy": "ddp",
            "precision": "fp32", "log_every": a.warmup, "checkpoint_every": 0, "target_metric": "none",
            "eval_every": 0, "checkpoint_dir": tmp / f"ck{i}-{adapter}", "output_dir": out_dir, **recipe(a)}
    if adapter != "none":
        sets.update(adapter=adapter, lora_r=a.lora_r, lora_alpha=2 * a.lora_r, lora_dropout=0.0)
    out = _torchrun(a.world, [x for k, v in sets.items() for x in ("--set", f"{k}={v}")])
    if not PROGRESS.search(out):
        raise RuntimeError(f"no progress line in our trainer's output:\n{out[-3000:]}")
    t = {r["step"]: r["t"] for r in map(json.loads, (out_dir / "steps.jsonl").read_text().splitlines())}
    peak = json.loads((out_dir / "train_summary.json").read_text())["peak_mem_bytes_max"]
    return a.batch_size * (a.steps - a.warmup) / (t[a.steps] - t[a.warmup]), float(LOSS.findall(out)[-1]), peak


def hf_rate(a, folder: Path, shards: str, tmp: Path, i: int) -> tuple[float, float]:
    """(samples/s after the warm-up steps, last logged loss) of transformers.Trainer."""
    args = ["--hf-worker", "--folder", str(folder), "--shards", shards, "--out", str(tmp / f"hf{i}"), "--steps", str(a.steps), "--warmup",
            str(a.warmup), "--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len), "--lr", str(a.lr),
            "--weight-decay", str(a.weight_decay), "--lr-warmup", str(a.lr_warmup), "--grad-clip", str(a.grad_clip),
            "--seed", str(a.seed), *(["--hf-no-find-unused"] if a.hf_no_find_unused else []),
            "--adapter", a.adapter, "--lora-r", str(a.lora_r)]
    out = _torchrun(a.world, args, entry=[str(Path(__file__).resolve())])
    m = HF_LINE.findall(out)
    if not m:
        raise RuntimeError(f"no HF_BENCH line in the Trainer's output:\n{out[-3000:]}")
    r = json.loads(m[-1])
    return r["samples_per_s"], r["loss"]


def hf_worker(a) -> None:
    """One rank of transformers.Trainer on the same windows (run under torchrun)."""
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from training.data.tokens import open_shards

    windows = torch.from_numpy(open_shards(a.shards).split("train").features)  # int64 [n, seq_len + 1]
    assert windows.shape[1] == a.seq_len + 1, windows.shape

    class Windows(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(windows)

        def __getitem__(self, i: int) -> dict:
            w = windows[i]
            # shift_labels: the loss scores w[1:] against the logits of w[:-1], as ours does.
            return {"input_ids": w[:-1], "labels": w[1:], "shift_labels": w[1:]}

    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])

    class Clock(TrainerCallback):
        t0 = t1 = None
        loss = float("nan")

        def on_step_end(self, args, state, control, **kw):
            if state.global_step == a.warmup:
                self.t0 = time.time()
            if state.global_step == a.steps:
                self.t1 = time.time()

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                self.loss = float(logs["loss"])

    clock = Clock()
    model = AutoModelForCausalLM.from_pretrained(a.folder, local_files_only=True, dtype=torch.float32)
    if a.adapter == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=a.lora_r, lora_alpha=2 * a.lora_r, lora_dropout=0.0,
                                                 task_type="CAUSAL_LM"))
    targs = TrainingArguments(
        output_dir=a.out, per_device_train_batch_size=a.batch_size // world,
        max_steps=a.steps, learning_rate=a.lr, weight_decay=a.weight_decay, warmup_steps=a.lr_warmup,
        lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.1}, max_grad_norm=a.grad_clip,
        logging_strategy="steps", logging_steps=a.warmup, save_strategy="no", eval_strategy="no", report_to=[],
        dataloader_num_workers=0, dataloader_drop_last=True, use_cpu=True, ddp_backend="gloo", disable_tqdm=True,
        seed=a.seed, data_seed=a.seed, **({"ddp_find_unused_parameters": False} if a.hf_no_find_unused else {}))
    trainer = Trainer(model=model, args=targs, train_dataset=Windows(), callbacks=[clock])
    trainer.train()
    if rank == 0:
        rate = a.batch_size * (a.steps - a.warmup) / (clock.t1 - clock.t0)
        print("HF_BENCH " + json.dumps({"samples_per_s": rate, "loss": clock.loss}), flush=True)
    # As overhead_bench's loops: the measurement is complete; no process-group teardown at exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    from training.config.train_config import TrainConfig

    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10, help="steps not timed (also the logging interval of both)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=16, help="global batch (samples per optimizer step)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048, help="BPE vocabulary of the model's tokenizer")
    ap.add_argument("--dropout", type=float, default=0.0,
                    help="the folder's resid/embd/attn dropout (0: see the docstring on why not GPT-2's 0.1)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=TrainConfig.weight_decay)
    ap.add_argument("--lr-warmup", type=int, default=TrainConfig.warmup_steps, help="linear LR warm-up steps")
    ap.add_argument("--grad-clip", type=float, default=TrainConfig.grad_clip)
    ap.add_argument("--seed", type=int, default=TrainConfig.seed)
    ap.add_argument("--hf-no-find-unused", action="store_true",
                    help="HF: ddp_find_unused_parameters=False (its default for a PreTrainedModel is True)")
    ap.add_argument("--adapter", choices=["none", "lora"], default="none", help="lora: both sides train LoRA adapters")
    ap.add_argument("--lora-r", type=int, default=8)
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder (model, shards, run records)")
    ap.add_argument("--hf-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    ap.add_argument("--shards", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.hf_worker:
        hf_worker(a)
        return 0
    if a.batch_size % a.world or not 0 < a.warmup < a.steps:
        ap.error("--batch-size must be a multiple of --world, and 0 < --warmup < --steps")
    try:
        import accelerate  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        print("transformers and accelerate are needed (pip install -r requirements-bench.txt)")
        return 1

    print("$ " + shlex.join([".venv/bin/python", "benchmarks/hf_bench.py", *sys.argv[1:]]))
    tmp = Path(tempfile.mkdtemp(prefix="hf-bench-"))
    try:
        return _rounds(a, tmp)
    finally:
        if a.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def _rounds(a, tmp: Path) -> int:
    import accelerate
    import torch
    import transformers

    folder, shards, n_windows, params = prepare(a, tmp)
    print(f"GPT-2 n_embd={a.n_embd} n_layer={a.n_layer} n_head={a.n_head} vocab={a.vocab} dropout={a.dropout} "
          f"({params / 1e6:.2f}M params), "
          f"seq_len {a.seq_len}, global batch {a.batch_size}, {a.world} ranks, fp32, {a.steps} steps (first {a.warmup} "
          f"not timed), {n_windows} train windows; torch {torch.__version__}, transformers {transformers.__version__}, "
          f"accelerate {accelerate.__version__}, OMP_NUM_THREADS={_env()['OMP_NUM_THREADS']}  "
          f"[load {os.getloadavg()[0]:.2f}]", flush=True)
    ratios, vs_full, mem = [], [], []
    for i in range(a.repeats):
        ours, ours_loss, peak = ours_rate(a, folder, shards, tmp, i, a.adapter)
        hf, hf_loss = hf_rate(a, folder, shards, tmp, i)
        ratios.append(ours / hf)
        line = (f"  round {i + 1}: ours {ours:7.2f} samples/s (loss {ours_loss:.3f}) | HF Trainer {hf:7.2f} samples/s "
                f"(loss {hf_loss:.3f}) | ours/HF {ours / hf:.3f}")
        if a.adapter != "none":
            full, full_loss, full_peak = ours_rate(a, folder, shards, tmp, i)
            vs_full.append(ours / full)
            mem.append(peak / full_peak)
            line += (f" | ours full fine-tune {full:7.2f} samples/s (loss {full_loss:.3f}), LoRA/full: throughput "
                     f"{ours / full:.3f}, peak memory {peak / 2**20:.0f}/{full_peak / 2**20:.0f} MiB = {peak / full_peak:.3f}")
        print(f"{line}  [load {os.getloadavg()[0]:.2f}]", flush=True)
    what = "" if a.adapter == "none" else f" ({a.adapter} r={a.lora_r} on both)"
    print(f"ours / HF Trainer{what} (median of {a.repeats} rounds): {statistics.median(ratios):.3f}  (goal >= 1.1)")
    if vs_full:
        print(f"LoRA / full fine-tune, ours (medians): throughput {statistics.median(vs_full):.3f}, "
              f"peak memory per rank {statistics.median(mem):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
