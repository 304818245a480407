"""dostune.initialize as a drop-in for deepspeed.initialize in your own training loop.

    python examples/train_with_initialize.py --config runs/tune/gpt2-1.3b/ds_config.json --model gpt2-1.3b
    deepspeed --num_gpus 2 examples/train_with_initialize.py --config ds_config.json     # several GPUs

Without a `dostune` section in the config this is exactly deepspeed.initialize.
"""
import argparse
import json

import deepspeed
import torch

import dostune
from dostune.models.registry import resolve_model
from dostune.train.engine import ensure_distributed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--model", default="gpt2-tiny")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--local_rank", type=int, default=0)  # set by DeepSpeed's launcher
    args = ap.parse_args()

    ensure_distributed()  # world of one under plain python; the launcher's world under `deepspeed`
    config = json.load(open(args.config))
    spec = resolve_model(args.model)
    with deepspeed.zero.Init(config_dict_or_path=config):  # large models are partitioned as they are built
        model = spec.build()
    engine, optimizer, _, _ = dostune.initialize(model=model, config=config, model_parameters=model.parameters())
    print(f"optimizer: {type(optimizer).__name__}")
    gen = torch.Generator().manual_seed(0)
    for step in range(args.steps):
        batch = spec.batch(engine.train_micro_batch_size_per_gpu(), args.seq, gen, engine.device)
        loss = engine(**batch)
        engine.backward(loss)
        engine.step()
        if step % 5 == 0:
            print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
