"""A tiny random DeepSeek-V4 of Hugging Face transformers for the adapter's tests: both
compressed layer kinds (CSA ratio 4 with its indexer, HCA ratio ``hca``) and a sliding one."""

import torch


def tiny_model(seed=0, hca=16, dtype=torch.bfloat16, device="cpu", hidden=64, head_dim=32):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    cfg = DeepseekV4Config(
        vocab_size=128, hidden_size=hidden, num_hidden_layers=3, num_attention_heads=4,
        head_dim=head_dim, q_lora_rank=32, o_lora_rank=16, o_groups=2, index_head_dim=16,
        index_n_heads=2, index_topk=8, sliding_window=16, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=64,
        layer_types=["compressed_sparse_attention", "heavily_compressed_attention",
                     "sliding_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": hca})
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM._from_config(cfg, dtype=dtype).to(device)
    # from_pretrained keeps these in fp32; _from_config does so from 5.25 only
    keep = tuple(model._keep_in_fp32_modules_strict or ())
    for name, p in model.named_parameters():
        if any(k in name.split(".") for k in keep):
            p.data = p.data.float()
    with torch.no_grad():  # the biases and norms away from their initial constants
        for name, p in model.named_parameters():
            if "position_bias" in name or "kv_norm" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name)))
                        .to(p.dtype) * 0.5 + ("kv_norm" in name))
    return model


def train_step(model, ids, mask=None):
    """Loss and every parameter gradient of one forward + backward."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                               if p.grad is not None}


def greedy(model, ids, new=32):
    """Greedy generate(): the token ids and every step's logits."""
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                         do_sample=False, output_logits=True, return_dict_in_generate=True,
                         pad_token_id=0)
    return out.sequences, torch.stack(out.logits)
