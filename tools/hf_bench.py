"""Hugging Face transformers' DeepSeek-V4 with csa_compressor.transformers installed against
not installed, on the GPU: a training step (forward + backward) and greedy generate().

    PYTHONPATH=/path/to/transformers-5.23:$PYTHONPATH python tools/hf_bench.py
        [--batch 8] [--seq 4096] [--prompt 1024] [--new 64] [--numerics eager]

The model: hidden 4096, head_dim 512 (the realistic compressor size), one CSA layer (ratio
4, with its indexer), one HCA layer (ratio 128) and one sliding layer; the rest small
(4 heads, 4 experts, vocabulary 1024), bf16 with transformers' fp32 modules.

- Training step (``use_cache=False``, as fine-tuning runs): CUDA events around 3 back-to-back steps (median of 3; host included, no
  graph: the model is eager). The compressor's part: each compressor module replayed alone
  on the inputs it saw in one forward (hooks), forward + backward to its inputs and
  parameters (the indexer's forward only: its top-k indices carry no gradient).
- generate(): tokens per second of ``batch`` prompts of ``prompt`` tokens and ``new`` new
  tokens each (greedy, KV caches). The compressor's part: a second run with each
  compressor forward bracketed by synchronizes and timed (that run's total is the base).

Installed rows are reported only if no compressor fell back (fallback_reasons() empty).
"""

from __future__ import annotations

import os as _os, sys as _sys  # noqa: E401
_sys.path.insert(0, _os.path.dirname(_os.path.abspath(__file__)))
from _tool import start  # noqa: E402

start(__doc__, gpu=True, own_help=True)

import argparse  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from csa_compressor import transformers as csa_hf  # noqa: E402
from csa_compressor.cli.module_bench import steps_us  # noqa: E402

NAMES = ("DeepseekV4CSACompressor", "DeepseekV4HCACompressor", "DeepseekV4Indexer")


def build(seed=0):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    cfg = DeepseekV4Config(
        vocab_size=1024, hidden_size=4096, num_hidden_layers=3, num_attention_heads=4,
        head_dim=512, q_lora_rank=256, o_lora_rank=128, o_groups=2, index_head_dim=128,
        index_n_heads=4, index_topk=512, sliding_window=128, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=256, intermediate_size=512,
        layer_types=["compressed_sparse_attention", "heavily_compressed_attention",
                     "sliding_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128})
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM._from_config(cfg, dtype=torch.bfloat16).cuda()
    keep = tuple(model._keep_in_fp32_modules_strict or ())
    for name, p in model.named_parameters():  # as from_pretrained keeps them
        if any(k in name.split(".") for k in keep):
            p.data = p.data.float()
    return model


def compressors(model):
    return [(n, m) for n, m in model.named_modules() if type(m).__name__ in NAMES]


def train_step(model, ids):
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()


def compressor_step_us(model, ids):
    """µs of every compressor's forward + backward, replayed alone on its inputs."""
    seen = []
    hooks = [m.register_forward_pre_hook(lambda m, a, k: seen.append((m, a, k)), with_kwargs=True)
             for _, m in compressors(model)]
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)  # no cache: the compressors' training path
    for h in hooks:
        h.remove()
    calls = []
    def leaf(a):  # each replay its own graph: the model's forward is long gone
        return a.detach().requires_grad_(a.is_floating_point()) if torch.is_tensor(a) else a

    for m, args, kwargs in seen:
        args = [leaf(a) for a in args]
        kwargs = {k: leaf(v) for k, v in kwargs.items()}
        calls.append((m, args, kwargs, type(m).__name__ != "DeepseekV4Indexer"))

    def step():
        for m, args, kwargs, grad in calls:
            if not grad:
                with torch.no_grad():
                    m(*args, **kwargs)
                continue
            out = m(*args, **kwargs)
            out = out[0] if isinstance(out, tuple) else out
            out.float().sum().backward()

    return steps_us(step, n=3, repeats=3)


def generate(model, ids, new):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                          min_new_tokens=new, do_sample=False, pad_token_id=0)


def generate_timed(model, ids, new, bracket=False):
    """(seconds, seconds inside compressor forwards or None)."""
    inside = [0.0]
    hooks = []
    if bracket:
        t0 = {}

        def pre(m, a, k):
            torch.cuda.synchronize()
            t0[m] = time.perf_counter()

        def post(m, a, k, out):
            torch.cuda.synchronize()
            inside[0] += time.perf_counter() - t0.pop(m)

        for _, m in compressors(model):
            hooks.append(m.register_forward_pre_hook(pre, with_kwargs=True))
            hooks.append(m.register_forward_hook(post, with_kwargs=True))
    torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.no_grad():
        generate(model, ids, new)
    torch.cuda.synchronize()
    t = time.perf_counter() - t
    for h in hooks:
        h.remove()
    return t, (inside[0] if bracket else None)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--numerics", default="eager")
    a = ap.parse_args()
    import transformers

    model = build()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 1024, (a.batch, a.seq), generator=g).cuda()
    prompts = ids[:, : a.prompt].contiguous()
    rows = {}
    for label, on in (("not installed", False), ("installed", True)):
        if on:
            csa_hf.install(numerics=a.numerics)
            csa_hf.clear_fallback_reasons()
        try:
            step = steps_us(lambda: train_step(model, ids), n=3, repeats=3)
            comp = compressor_step_us(model, ids)
            generate(model, prompts, 4)  # warm
            secs, _ = generate_timed(model, prompts, a.new)
            secs_b, inside = generate_timed(model, prompts, a.new, bracket=True)
            if on and csa_hf.fallback_reasons():
                raise SystemExit(f"fell back: {csa_hf.fallback_reasons()}")
        finally:
            if on:
                csa_hf.uninstall()
        rows[label] = (step, comp, a.batch * a.new / secs, inside / secs_b)
        print(label, rows[label], flush=True)
    dev = torch.cuda.get_device_properties(0)
    print(f"\nGPU {dev.name}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"numerics={a.numerics!r}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
          f"hidden 4096, head_dim 512, bf16; training {a.batch}x{a.seq} tokens; generate "
          f"{a.batch} prompts x {a.prompt} tokens + {a.new} new")
    print("| | training step ms | compressors fwd+bwd ms (share) | generate tokens/s | "
          "compressors' share of generate |")
    print("|---|---|---|---|---|")
    for label, (step, comp, tps, share) in rows.items():
        print(f"| {label} | {step / 1e3:.2f} | {comp / 1e3:.2f} ({100 * comp / step:.0f}%) | "
              f"{tps:.0f} | {100 * share:.0f}% |")


if __name__ == "__main__":
    main()
