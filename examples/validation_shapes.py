"""Four decoder shapes that dostune's performance model was validated on without having seen them: no profile,
bench or coefficient in this repository came from them before their `dostune tune --validate` runs
(results/h100/heldout/, docs/performance-model.md, "Validating"). Both families, 0.9B to 6B parameters, with widths,
depths and attention layouts none of the presets has:

    dostune tune ... --model examples.validation_shapes:gpt2_0_9b --validate 3

(run from the repository root). Random weights, as the presets: the model is for timing, not for quality.
"""
from dostune.models.decoder import DecoderConfig, DecoderLM, synthetic_batch

SHAPES = {
    # GPT-2 family: tied head, 4x MLP, learned positions
    "gpt2_0_9b": DecoderConfig("gpt2", layers=20, hidden=1792, heads=14, vocab=50304, max_positions=1024),
    "gpt2_3_6b": DecoderConfig("gpt2", layers=36, hidden=2816, heads=22, vocab=50304, max_positions=1024),
    # LLaMA family: gated MLP, grouped-query attention, untied head
    "llama_2b": DecoderConfig("llama", layers=26, hidden=2560, heads=20, vocab=32000, max_positions=2048, ffn=6912,
                              kv_heads=4),
    "llama_6b": DecoderConfig("llama", layers=30, hidden=4096, heads=32, vocab=32000, max_positions=4096, ffn=12288,
                              kv_heads=8),
}


def _factory(cfg: DecoderConfig):
    def build():
        return DecoderLM(cfg), lambda micro_batch, seq, generator, device: synthetic_batch(
            micro_batch, seq, cfg.vocab, generator, device)

    return build


gpt2_0_9b = _factory(SHAPES["gpt2_0_9b"])
gpt2_3_6b = _factory(SHAPES["gpt2_3_6b"])
llama_2b = _factory(SHAPES["llama_2b"])
llama_6b = _factory(SHAPES["llama_6b"])
