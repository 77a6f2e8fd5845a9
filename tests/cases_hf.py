"""Hugging Face models built from small configs (random weights), trained in the loop style the HF Trainer uses:
zero_grad after the update, an LR scheduler, an evaluation step between training steps, a short last batch.
test_hf_models.py calls these on every rank of a gloo pool."""

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import zerofx
from cases_loops import PRECISIONS, assert_matches_ddp

VOCAB = 64


def _model(arch: str):
    import transformers

    torch.manual_seed(0)
    if arch == "llama":
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                          tie_word_embeddings=True)
        model = transformers.LlamaForCausalLM(config)
    elif arch == "mixtral":  # Mixture of Experts: the experts run as torch._grouped_mm; the load-balancing loss
        # reads the router logits, which transformers collects with hooks it installs on the first forward
        config = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                            num_local_experts=4, num_experts_per_tok=2, output_router_logits=True)
        model = transformers.MixtralForCausalLM(config)
    elif arch == "t5":  # encoder-decoder: the labels shifted right feed the decoder; relative position biases
        config = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                       decoder_start_token_id=0)
        model = transformers.T5ForConditionalGeneration(config)
    elif arch == "bert":  # encoder, masked-LM head tied to the embeddings, token-type embeddings
        config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=64, max_position_embeddings=32)
        model = transformers.BertForMaskedLM(config)
    else:  # GPT-2 with its dropouts on
        config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                         resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
        model = transformers.GPT2LMHeadModel(config)
    config._attn_implementation = "sdpa"
    return model


def _hf_step(model, optimizer, input_ids):
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _batch(i: int, rank: int, batch: int = 4):
    return torch.randint(0, VOCAB, (batch, 16), generator=torch.Generator().manual_seed(100 * i + rank))


def hf_loop_against_ddp(rank, world_size, stage, arch, steps=6):
    ref_model = _model(arch)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=3e-3, weight_decay=0.01)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda i: min(1.0, (i + 1) / 3))
    ddp = DDP(ref_model)
    model = _model(arch)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 3))
    step = zerofx.compile(_hf_step, stage=stage, bucket_bytes=16 * 1024)
    for i in range(steps):
        for m in (model, ref_model):
            m.train(i != 2)  # one evaluation-mode step: dropout off
        batch = _batch(i, rank, batch=2 if i == steps - 1 else 4)  # the epoch's short last batch
        torch.manual_seed(1000 + i)  # the same dropout masks for both, drawn in the same order
        loss = step(model, opt, batch).item()
        torch.manual_seed(1000 + i)
        ref_loss = _hf_step(ddp, ref_opt, batch).item()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0, msg=f"{arch} stage {stage} step {i}")
        sched.step()
        ref_sched.step()
    assert_matches_ddp(step, ref_model, ref_opt, atol=1e-6)
    return {"traces": step.stats().traces}


def hf_mixed_precision_against_fsdp2(rank, world_size, stage, arch, precision, steps=4):
    """bf16, or float16 with loss scaling (FSDP2 beside it with GradScaler), against FSDP2 with the same policy on
    each decoder layer."""
    ref_model = _model(arch)
    policy = MixedPrecisionPolicy(param_dtype=PRECISIONS[precision])
    for layer in ref_model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(ref_model, mp_policy=policy)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=3e-3, weight_decay=0.01)
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")
    model = _model(arch)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    step = zerofx.compile(_hf_step, stage=stage, mixed_precision=zerofx.MixedPrecision(PRECISIONS[precision]))
    losses, ref_losses = [], []
    for i in range(steps):
        batch = _batch(i, rank)
        losses.append(step(model, opt, batch).item())
        ref_loss = ref_model(input_ids=batch, labels=batch).loss
        scaler.scale(ref_loss).backward()
        scaler.step(ref_opt)
        scaler.update()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    torch.testing.assert_close(losses, ref_losses, rtol=1e-2, atol=0)
    return losses
