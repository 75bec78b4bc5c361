"""Capture time: pipecore's two captures, ``torch.fx`` (symbolic tracing) and ``torch.export`` (non-strict,
dynamic batch and sequence dimensions, mapped back onto the model), per model.

For each model of ``pipecore.models`` and each tiny Hugging Face model (built from a config: GPT-2, Llama,
BERT, BART, T5, ViT), each capture runs in a fresh subprocess (so neither pays for the other's imports or
caches) and is timed around ``CapturedModel(model, example_input=..., capture=...)`` alone; the JSON keeps
every repetition. A capture that fails (torch.fx on the Hugging Face models) is recorded as ``null`` with its
error.

    python bench/capture.py            # writes bench/out/capture-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from _machine import OUT_HELP, default_out, machine, write_report  # noqa: E402

MODELS = {
    "gpt": ("GPT(vocab_size=96, block_size=64, n_layer=4, n_head=4, n_embd=128)", "torch.randint(0, 96, (2, 64))"),
    "resnet": ("ResNet()", "torch.randn(2, 64)"),
    "encoder": ("Encoder(96, 64, 3)", "(torch.randint(0, 96, (2, 64)), torch.ones(2, 64, dtype=torch.bool))"),
    "hf-gpt2": ("T.GPT2LMHeadModel(T.GPT2Config(vocab_size=96, n_positions=64, n_embd=128, n_layer=4, "
                "n_head=4, use_cache=False))", "{'input_ids': torch.randint(0, 96, (2, 64))}"),
    "hf-llama": ("T.LlamaForCausalLM(T.LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256, "
                 "num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=64, use_cache=False))",
                 "{'input_ids': torch.randint(0, 96, (2, 64))}"),
    "hf-bert": ("T.BertForSequenceClassification(T.BertConfig(vocab_size=96, hidden_size=128, "
                "num_hidden_layers=4, num_attention_heads=4, intermediate_size=256, max_position_embeddings=64))",
                "{'input_ids': torch.randint(0, 96, (2, 64)), 'attention_mask': torch.ones(2, 64, dtype=torch.long)}"),
    "hf-bart": ("T.BartForConditionalGeneration(T.BartConfig(vocab_size=96, d_model=128, encoder_layers=2, "
                "decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=256, "
                "decoder_ffn_dim=256, max_position_embeddings=64, use_cache=False))",
                "{'input_ids': torch.randint(3, 96, (2, 64)), 'decoder_input_ids': torch.randint(3, 96, (2, 64))}"),
    "hf-t5": ("T.T5ForConditionalGeneration(T.T5Config(vocab_size=96, d_model=128, d_kv=32, d_ff=256, "
              "num_layers=2, num_decoder_layers=2, num_heads=4, use_cache=False, decoder_start_token_id=0))",
              "{'input_ids': torch.randint(1, 96, (2, 64)), 'decoder_input_ids': torch.randint(1, 96, (2, 64))}"),
    "hf-vit": ("T.ViTForImageClassification(T.ViTConfig(image_size=32, patch_size=8, hidden_size=128, "
               "num_hidden_layers=4, num_attention_heads=4, intermediate_size=256))",
               "{'pixel_values': torch.randn(2, 3, 32, 32)}"),
}

_CHILD = """
import json, logging, time, torch
logging.disable(logging.WARNING)
try:
    import transformers as T
except ImportError:
    T = None
from pipecore.models import GPT, ResNet, Encoder
from pipecore.engine.graph import CapturedModel
model, example = {model}, {args}
t0 = time.perf_counter()
try:
    CapturedModel(model, example_input=example, capture={capture!r})
    print(json.dumps([time.perf_counter() - t0, None]))
except Exception as exc:
    print(json.dumps([None, f"{{type(exc).__name__}}: {{str(exc).splitlines()[0]}}"]))
"""


def capture_seconds(name: str, capture: str) -> tuple[float | None, str | None]:
    """Seconds one capture takes in a fresh process (None and the error where it fails)."""
    model, args = MODELS[name]
    code = _CHILD.format(model=model, args=args, capture=capture)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    seconds, error = json.loads(out.stdout.strip().splitlines()[-1])
    return seconds, error


def _median(values: list[float | None]) -> float | None:
    return None if any(v is None for v in values) else statistics.median(values)  # type: ignore[type-var]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=default_out("capture-cpu.json"), help=OUT_HELP)
    args = parser.parse_args()
    results = {}
    print(f"{'model':<9} {'torch.fx s':>11} {'torch.export s':>15}")
    for name in MODELS:
        fx = [capture_seconds(name, "fx") for _ in range(args.repeats)]
        ex = [capture_seconds(name, "export") for _ in range(args.repeats)]
        results[name] = {"model": MODELS[name][0], "example_input": MODELS[name][1],
                         "fx_seconds": [s for s, _ in fx], "export_seconds": [s for s, _ in ex],
                         "fx_median": _median([s for s, _ in fx]), "export_median": _median([s for s, _ in ex]),
                         "fx_error": fx[0][1], "export_error": ex[0][1]}
        show = [("fails" if m is None else f"{m:.3f}") for m in (results[name]["fx_median"],
                                                                   results[name]["export_median"])]
        print(f"{name:<9} {show[0]:>11} {show[1]:>15}")
    report = {"benchmark": "capture", "device": "cpu", "dtype": "float32", "machine": machine(),
              "repeats": args.repeats, "statistic": "median of repeats, each in a fresh process",
              "what": "pipecore.engine.graph.CapturedModel(model, example_input=..., capture='fx' | 'export')", "results": results}
    print(f"wrote {write_report(report, args.out)}")


if __name__ == "__main__":
    main()
