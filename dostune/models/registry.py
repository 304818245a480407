"""Built-in model presets and the loader for a user's own model (``package.module:factory``).

A model spec couples a module builder with a batch factory. Presets are decoder LMs with random
weights; a user factory is a callable returning ``(model, batch_fn)`` where ``model(**batch)`` returns a
scalar loss (or an object with ``.loss``) and ``batch_fn(micro_batch, seq, generator, device)`` returns
the keyword arguments of one micro-batch.

Activation checkpointing is switched on the built module the way Hugging Face models switch it, for every kind:
``activation_checkpointing_enable`` (transformers 5.2x's name) or ``gradient_checkpointing_enable`` (its older,
deprecated one). Presets and ``hf:`` models have it; a factory's module must offer one of them.
"""
from __future__ import annotations

import importlib
import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from ..errors import DostuneError
from .decoder import DecoderConfig, DecoderLM, count_parameters, synthetic_batch

BatchFn = Callable[[int, int, torch.Generator, torch.device], dict]

# The presets a user is offered (--help, error messages).
PRESETS: dict[str, DecoderConfig] = {
    # tiny shapes for CPU smoke runs (the CPU quick start trains gpt2-tiny) and tests
    "gpt2-tiny": DecoderConfig("gpt2", layers=2, hidden=64, heads=4, vocab=512, max_positions=128),
    "llama-tiny": DecoderConfig("llama", layers=2, hidden=64, heads=4, vocab=512, max_positions=128, ffn=172,
                                kv_heads=2),
    # GPT-2 family (GPT-3 paper shapes, vocabulary padded to 50304)
    "gpt2-125m": DecoderConfig("gpt2", layers=12, hidden=768, heads=12, vocab=50304, max_positions=1024),
    "gpt2-350m": DecoderConfig("gpt2", layers=24, hidden=1024, heads=16, vocab=50304, max_positions=1024),
    "gpt2-760m": DecoderConfig("gpt2", layers=24, hidden=1536, heads=16, vocab=50304, max_positions=1024),
    "gpt2-1.3b": DecoderConfig("gpt2", layers=24, hidden=2048, heads=16, vocab=50304, max_positions=1024),
    "gpt2-2.7b": DecoderConfig("gpt2", layers=32, hidden=2560, heads=20, vocab=50304, max_positions=1024),
    "gpt2-6.7b": DecoderConfig("gpt2", layers=32, hidden=4096, heads=32, vocab=50304, max_positions=2048),
    # LLaMA family
    "llama-1.1b": DecoderConfig("llama", layers=22, hidden=2048, heads=32, vocab=32000, max_positions=2048,
                                ffn=5632, kv_heads=4),
    # OpenLLaMA 3B's shape (3.43B): the size that trains on one GPU without offload only on the largest ones
    "llama-3b": DecoderConfig("llama", layers=26, hidden=3200, heads=32, vocab=32000, max_positions=2048,
                              ffn=8640),
    "llama-7b": DecoderConfig("llama", layers=32, hidden=4096, heads=32, vocab=32000, max_positions=4096,
                              ffn=11008),
    "llama-13b": DecoderConfig("llama", layers=40, hidden=5120, heads=40, vocab=32000, max_positions=4096,
                               ffn=13824),
}

# Shapes the test suite and the CI gate run: resolvable by name like a preset, never offered.
CI_PRESETS: dict[str, DecoderConfig] = {
    "gpt2-small-test": DecoderConfig("gpt2", layers=4, hidden=256, heads=4, vocab=4096, max_positions=256),
    # optimizer-heavy, compute-light: the CI bench of the update step on a CPU (43M parameters, tiny layers)
    "ci-step-bench": DecoderConfig("gpt2", layers=2, hidden=1024, heads=8, vocab=32768, max_positions=64),
    # the CPU regression gate's model (dostune/bench/gate.py): 16M parameters in few tensors, 7 subgroups at
    # sub_group_size 2M, so a step has work for both lanes; at the gate's 4 tokens an iteration takes about 0.3 s on a
    # 2-core AVX2 machine, most of it backward's bf16 matrix products
    "ci-gate": DecoderConfig("gpt2", layers=2, hidden=768, heads=8, vocab=2048, max_positions=64),
}


@dataclass
class ModelSpec:
    """What dostune needs to build and feed a model."""

    name: str
    make: Callable[[], nn.Module]  # the module with random weights, activations kept
    batch: BatchFn
    num_params: Optional[int] = None  # analytic count, when known without building
    max_seq: Optional[int] = None
    config: dict = field(default_factory=dict)

    def check_seq(self, seq: int) -> None:
        """Refuse a sequence longer than the model's positions (before anything is built)."""
        if self.max_seq is not None and seq > self.max_seq:
            raise DostuneError(f"--seq {seq} exceeds {self.name}'s {self.max_seq} positions",
                               hint=f"give --seq {self.max_seq} or less, or a model with more positions")

    def build(self, checkpointing: bool = False) -> nn.Module:
        """The model; with ``checkpointing`` each transformer block's activations are recomputed in backward
        instead of kept (activation checkpointing)."""
        model = self.make()
        if checkpointing:
            enable_checkpointing(model, self.name)
        return model


# Non-reentrant: the recompute runs inside the same backward graph task, where ZeRO-3's module hooks gather the
# block's parameters again; it also needs no input that requires grad.
CHECKPOINT_KWARGS = {"use_reentrant": False}
# (method, name of its torch.utils.checkpoint keyword arguments), the current name first
ENABLERS = (("activation_checkpointing_enable", "activation_checkpointing_kwargs"),
            ("gradient_checkpointing_enable", "gradient_checkpointing_kwargs"))


def enable_checkpointing(model: nn.Module, name: str) -> None:
    """Switch on the model's own per-block checkpointing, non-reentrant where it takes checkpoint's arguments."""
    found = [(getattr(model, m), kw) for m, kw in ENABLERS if callable(getattr(model, m, None))]
    if not found:
        raise DostuneError(f"--model {name}: activation checkpointing needs the model to offer "
                           "gradient_checkpointing_enable() or activation_checkpointing_enable(), and it offers "
                           "neither",
                           hint="add one that wraps each block in torch.utils.checkpoint.checkpoint(..., "
                                "use_reentrant=False), or run without activation checkpointing")
    enable, kw = found[0]
    try:
        takes_kwargs = kw in inspect.signature(enable).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin): call it plainly
        takes_kwargs = False
    if takes_kwargs:
        enable(**{kw: dict(CHECKPOINT_KWARGS)})
    else:
        enable()


def _preset_spec(name: str, cfg: DecoderConfig) -> ModelSpec:
    def batch(micro_batch: int, seq: int, generator: torch.Generator, device) -> dict:
        return synthetic_batch(micro_batch, seq, cfg.vocab, generator, device)

    return ModelSpec(name=name, make=lambda: DecoderLM(cfg), batch=batch, num_params=count_parameters(cfg),
                     max_seq=cfg.max_positions, config={"preset": name, **cfg.as_dict()})


def _factory_spec(spec: str) -> ModelSpec:
    mod_name, _, attr = spec.partition(":")
    if not mod_name or not attr:
        raise DostuneError(f"--model {spec!r}: expected a preset name ({', '.join(PRESETS)}) or "
                           "'package.module:factory'")
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise DostuneError(f"--model {spec!r}: cannot import module {mod_name!r} ({e})",
                           hint="is the module on PYTHONPATH (run from its folder or pip install it)?") from None
    factory = getattr(module, attr, None)
    if factory is None or not callable(factory):
        raise DostuneError(f"--model {spec!r}: module {mod_name!r} has no callable {attr!r}")

    def build_pair():
        out = factory()
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], nn.Module) and callable(out[1])):
            raise DostuneError(f"--model {spec!r}: {attr}() must return (nn.Module, batch_fn), "
                               f"got {type(out).__name__}")
        return out

    cache: dict = {}

    def build():
        model, batch_fn = build_pair()
        cache["batch"] = batch_fn
        return model

    def batch(micro_batch, seq, generator, device):
        if "batch" not in cache:
            raise DostuneError(f"--model {spec!r}: build the model before asking for batches")
        return cache["batch"](micro_batch, seq, generator, device)

    return ModelSpec(name=spec, make=build, batch=batch, config={"factory": spec})


def _hf_spec(path: str) -> ModelSpec:
    try:
        import transformers
    except ImportError:
        raise DostuneError("--model hf:...: needs the optional 'transformers' package (pip install transformers)") \
            from None
    cfg_path = Path(path)
    if not cfg_path.exists():
        raise DostuneError(f"--model hf:{path}: config file not found")
    try:
        config = transformers.AutoConfig.from_pretrained(str(cfg_path))
    except (OSError, ValueError, KeyError) as e:  # malformed JSON, unknown model_type
        raise DostuneError(f"--model hf:{path}: not a Hugging Face model config ({str(e).splitlines()[0]})",
                           hint="a config.json with a model_type transformers knows, e.g. the config.json of "
                                "a model on the Hugging Face Hub") from None
    _check_hf_sizes(cfg_path, config)
    vocab = config.vocab_size
    with torch.device("meta"):  # the parameter count, without memory or initialisation
        num_params = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())

    class _Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = transformers.AutoModelForCausalLM.from_config(config)

        def forward(self, input_ids, labels):
            return self.inner(input_ids=input_ids, labels=labels).loss

        def gradient_checkpointing_enable(self):
            if not self.inner.supports_gradient_checkpointing:
                raise DostuneError(f"--model hf:{path}: {type(self.inner).__name__} does not support activation "
                                   "checkpointing (transformers' supports_gradient_checkpointing is False)",
                                   hint="run without activation checkpointing")
            enable_checkpointing(self.inner, f"hf:{path}")

    def batch(micro_batch, seq, generator, device):
        return synthetic_batch(micro_batch, seq, vocab, generator, device)

    return ModelSpec(name=f"hf:{path}", make=_Wrap, batch=batch, num_params=num_params,
                     max_seq=getattr(config, "max_position_embeddings", None),
                     config={"hf_config": json.loads(config.to_json_string())})


# The sizes a causal LM's config must give (transformers' standard names): one left out is filled in with the
# config class's default, which for most model types is a model of billions of parameters.
HF_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def _check_hf_sizes(path: Path, config) -> None:
    """Refuse a config.json that leaves out a size the model type has (under the name the type gives it)."""
    try:
        given = json.loads(path.read_text())
    except (OSError, ValueError):
        return  # AutoConfig read it: a form not worth second-guessing here
    names = getattr(type(config), "attribute_map", {}) or {}
    missing = [names.get(size, size) for size in HF_SIZES
               if hasattr(config, size) and names.get(size, size) not in given and size not in given]
    if missing:
        kind = type(config).__name__
        raise DostuneError(f"--model hf:{path}: the config gives no {', '.join(missing)}; transformers would fill "
                           f"in {kind}'s default{'s' if len(missing) > 1 else ''} and build a model of another size",
                           hint=f"add {', '.join(missing)} to {path} (a model's config.json on the Hugging Face Hub "
                                "has them all)")


def resolve_model(spec: str) -> ModelSpec:
    """A preset name, ``hf:path/to/config.json`` or ``package.module:factory``."""
    shape = PRESETS.get(spec) or CI_PRESETS.get(spec)
    if shape is not None:
        return _preset_spec(spec, shape)
    if spec.startswith("hf:"):
        return _hf_spec(spec[3:])
    if ":" not in spec:
        close = [p for p in PRESETS if spec.split("-")[0] in p]
        raise DostuneError(f"unknown model {spec!r}; presets: {', '.join(PRESETS)}"
                           + (f" (did you mean {close[0]}?)" if close else ""),
                           hint="or pass your own as 'package.module:factory'")
    return _factory_spec(spec)


def loss_of(output) -> torch.Tensor:
    """A model's forward may return the loss or an object carrying it (HF style)."""
    loss = getattr(output, "loss", output)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise DostuneError(f"the model's forward must return a scalar loss (or .loss), got {type(output).__name__}")
    return loss
