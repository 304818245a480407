"""Your own training loop under Accelerate with dostune's interleaved optimizer (needs `pip install dostune[hf]`).

    dostune tune --model hf:examples/llama-1.1b.json --model-profile <its profile> --for accelerate --output-dir runs/tune/llama-1.1b
    accelerate launch --config_file examples/accelerate_config.yaml --mixed_precision bf16 \\
        examples/accelerate_train.py --steps 50

The YAML names the DeepSpeed config (deepspeed_config_file); Accelerator.prepare fills its "auto" values (the
micro-batch from the DataLoader, lr and weight decay from DummyOptim, bf16/fp16 from --mixed_precision) and builds
the DeepSpeed engine. dostune.attach(model) then switches the engine's ZeRO-3 optimizer to the schedule in the
config's `dostune` section (without that section it changes nothing: plain DeepSpeed). --tiny trains a tiny LLaMA
for a few steps, on the CPU if there is no GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed's CPU accelerator; read when deepspeed is imported

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_trainer import LLAMA_1B, TINY_MODEL, SyntheticTokens, weights_digest  # noqa: E402  (beside this file)


def main(argv=None) -> int:
    from accelerate import Accelerator
    from accelerate.utils import DummyOptim
    from transformers import AutoConfig, AutoModelForCausalLM

    import dostune
    from dostune.errors import DostuneError

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny LLaMA, 3 steps of sequence 32")
    ap.add_argument("--model-config", help="Hugging Face config.json of the model (default: examples/llama-1.1b.json)")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (default 3 with --tiny, else 50)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default 32 with --tiny, else 1024)")
    ap.add_argument("--micro-batch", type=int, default=None, help="per-device batch (default 2 with --tiny, else 8)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json-out", type=Path, help="write the per-step losses and what ran to this file (rank 0)")
    a = ap.parse_args(argv)
    steps, seq = a.steps or (3 if a.tiny else 50), a.seq or (32 if a.tiny else 1024)
    micro_batch = a.micro_batch or (2 if a.tiny else 8)

    accelerator = Accelerator()  # DeepSpeed, its config and the precision come from `accelerate launch`
    config = AutoConfig.from_pretrained(str(a.model_config or (TINY_MODEL if a.tiny else LLAMA_1B)))
    torch.manual_seed(a.seed)
    model = AutoModelForCausalLM.from_config(config)  # partitioned as it is built (zero3_init_flag)
    dostune.mark_leaf_blocks(model)  # its blocks as ZeRO-3 leaf modules before prepare: the engine dostune profiles
    data = torch.utils.data.DataLoader(SyntheticTokens(config.vocab_size, seq), batch_size=micro_batch)
    # DummyOptim: the config's own optimizer (DeepSpeedCPUAdam under offload) with these lr and weight decay
    optimizer = DummyOptim(model.parameters(), lr=a.lr, weight_decay=a.weight_decay)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    try:
        interleaved = dostune.attach(model)  # the prepared model is the DeepSpeed engine
    except DostuneError as e:
        accelerator.print(f"error: {e}" + (f" (hint: {e.hint})" if e.hint else ""))
        return 2
    accelerator.print(f"optimizer: {type(model.optimizer).__name__}")
    losses, traces = [], []
    model.train()
    for step, batch in zip(range(steps * accelerator.gradient_accumulation_steps), data):
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)  # under DeepSpeed: backward, and the optimizer step at the boundary
            optimizer.step()
            optimizer.zero_grad()
        losses.append(float(loss.detach().float()))
        if accelerator.sync_gradients and interleaved is not None and interleaved.dostune_schedule.trace:
            # the lanes' work in this step, timed from its start (a schedule with "trace": true records it)
            traces.append([(s.lane, s.subgroup, s.start, s.end) for s in interleaved.dostune_last_trace])
        accelerator.print(f"step {step + 1} loss {losses[-1]:.4f}")
    if a.json_out is not None and accelerator.is_main_process:
        a.json_out.write_text(json.dumps({
            "optimizer": type(model.optimizer).__name__, "losses": losses, "traces": traces,
            "global_steps": model.global_steps, "world_size": accelerator.num_processes,
            "weights_sha256": weights_digest(model)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
