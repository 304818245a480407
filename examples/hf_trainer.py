"""Turn dostune on inside a Hugging Face Trainer run (needs `transformers`, not a dostune dependency).

    python examples/hf_trainer.py --deepspeed runs/tune/gpt2-1.3b/ds_config.json

The Trainer builds the DeepSpeed engine from the config file as usual; dostune.HFTrainerCallback switches
its ZeRO-3 optimizer to the schedule in the config's `dostune` section when training begins. Use a config
whose batch sizes match the TrainingArguments (or set them to "auto" in the JSON).
"""
import argparse

import torch


def main():
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    import dostune

    ap = argparse.ArgumentParser()
    ap.add_argument("--deepspeed", required=True, help="DeepSpeed config with a dostune section")
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()

    model = GPT2LMHeadModel(GPT2Config(n_layer=24, n_embd=2048, n_head=16, vocab_size=50304, n_positions=1024))

    class Synthetic(torch.utils.data.Dataset):
        def __len__(self):
            return 10_000

        def __getitem__(self, i):
            ids = torch.randint(0, 50304, (1024,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    targs = TrainingArguments(output_dir="runs/hf", per_device_train_batch_size=8, max_steps=args.steps, bf16=True,
                              deepspeed=args.deepspeed, logging_steps=10, report_to=[])
    trainer = Trainer(model=model, args=targs, train_dataset=Synthetic())
    trainer.add_callback(dostune.HFTrainerCallback())
    trainer.train()


if __name__ == "__main__":
    main()
