"""Train with the Hugging Face Trainer and dostune's interleaved optimizer (needs `pip install dostune[hf]`).

    dostune profile --model hf:examples/llama-1.1b.json --output runs/model-llama-1.1b.json
    dostune tune --model hf:examples/llama-1.1b.json --model-profile runs/model-llama-1.1b.json --for trainer \
        --output-dir runs/tune/llama-1.1b
    python examples/hf_trainer.py --deepspeed runs/tune/llama-1.1b/ds_config.json --bf16 --steps 50
    python examples/hf_trainer.py --deepspeed runs/tune/llama-1.1b/ds_config.json --bf16 --plain-deepspeed
    python examples/hf_trainer.py --tiny          # a few steps of a tiny LLaMA, on the CPU if there is no GPU

The Trainer builds the DeepSpeed engine from the config file as usual (it fills the config's "auto" values from
TrainingArguments); dostune.HFTrainerCallback checks the config when the Trainer is built and switches the engine's
ZeRO-3 optimizer to the schedule in the config's `dostune` section when training begins. --plain-deepspeed runs
the same config without that section (DeepSpeed's own ZeRO-Offload), for comparison. The model is built from a
config with random weights: a LLaMA-1.1B shape by default (examples/llama-1.1b.json), or --model-config (a Hugging
Face config.json). Tune for the same config (`--model hf:...`): DeepSpeed splits the optimizer state into subgroups
in the order of the model's parameters, so a schedule tuned for another implementation of the same shape (e.g. the
llama-1.1b preset, whose attention projections are fused) has a different number of subgroups and is refused.
Under several GPUs, start it with `deepspeed --num_gpus N examples/hf_trainer.py ...` or `torchrun`.
"""
from __future__ import annotations

import argparse
import hashlib
import statistics
import time
import json
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed's CPU accelerator; read when deepspeed is imported

TINY_MODEL = Path(__file__).resolve().parent.parent / "tests" / "data" / "tiny-llama.json"
LLAMA_1B = Path(__file__).resolve().parent / "llama-1.1b.json"  # the llama-1.1b preset's shape as a HF config
# The tiny run's schedule: every other subgroup in the GPU lane (without a GPU that lane runs on the CPU device
# through the same buffers and hand-offs); trace records each step's per-subgroup lane timings.
TINY_SCHEDULE = {"gpu_fraction": 0.5, "gpu_placement": "spread", "trace": True}


def tiny_ds_config(schedule: dict | None = None) -> dict:
    """A Trainer-ready ZeRO-3 CPU-offload config for the tiny model (6 subgroups of up to 20K parameters)."""
    from dostune.dsconfig import OffloadSettings, TrainSettings, deepspeed_config, hf_config
    from dostune.optim.schedule import ScheduleConfig

    offload = OffloadSettings(sub_group_size=20_000, pin_memory=torch.cuda.is_available(),
                              schedule=ScheduleConfig.model_validate(schedule or TINY_SCHEDULE))
    return hf_config(deepspeed_config(TrainSettings(), offload), "trainer")


class SyntheticTokens(torch.utils.data.Dataset):
    """Seeded random token ids, the same for every run (so two runs see the same batches)."""

    def __init__(self, vocab: int, seq: int, n: int = 100_000):
        self.vocab, self.seq, self.n = vocab, seq, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        ids = torch.randint(0, self.vocab, (self.seq,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


class StepTraces:
    """A Trainer callback keeping each step's trace of the interleaved update: (lane, subgroup, start, end) of every
    piece of lane work, timed from the step's start (recorded when the dostune section has "trace": true), and the
    wall time between consecutive step ends (the steady-state step period, data loading and logging included)."""

    def __init__(self):
        self.steps: list[list[tuple]] = []
        self.ends: list[float] = []

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        self.ends.append(time.perf_counter())
        trace = getattr(getattr(optimizer, "optimizer", optimizer), "dostune_last_trace", None)
        if trace:
            self.steps.append([(s.lane, s.subgroup, s.start, s.end) for s in trace])

    def step_period_s(self, skip: int = 3) -> float | None:
        """Median seconds between step ends, leaving out the first ``skip`` steps (one-time work: the optimizer
        state's first touch, allocator warm-up); None with too few steps."""
        gaps = [b - a for a, b in zip(self.ends[skip:], self.ends[skip + 1:])]
        return statistics.median(gaps) if gaps else None

    def __getattr__(self, name):  # the Trainer's other events
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)


def weights_digest(engine) -> str:
    """sha256 of this rank's fp32 master weights: equal digests are bit-identical weights."""
    from dostune.train.engine import master_weights

    return hashlib.sha256(master_weights(engine).numpy().tobytes()).hexdigest()


def run(deepspeed: str | Path, output_dir: str | Path, model_config=None, steps: int = 3, seq: int = 32,
        micro_batch: int = 2, grad_accum: int = 1, lr: float = 1e-4, bf16: bool = False, plain_deepspeed: bool = False,
        seed: int = 0, log: bool = False) -> dict:
    """Train ``steps`` optimizer steps with the Trainer; returns the losses and grad norms it logged each step, its
    train_samples_per_second, the optimizer's class, each step's trace of the interleaved update (with a schedule
    that traces) and a digest of this rank's fp32 master weights."""
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

    import dostune
    from dostune.train.engine import ensure_distributed, free_engine_memory

    ensure_distributed()  # a world of one under plain python; the launcher's world under deepspeed/torchrun
    if plain_deepspeed:  # the same config without the dostune section: DeepSpeed's own ZeRO-3 CPU offload
        config = json.loads(Path(deepspeed).read_text())
        config.pop("dostune", None)
        # dostune's configs leave pin_memory off (it pins in place); DeepSpeed's own offload is faster pinned
        config["zero_optimization"]["offload_optimizer"]["pin_memory"] = torch.cuda.is_available()
        deepspeed = Path(output_dir) / "ds_config_plain.json"
        deepspeed.parent.mkdir(parents=True, exist_ok=True)
        deepspeed.write_text(json.dumps(config, indent=2))
    args = TrainingArguments(output_dir=str(output_dir), deepspeed=str(deepspeed), max_steps=steps,
                             per_device_train_batch_size=micro_batch, gradient_accumulation_steps=grad_accum,
                             learning_rate=lr, bf16=bf16, seed=seed, logging_steps=1, save_strategy="no",
                             report_to="none", disable_tqdm=not log, dataloader_pin_memory=torch.cuda.is_available())
    if model_config is None:
        model_config = LLAMA_1B
    if not hasattr(model_config, "to_dict"):
        model_config = AutoConfig.from_pretrained(str(model_config))
    torch.manual_seed(seed)
    # built after TrainingArguments, so that under ZeRO-3 it is partitioned while it is built
    model = AutoModelForCausalLM.from_config(model_config)
    # its blocks as ZeRO-3 leaf modules, as dostune profiles it; the callback does this too, and --plain-deepspeed
    # gets the same so that the two runs differ in the update alone
    dostune.mark_leaf_blocks(model)
    traces = StepTraces()
    callbacks = [traces] + ([] if plain_deepspeed else [dostune.HFTrainerCallback()])
    trainer = Trainer(model=model, args=args, train_dataset=SyntheticTokens(model_config.vocab_size, seq),
                      callbacks=callbacks)
    metrics = trainer.train().metrics
    engine = trainer.model_wrapped
    opt = engine.optimizer
    out = {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
           "grad_norms": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h],
           "train_samples_per_second": metrics.get("train_samples_per_second"), "optimizer": type(opt).__name__,
           "step_period_s": traces.step_period_s(),
           "traces": traces.steps, "weights_sha256": weights_digest(engine)}
    engine.destroy()
    del trainer, engine, opt, model
    free_engine_memory()
    return out


def main(argv=None) -> int:
    from dostune.errors import DostuneError

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--deepspeed", help="DeepSpeed config with a dostune section (`dostune tune --for trainer`)")
    ap.add_argument("--tiny", action="store_true", help="tiny LLaMA, 3 steps, fp32, its own config unless --deepspeed")
    ap.add_argument("--model-config", help="Hugging Face config.json of the model (default: examples/llama-1.1b.json)")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (default 3 with --tiny, else 50)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default 32 with --tiny, else 1024)")
    ap.add_argument("--micro-batch", type=int, default=None, help="per-device batch (default 2 with --tiny, else 8)")
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--bf16", action="store_true", help="bf16 mixed precision (needs a GPU under the Trainer)")
    ap.add_argument("--plain-deepspeed", action="store_true", help="drop the dostune section: DeepSpeed's own update")
    ap.add_argument("--output-dir", default="runs/hf")
    ap.add_argument("--json-out", type=Path, help="write the losses, traces and weights digest to this file (rank 0)")
    ap.add_argument("--local_rank", type=int, default=0)  # set by DeepSpeed's launcher
    a = ap.parse_args(argv)
    try:
        if a.deepspeed is None:
            if not a.tiny:
                ap.error("--deepspeed is required (or --tiny for a smoke run)")
            a.deepspeed = Path(a.output_dir) / "ds_config.json"
            a.deepspeed.parent.mkdir(parents=True, exist_ok=True)
            a.deepspeed.write_text(json.dumps(tiny_ds_config(), indent=2))
        out = run(a.deepspeed, a.output_dir, model_config=a.model_config or (TINY_MODEL if a.tiny else None),
                  steps=a.steps or (3 if a.tiny else 50), seq=a.seq or (32 if a.tiny else 1024),
                  micro_batch=a.micro_batch or (2 if a.tiny else 8), grad_accum=a.grad_accum, lr=a.lr, bf16=a.bf16,
                  plain_deepspeed=a.plain_deepspeed, log=not a.tiny)
    except DostuneError as e:
        print(f"error: {e}" + (f" (hint: {e.hint})" if e.hint else ""), file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"optimizer: {out['optimizer']}")
        print("losses: " + " ".join(f"{x:.4f}" for x in out["losses"]))
        if out["traces"]:
            lanes = [lane for lane, *_ in out["traces"][-1]]
            print(f"interleaved update traced in {len(out['traces'])} steps; the last: "
                  + ", ".join(f"{lanes.count(k)} {k}" for k in ("cpu", "h2d", "gpu", "d2h") if k in lanes))
        print(f"train_samples_per_second: {out['train_samples_per_second']} (the Trainer's, over every step)")
        if out["step_period_s"] is not None:
            print(f"median step period after 3 steps: {out['step_period_s']:.3f} s")
        if a.json_out is not None:
            a.json_out.write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
