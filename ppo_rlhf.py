"""PPO for RLHF in one file: fine-tune a language model against a reward model (or a reward function).

    python ppo_rlhf.py                       # built-in toy task, offline, CPU, ~3 min: a tiny Llama learns to add
    python ppo_rlhf.py --model_name_or_path <sft> --reward_model_path <rm> --dataset prompts.jsonl ...
    torchrun --nproc_per_node 8 ppo_rlhf.py --distributed fsdp ...        # one node; --nnodes M ... for several

A state s_t is the prompt x plus the response so far y_<t, an action is the next token y_t. For a response
y_1..y_L sampled from π_old (the policy that generated it) the per-token reward and the losses are
    r_t    = −β·KL_t + [t = L]·score(x, y)        KL_t = log π_old(y_t|s_t) − log π_ref(y_t|s_t)    (k1)
    A_t    = GAE(γ, λ) of r_t with the value model V(s_t);   R_t = A_t + V_old(s_t)
    L_clip = −E_t[min(ρ_t·A_t, clip(ρ_t, 1−ε, 1+ε)·A_t)]       ρ_t = π_θ(y_t|s_t) / π_old(y_t|s_t)
    L_V    = ½·E_t[max((V − R_t)², (clip(V, V_old ± ε_v) − R_t)²)]        loss = L_clip + c_v·L_V
PPO is on-policy: sample a batch with the current policy and keep each token's log-prob, take num_ppo_epochs
passes of small steps over that fresh batch, then throw it away. ρ_t corrects for π_θ drifting from π_old
inside those epochs, but only for the choice of token, not for the states a drifted policy would visit; the
clip, the KL penalty to π_ref and target_kl early stopping keep π_θ close enough for that to hold.

Follows Schulman et al. 2017 (PPO), Ziegler et al. 2019 and Stiennon et al. 2020 (RLHF), and Huang et al.
2024 ("The N+ implementation details of RLHF with PPO"); flag and metric names follow TRL's PPOTrainer.
Differs from TRL on purpose: the score lands on the last real response token (TRL: one past it), every
forward gets position_ids, sampling is a plain loop over softmax(z / T) (no generation_config surprises), and the
loss is the token mean over the whole minibatch on all devices (TRL: a mean of micro-batch means).
"""
import atexit
import copy
import importlib
import importlib.util
import inspect
import json
import os
import pickle
import random
import resource
import shutil
import signal
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Literal, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
import tyro
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
from transformers import DynamicCache


@dataclass
class Args:
    # --- experiment
    exp_name: str = "ppo_rlhf"
    """name of this run (used in the default output_dir and in wandb)"""
    seed: int = 1
    """seed of python and torch: prompt order, sampling, new weights"""
    output_dir: Optional[str] = None
    """where metrics.jsonl, the policy and the value model go; default runs/<exp_name>__<seed>__<unix time>"""
    track: bool = False
    """log metrics to Weights & Biases (needs `pip install wandb`)"""
    wandb_project_name: str = "ppo_rlhf"
    """wandb project, with --track"""
    num_sample_generations: int = 10
    """print a few completions with their scores this many times during training (0: never)"""
    save_every: int = 0
    """write a resumable checkpoint into output_dir every this many updates (0: only when stopped by a signal)"""
    save_total_limit: int = 2
    """keep this many newest checkpoints (0: keep all)"""
    resume: Optional[str] = None
    """`auto`: continue from the newest complete checkpoint in output_dir (or start if there is none); or a checkpoint"""

    # --- models and data
    model_name_or_path: str = "builtin"
    """policy (SFT) checkpoint: hub name or local folder; `builtin` builds the toy task's tiny Llama"""
    ref_model_path: Optional[str] = None
    """reference policy π_ref for the KL penalty; default: a frozen copy of the initial policy"""
    value_model_path: Optional[str] = None
    """value model init; default: the reward model if it shares the policy's vocabulary, else the policy (new head)"""
    reward_model_path: Optional[str] = None
    """reward model (sequence classifier, 1 label); if given it is used instead of --reward_fn"""
    reward_fn: Optional[str] = "ppo_rlhf:addition_reward"
    """`module:function` or `file.py:function` mapping (prompts, completions) to a list of floats"""
    dataset: str = "builtin"
    """prompts: a .txt (one per line), a .jsonl (`prompt`, or chat `messages`), or a hub dataset (needs `datasets`)"""
    dataset_train_split: str = "train"
    """split of a hub dataset"""
    trust_remote_code: bool = False
    """allow models and tokenizers that ship their own code"""

    # --- rollout
    total_episodes: int = 51200
    """prompts (episodes) over the whole run; updates = total_episodes // rollout batch"""
    response_length: int = 2
    """most tokens sampled per response"""
    temperature: float = 1.0
    """sampling temperature T: the policy is softmax(logits / T), in rollout and in training"""
    stop_token: Optional[Literal["eos"]] = "eos"
    """end responses at the tokenizer's EOS (None: always sample response_length tokens)"""
    stop_token_id: Optional[int] = None
    """end responses at this token id instead"""
    missing_eos_penalty: Optional[float] = None
    """subtracted from the score of responses that contain no EOS"""
    local_rollout_forward_batch_size: int = 64
    """rows per generation and scoring forward during the rollout"""

    # --- PPO
    per_device_train_batch_size: int = 128
    """with gradient_accumulation_steps, the rollout batch: prompts per update = this x gradient_accumulation_steps"""
    gradient_accumulation_steps: int = 1
    """micro-batches per minibatch (one optimizer step per minibatch)"""
    num_mini_batches: int = 2
    """minibatches (optimizer steps) per pass over the rollout batch"""
    num_ppo_epochs: int = 4
    """passes over each rollout batch"""
    kl_coef: float = 0.05
    """β, the per-token KL penalty coefficient"""
    kl_estimator: Literal["k1", "k3"] = "k1"
    """k1: log π_old/π_ref (unbiased, can be < 0); k3: ρ − 1 − log ρ with ρ = π_ref/π_old (unbiased, >= 0)"""
    cliprange: float = 0.2
    """ε of the clipped surrogate"""
    cliprange_value: float = 0.2
    """ε_v of the clipped value loss"""
    vf_coef: float = 0.1
    """c_v, weight of the value loss"""
    gamma: float = 1.0
    """discount γ"""
    lam: float = 0.95
    """GAE λ"""
    whiten_rewards: bool = False
    """scale per-token rewards to unit variance over the batch (mean kept)"""
    target_kl: Optional[float] = None
    """stop this update's epochs once the approx KL(π_old‖π_θ) of a minibatch exceeds this"""

    # --- optimisation
    learning_rate: float = 1e-3
    """AdamW learning rate (the default suits the toy task; real models want ~1e-6 to 3e-6)"""
    anneal_lr: bool = True
    """decay the learning rate linearly to 0 over the run"""
    max_grad_norm: float = 1.0
    """clip the global gradient norm of policy + value parameters"""

    # --- system
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """bf16/fp16: autocast forwards and backwards, fp32 master weights and optimizer; frozen models in that dtype"""
    gradient_checkpointing: bool = False
    """recompute the policy's and value model's activations in the backward pass: less memory, ~1/3 more compute"""

    # --- distributed (under torchrun; batch sizes above are per device)
    distributed: Literal["ddp", "fsdp"] = "ddp"
    """ddp: every device holds the whole policy and value model, gradients are averaged; fsdp: FSDP2 shards their
    weights, gradients and optimizer state over the devices"""
    shard_frozen_models: bool = False
    """with fsdp: shard the reference and reward models too (less memory; their layers are gathered per forward)"""
    rollout_unshard: bool = True
    """with fsdp: gather the policy's weights once for the whole rollout instead of per layer at every sampled token;
    turn off if the full policy does not fit on one device"""
    dist_timeout_s: int = 1800
    """seconds a collective waits for the other ranks before the run fails (a hang then ends instead of stalling)"""


def fail(message):
    """Bad input ends the run with one line naming the flag to fix (no traceback); nothing written is touched."""
    raise SystemExit(f"error: {message}")


# ------------------------------------------------------------------------------------------ math (pure)
def masked_mean(x, mask, dim=None):
    """Σ x·m / Σ m over the real (mask=True) entries."""
    x = torch.where(mask, x, 0.0)
    return x.sum() / mask.sum() if dim is None else x.sum(dim) / mask.sum(dim)


def masked_var(x, mask):
    """Unbiased variance of the real entries."""
    mean = masked_mean(x, mask)
    n = mask.sum()
    return masked_mean((x - mean) ** 2, mask) * n / (n - 1).clamp(min=1)  # 0, not NaN, for a single entry


def all_ranks_sum(x):
    """Σ of x over all ranks under torchrun (in place); x itself in a single process."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(x)
    return x


def batch_mean_var(x, mask):
    """Mean and unbiased variance of the real entries of the whole batch: over all ranks under torchrun, so each
    rank gets what one process holding the concatenated batch would. Two passes (Σx, then Σ(x − μ)²) for accuracy."""
    n, total = all_ranks_sum(torch.stack([mask.sum().to(x.dtype), torch.where(mask, x, 0.0).sum()]))
    mean = total / n
    return mean, all_ranks_sum(torch.where(mask, (x - mean) ** 2, 0.0).sum()) / (n - 1).clamp(min=1)


def masked_whiten(x, mask, shift_mean=True):
    """(x − μ) / σ with μ, σ² of the batch's real entries; shift_mean=False keeps μ (scales only)."""
    mean, var = batch_mean_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def logprobs_chunk_rows(vocab_size):
    """Rows per chunk so that one float32 chunk of logits is about 64 MiB."""
    return max(1, 2**24 // vocab_size)


def chunk_logits(x, weight, bias, temperature):
    """One chunk's z / T in a new float32 tensor: z is x itself, or the output layer z = x·Wᵀ + b applied to hidden
    states x (N, H). The callers work on it in place, so each chunk costs one (chunk, V) float32 tensor."""
    z = x.to(torch.float32, copy=True) if weight is None else F.linear(x.to(weight.dtype), weight, bias).float()
    return z.div_(temperature)


class TokenLogprobs(torch.autograd.Function):
    """log π(a) = z_a/T − logsumexp(z/T) and the entropy H = logsumexp(z/T) − Σ_v π_v·z_v/T in float32, one chunk of
    rows at a time. z comes as logits x (N, V), or is computed chunk by chunk from hidden states x (N, H) and the
    output layer (W, b): then no (N, V) tensor ever exists whole, and backward computes each chunk's z once more.
    Backward: ∂ log π(a) / ∂z = (onehot(a) − π) / T;  then ∂x = ∂z·W,  ∂W = Σ_chunks ∂zᵀ·x,  ∂b = Σ_rows ∂z."""

    @staticmethod
    def forward(ctx, x, weight, bias, tokens, temperature):  # x (N, V) or (N, H), weight (V, H) or None, tokens (N,)
        if weight is not None and torch.is_autocast_enabled(x.device.type):  # the matmul in autocast's dtype
            dtype = torch.get_autocast_dtype(x.device.type)
            weight, bias = weight.to(dtype), None if bias is None else bias.to(dtype)
        n, chunk = x.shape[0], logprobs_chunk_rows(x.shape[1] if weight is None else weight.shape[0])
        lse = torch.empty(n, dtype=torch.float32, device=x.device)
        entropy, logprobs = torch.empty_like(lse), torch.empty_like(lse)
        for s in range(0, n, chunk):
            z = chunk_logits(x[s : s + chunk], weight, bias, temperature)
            lse[s : s + chunk] = z.logsumexp(-1)
            logprobs[s : s + chunk] = z.gather(-1, tokens[s : s + chunk, None]).squeeze(-1) - lse[s : s + chunk]
            entropy[s : s + chunk] = lse[s : s + chunk] - (z - lse[s : s + chunk, None]).exp_().mul_(z).sum(-1)
        ctx.save_for_backward(x, weight, bias, tokens, lse)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, _):
        x, weight, bias, tokens, lse = ctx.saved_tensors
        grad_x = torch.empty_like(x)
        grad_w = None if weight is None else torch.zeros(weight.shape, dtype=torch.float32, device=x.device)
        grad_b = None if bias is None else torch.zeros(bias.shape, dtype=torch.float32, device=x.device)
        chunk = logprobs_chunk_rows(x.shape[1] if weight is None else weight.shape[0])
        for s in range(0, x.shape[0], chunk):
            g = grad_logprobs[s : s + chunk, None]
            probs = chunk_logits(x[s : s + chunk], weight, bias, ctx.temperature).sub_(lse[s : s + chunk, None]).exp_()
            grad_z = probs.mul_(-g).scatter_add_(-1, tokens[s : s + chunk, None], g).div_(ctx.temperature)  # (chunk, V)
            if weight is None:
                grad_x[s : s + chunk] = grad_z
                continue
            grad_x[s : s + chunk] = grad_z.to(weight.dtype) @ weight
            if weight.dtype == torch.float32:  # in place: no (V, H) temporary per chunk
                grad_w.addmm_(grad_z.T, x[s : s + chunk].float())
            else:
                grad_w += (grad_z.to(weight.dtype).T @ x[s : s + chunk].to(weight.dtype)).float()
            if bias is not None:
                grad_b += grad_z.sum(0)
        return grad_x, grad_w, grad_b, None, None


def token_logprobs(x, tokens, temperature=1.0, head=None):
    """(B, T, V) logits, or (B, T, H) hidden states and the output layer `head` (an nn.Linear), and (B, T) tokens
    -> log π(token) (B, T) and entropy (B, T), both float32."""
    weight, bias = (None, None) if head is None else (head.weight, head.bias)
    logprobs, entropy = TokenLogprobs.apply(x.flatten(0, 1), weight, bias, tokens.flatten(), temperature)
    return logprobs.view(tokens.shape), entropy.view(tokens.shape)


def first_true_index(bools):
    """(B, T) -> (B,): index of the first True in each row, T where there is none."""
    t = bools.shape[-1]
    return torch.where(bools, torch.arange(t, device=bools.device), t).min(-1).values


def response_lengths(responses, stop_token_id):
    """Real tokens per response: up to and including the first stop token, all of them if there is none."""
    if stop_token_id is None:
        return torch.full(responses.shape[:1], responses.shape[1], device=responses.device)
    return (first_true_index(responses == stop_token_id) + 1).clamp(max=responses.shape[1])


def kl_penalty(logprobs, ref_logprobs, kl_estimator):
    """Per-token estimate of KL(π_old‖π_ref) from tokens sampled by π_old: k1 = −log ρ, k3 = ρ − 1 − log ρ,
    with ρ = π_ref/π_old (Schulman 2020, "Approximating KL divergence")."""
    log_ratio = ref_logprobs - logprobs
    return -log_ratio if kl_estimator == "k1" else log_ratio.exp() - 1 - log_ratio


def per_token_rewards(scores, kl, response_mask, kl_coef):
    """r_t = −β·KL_t, plus the sequence's score on its last real token; 0 after it. (B,), (B, T) -> (B, T)."""
    rewards = torch.where(response_mask, -kl_coef * kl, 0.0)
    last = response_mask.sum(-1) - 1
    rewards[torch.arange(len(scores), device=scores.device), last] += scores
    return rewards


def gae(rewards, values, response_mask, gamma, lam):
    """δ_t = r_t + γ·V_{t+1} − V_t;  A_t = δ_t + γλ·A_{t+1};  R_t = A_t + V_t. V and A are 0 after the last real
    token, so the episode ends there (at the stop token or at response_length). (B, T) -> (B, T), (B, T)."""
    values = torch.where(response_mask, values, 0.0)
    rewards = torch.where(response_mask, rewards, 0.0)
    advantages = torch.zeros_like(rewards)
    next_value, next_advantage = torch.zeros_like(rewards[:, 0]), torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantages[:, t] = next_advantage = delta + gamma * lam * next_advantage
        next_value = values[:, t]
    return advantages, advantages + values


def policy_loss(logprobs, old_logprobs, advantages, mask, cliprange):
    """Clipped surrogate −E[min(ρ·A, clip(ρ, 1−ε, 1+ε)·A)]; also the fraction of tokens where the clip is active
    and the approx KL(π_old‖π_θ) ≈ E[(ρ − 1) − log ρ] (k3, unbiased and >= 0)."""
    log_ratio = logprobs - old_logprobs
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - cliprange, 1.0 + cliprange)
    loss = masked_mean(torch.max(unclipped, clipped), mask)
    clipfrac = masked_mean((clipped > unclipped).to(ratio.dtype), mask)
    approxkl = masked_mean((ratio - 1) - log_ratio, mask)
    return loss, clipfrac, approxkl


def value_loss(values, old_values, returns, mask, cliprange_value):
    """½·E[max((V − R)², (V_old + clip(V − V_old, ±ε_v) − R)²)] and the fraction of tokens where the clip is active."""
    clipped_values = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    unclipped_loss, clipped_loss = (values - returns) ** 2, (clipped_values - returns) ** 2
    loss = 0.5 * masked_mean(torch.max(unclipped_loss, clipped_loss), mask)
    return loss, masked_mean((clipped_loss > unclipped_loss).to(loss.dtype), mask)


def explained_variance(predicted, target, mask):
    """1 − Var[target − predicted] / Var[target]: 1 is a perfect value function, 0 no better than a constant."""
    return 1 - batch_mean_var(target - predicted, mask)[1] / batch_mean_var(target, mask)[1]


def prompt_indices(num_prompts, batch_size, update, seed, rank=0, world_size=1):
    """This rank's prompts for update `update` (0-based): the update takes the next world_size x batch_size of an
    endless stream of reshuffled passes over the data, and rank r the r-th slice of those (a prompt comes twice in
    one update only if the data has fewer prompts than that). A pure function of its arguments, so the position in
    the stream is just the update counter."""
    start = (update * world_size + rank) * batch_size
    passes = range(start // num_prompts, (start + batch_size - 1) // num_prompts + 1)
    seeds = [seed * 1_000_003 + p for p in passes]  # not seed + p: seed 2's first pass would be seed 1's second
    stream = torch.cat([torch.randperm(num_prompts, generator=torch.Generator().manual_seed(s)) for s in seeds])
    offset = start - passes[0] * num_prompts
    return stream[offset : offset + batch_size]


def left_pad(sequences, pad_token_id):
    """Lists of token ids -> ids (B, P) and attention mask (B, P), padded on the left so all prompts end at P."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.bool)
    for i, s in enumerate(sequences):
        ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s) :] = True
    return ids, mask


# ------------------------------------------------------------------------------------------ models
def load_pretrained(cls, path, flag, args, **kwargs):
    """from_pretrained with dropout off (it would make the training forward disagree with the rollout's π_old)."""
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=args.trust_remote_code, **kwargs)
        for key, value in config.to_dict().items():
            if ("dropout" in key or key.endswith("pdrop")) and isinstance(value, float):
                setattr(config, key, 0.0)
        model = cls.from_pretrained(path, config=config, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError) as e:
        fail(f"--{flag} {path!r} could not be loaded: {str(e).strip().splitlines()[0]}")
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def load_tokenizer(path, flag, args):
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError) as e:
        fail(f"--{flag} {path!r}: no tokenizer could be loaded: {str(e).strip().splitlines()[0]}")


def ensure_pad_token(tokenizer):
    """Give a tokenizer without a pad token, or whose pad token is EOS, a distinct one: EOS is an action the policy
    takes and must never be mistaken for padding."""
    if tokenizer.pad_token is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        tokenizer.add_special_tokens({"pad_token": "<|pad|>"})
    return tokenizer


def fit_tokenizer(model, tokenizer):
    """Make room for an added pad token and record it in the config (HF's own pooling reads config.pad_token_id)."""
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))
    model.config.pad_token_id = tokenizer.pad_token_id


def forward_kwargs(input_ids, attention_mask):
    """position_ids count real tokens only, so left padding changes nothing (GPT-2 is off by ~0.5 nats without)."""
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False)


def last_hidden(model, input_ids, attention_mask, keep):
    """The backbone's last hidden states (B, keep, H) at the last `keep` positions of a padded batch (B, S)."""
    return getattr(model, model.base_model_prefix)(**forward_kwargs(input_ids, attention_mask)).last_hidden_state[:, -keep:]


def forward(model, input_ids, attention_mask, keep):
    """One forward over a padded batch (B, S) -> the last `keep` positions: logits (B, keep, V) of a causal LM, or
    the per-token scalar (B, keep) of a sequence classifier's `score` head (value and reward models)."""
    if hasattr(model, "score"):
        return model.score(last_hidden(model, input_ids, attention_mask, keep)).squeeze(-1).float()
    return model(**forward_kwargs(input_ids, attention_mask), logits_to_keep=keep).logits


def output_layer(model):
    """The causal LM's output layer if its logits are exactly that nn.Linear applied to the backbone's last hidden
    state, else None (checked on a probe input: some models scale or cap their logits). With it, log-probs are taken
    from the hidden states chunk by chunk and the (B, R, V) logits are never made."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        return None
    ids = torch.arange(1, 5, device=head.weight.device)[None] % head.out_features
    mask = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad(), torch.autocast(ids.device.type, enabled=False):
        logits, hidden = forward(model, ids, mask, 4), last_hidden(model, ids, mask, 4)
        return head if torch.allclose(head(hidden), logits, rtol=1e-4, atol=1e-5) else None


def response_logprobs(policy, query_responses, attention_mask, context_length, temperature, head=None):
    """log π(y_t|s_t) and entropy for every response position (B, R). Position P−1+t predicts response token t, so the
    last token is never fed and only the R response positions get logits. head: output_layer(policy), or None.
    With a head, logits larger than one chunk are never made (each chunk is computed again in backward: when they
    fit in one chunk, making them is as cheap in memory and saves that recomputation)."""
    responses = query_responses[:, context_length:]
    ids, mask, R = query_responses[:, :-1], attention_mask[:, :-1], responses.shape[1]
    if head is None or responses.numel() <= logprobs_chunk_rows(head.out_features):  # fits one chunk: plain logits
        return token_logprobs(forward(policy, ids, mask, R), responses, temperature)
    return token_logprobs(last_hidden(policy, ids, mask, R), responses, temperature, head)


def state_values(value_model, query_responses, attention_mask, context_length):
    """V(s_t) for every response position (B, R), read at the token before y_t."""
    return forward(value_model, query_responses[:, :-1], attention_mask[:, :-1], query_responses.shape[1] - context_length)


class PolicyAndValue(torch.nn.Module):
    """The two trained models as one module: DDP then averages all their gradients in one pass of buckets."""

    def __init__(self, policy, value_model, fused_head=False):
        super().__init__()
        self.policy, self.value_model, self.fused_head = policy, value_model, fused_head  # output_layer(policy) is not None

    def forward(self, query_responses, attention_mask, context_length, temperature):
        """-> log π_θ(y_t|s_t), entropy and V(s_t), each (B, R)."""
        head = self.policy.get_output_embeddings() if self.fused_head else None
        logprobs, entropy = response_logprobs(self.policy, query_responses, attention_mask, context_length, temperature, head)
        return logprobs, entropy, state_values(self.value_model, query_responses, attention_mask, context_length)


def shard(model, frozen=False):
    """FSDP2: each decoder block is a unit whose weights are gathered only while it runs, the rest another unit. A
    model with a `score` head gets its backbone and head as two roots, because forward() calls them one by one.
    A root keeps its gathered weights after forward for the backward that follows; a frozen model has no backward,
    so its roots free them at once (else its embeddings and output layer would stay whole on every rank)."""
    from torch.distributed.fsdp import fully_shard

    for module in model.modules():
        if type(module).__name__ in (model._no_split_modules or ()):
            fully_shard(module)
    for root in [getattr(model, model.base_model_prefix), model.score] if hasattr(model, "score") else [model]:
        fully_shard(root, reshard_after_forward=True if frozen else None)


@contextmanager
def gathered(model, enabled):
    """FSDP2: gather a sharded model's full weights once and keep them across forwards (a decoding loop would
    otherwise all-gather every block at every token), then free them. Without FSDP: nothing."""
    units = [m for m in model.modules() if hasattr(m, "unshard")] if enabled else []
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:  # FSDP2's defaults: blocks reshard after forward, the root keeps its weights
            unit.reshard()
            unit.set_reshard_after_forward(unit is not model, recurse=False)


def generate(policy, queries, query_mask, max_new_tokens, temperature, stop_token_id, pad_token_id, sync_ranks=False):
    """Sample y_t ~ softmax(z_t / T) token by token with a KV cache: exactly the policy we train (no top-k/top-p).
    Returns responses (B, L) and log π_old(y_t|s_t) (B, L); after a row's stop token come pad ids and log-prob 0.
    L < max_new_tokens when every row stopped early. sync_ranks: a sharded policy's forward is a collective, so
    every rank keeps stepping until all ranks are done. Call under torch.no_grad() or inference_mode()."""
    cache_kw = "cache" if "cache" in inspect.signature(policy.forward).parameters else "past_key_values"
    cache = DynamicCache(config=policy.config)
    ids, mask = queries, query_mask
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    done = torch.zeros(len(queries), dtype=torch.bool, device=queries.device)
    tokens, logprobs = [], []
    for _ in range(max_new_tokens):
        out = policy(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1, **{cache_kw: cache})
        logp = torch.log_softmax(out.logits[:, -1].float() / temperature, dim=-1)  # (B, V)
        token = torch.multinomial(logp.exp(), 1).squeeze(1).masked_fill(done, pad_token_id)
        tokens.append(token)
        logprobs.append(logp.gather(1, token[:, None]).squeeze(1).masked_fill(done, 0.0))
        if stop_token_id is not None:
            done |= token == stop_token_id
        if (all_ranks_sum((~done).sum()[None]) if sync_ranks else (~done).sum()) == 0:
            break
        ids, positions = token[:, None], positions[:, -1:] + 1
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    return torch.stack(tokens, 1), torch.stack(logprobs, 1)


def score_texts(reward_model, reward_tokenizer, texts, add_special_tokens):
    """Scores of a reward model with its own tokenizer, on the decoded text (B,). A decoder's `score` head is read at
    the last real token; an encoder classifier pools by itself."""
    device = next(reward_model.parameters()).device
    enc = reward_tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=add_special_tokens).to(device)
    mask = enc["attention_mask"].bool()
    if not hasattr(reward_model, "score"):
        return reward_model(**enc).logits[:, 0].float()
    last = (mask * torch.arange(mask.shape[1], device=device)).argmax(1, keepdim=True)
    return forward(reward_model, enc["input_ids"], mask, mask.shape[1]).gather(1, last).squeeze(1)


# ------------------------------------------------------------------------------------------ data and rewards
def read_prompts(dataset, split):
    """-> list of prompts, each a string or a list of chat messages."""
    if dataset.endswith((".txt", ".jsonl")):
        try:
            with open(dataset, encoding="utf-8") as f:
                lines = [line.rstrip("\n") for line in f if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            fail(f"--dataset {dataset!r} cannot be read: {e}")
        if dataset.endswith(".txt"):
            return lines
        rows = []
        for i, line in enumerate(lines):
            try:
                row = json.loads(line)
                rows.append(row["prompt"] if "prompt" in row else row["messages"])
            except (ValueError, KeyError, TypeError):
                fail(f"--dataset {dataset!r} line {i + 1}: expected a JSON object with a `prompt` or `messages` field")
        return rows
    if os.path.exists(dataset):
        fail(f"--dataset {dataset!r}: use a .txt or .jsonl file")
    try:
        import datasets
    except ImportError:
        fail(f"--dataset {dataset!r} is not a local .txt/.jsonl file; loading a hub dataset needs `pip install datasets`")
    try:
        data = datasets.load_dataset(dataset, split=split)
    except Exception as e:  # datasets raises many kinds; all mean this flag is wrong
        fail(f"--dataset {dataset!r} could not be loaded: {str(e).strip().splitlines()[0]}")
    column = "prompt" if "prompt" in data.column_names else "messages"
    if column not in data.column_names:
        fail(f"--dataset {dataset!r} has no `prompt` or `messages` column")
    return list(data[column])


def render_prompts(rows, tokenizer):
    """Chat messages go through the tokenizer's chat template (a trailing assistant turn is dropped).
    -> prompt texts, their token ids, and the messages (None for plain text)."""
    texts, messages = [], []
    for row in rows:
        if isinstance(row, str):
            texts.append(row)
            messages.append(None)
            continue
        if row and row[-1].get("role") == "assistant":
            row = row[:-1]
        if tokenizer.chat_template is None:
            fail("--dataset has chat `messages` but the policy's tokenizer has no chat template")
        texts.append(tokenizer.apply_chat_template(row, tokenize=False, add_generation_prompt=True))
        messages.append(row)
    ids = [tokenizer(t, add_special_tokens=m is None)["input_ids"] for t, m in zip(texts, messages)]
    return texts, ids, messages


def load_reward_fn(spec):
    module_name, _, fn_name = spec.rpartition(":")
    if not module_name or not fn_name:
        fail(f"--reward_fn {spec!r}: expected module:function or file.py:function")
    try:
        if module_name.endswith(".py"):
            module_spec = importlib.util.spec_from_file_location(os.path.basename(module_name)[:-3], module_name)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
        return getattr(module, fn_name)
    except (ImportError, AttributeError, OSError) as e:
        fail(f"--reward_fn {spec!r} cannot be loaded: {e}")


def check_scores(scores, n, source):
    """A reward function's output -> float32 tensor (n,), or a clear error."""
    try:
        scores = torch.tensor([float(s) for s in scores], dtype=torch.float32)
    except (TypeError, ValueError):
        fail(f"{source} must return a list of floats, got {type(scores).__name__}")
    if len(scores) != n:
        fail(f"{source} returned {len(scores)} scores for {n} completions")
    bad = (~torch.isfinite(scores)).nonzero()
    if len(bad):
        fail(f"{source} returned a non-finite score ({scores[bad[0, 0]].item()}) for completion {bad[0, 0].item()}")
    return scores


def addition_reward(prompts, completions):
    """The built-in task's reward for prompts `a + b =`: 1 for exactly the sum (then EOS), ½ for the sum followed by
    more tokens, 0 otherwise. The half point is partial credit: a random policy stops right after the right number
    about once in 600 tries, too rarely to learn from; it finds the right number 1 time in 24."""
    scores = []
    for prompt, completion in zip(prompts, completions):
        a, _, b, _ = prompt.split()[-4:]
        words, answer = completion.split(), str(int(a) + int(b))
        scores.append(1.0 if words == [answer] else 0.5 if words[:1] == [answer] else 0.0)
    return scores


def build_addition_task(folder, seed):
    """The built-in task: 100 prompts `a + b =` (a, b in 0..9) and a tiny randomly initialised Llama with a
    word-level tokenizer, both written to `folder` and then loaded like any hub model. -> model folder, prompts file."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<unk>", "+", "="] + [str(i) for i in range(19)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    config = LlamaConfig(vocab_size=len(words), hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=16, tie_word_embeddings=True,
                         pad_token_id=0, eos_token_id=1, bos_token_id=1)
    torch.manual_seed(seed)
    model_dir = os.path.join(folder, "model")
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    prompts_file = os.path.join(folder, "prompts.txt")
    with open(prompts_file, "w") as f:
        f.writelines(f"{a} + {b} =\n" for a in range(10) for b in range(10))
    return model_dir, prompts_file


def full_state_dict(model, optimizer=None):
    """The full (unsharded) state of a plain, DDP or FSDP2 model, on CPU, keyed by parameter name; with an optimizer,
    its state too. A collective under torchrun: every rank calls it, rank 0 gets the tensors."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    if optimizer is None:
        return get_model_state_dict(model, options=options)
    return get_model_state_dict(model, options=options), get_optimizer_state_dict(model, optimizer, options=options)


def save_pretrained_atomic(model, state_dict, tokenizer, path):
    """save_pretrained into path.tmp, then swap it in: a crash never leaves a half-written model at `path`."""
    tmp, old = path + ".tmp", path + ".old"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, state_dict=state_dict)
    tokenizer.save_pretrained(tmp)
    if os.path.exists(path):
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


RUN_ONLY_FIELDS = {"output_dir", "track", "wandb_project_name", "num_sample_generations", "save_every",
                   "save_total_limit", "resume", "distributed", "shard_frozen_models", "rollout_unshard",
                   "dist_timeout_s"}  # fields a resumed run may change: none of them changes the algorithm


def list_checkpoints(output_dir):
    """Complete checkpoint folders in output_dir, oldest first (a .tmp folder is an interrupted write)."""
    return sorted(os.path.join(output_dir, d) for d in os.listdir(output_dir)
                  if d.startswith("checkpoint-") and not d.endswith(".tmp"))


def save_checkpoint(output_dir, update, model, optimizer, lr_scheduler, scaler, args, world_size):
    """Everything the run needs to go on exactly: full weights and optimizer state, schedule, GradScaler, the update
    counter (the prompt stream's position and every seed follow from it) and the config. Rank 0 writes a .tmp
    folder, flushes it and renames it: a checkpoint-N folder is always complete. Keeps the newest save_total_limit."""
    weights, optimizer_state = full_state_dict(model, optimizer)  # a collective: every rank takes part
    path = os.path.join(output_dir, f"checkpoint-{update:06d}")
    if not dist.is_initialized() or dist.get_rank() == 0:
        tmp = path + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        state = dict(update=update, model=weights, optimizer=optimizer_state, lr_scheduler=lr_scheduler.state_dict(),
                     scaler=scaler.state_dict(), world_size=world_size,
                     config={k: v for k, v in asdict(args).items() if k not in RUN_ONLY_FIELDS})
        torch.save(state, os.path.join(tmp, "state.pt"))
        with open(os.path.join(tmp, "state.pt"), "rb") as f:
            os.fsync(f.fileno())
        shutil.rmtree(path, ignore_errors=True)  # a damaged checkpoint of the same update, skipped on resume
        os.replace(tmp, path)
        for old in list_checkpoints(output_dir)[:-args.save_total_limit]:
            shutil.rmtree(old)
    if dist.is_initialized():
        dist.barrier()  # the other ranks wait for the write here, not in the next update's first collective
    return path


def load_checkpoint(path, model, optimizer, lr_scheduler, scaler, args, world_size):
    """Restore what save_checkpoint wrote, on every rank (weights_only loading: nothing in a checkpoint runs code)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    state = torch.load(os.path.join(path, "state.pt"), weights_only=True, mmap=True)
    if "model" not in state:
        raise RuntimeError("written by an older ppo_rlhf.py (weights in .safetensors files next to state.pt)")
    changed = [k for k, v in asdict(args).items() if k not in RUN_ONLY_FIELDS and state["config"].get(k) != v]
    if changed:
        fail(f"--resume {path!r} was written with other values of --{', --'.join(changed)}")
    if state["world_size"] != world_size:  # the global batch, hence the prompt stream, depends on it
        fail(f"--resume {path!r} was written by {state['world_size']} processes; run it with as many (torchrun --nproc_per_node)")
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, state["model"], options=options)
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=options)
    lr_scheduler.load_state_dict(state["lr_scheduler"])
    scaler.load_state_dict(state["scaler"])
    return state["update"]


STOP_SIGNALS = []  # (signal, time) appended by request_stop; main() checks it after every update


def request_stop(signum, frame):
    """SIGINT/SIGTERM: finish the current update, save a checkpoint, exit 0. A second signal more than 1 s later exits
    at once; within 1 s it is the same request delivered twice (Ctrl-C under torchrun reaches a rank from the
    terminal and again from torchrun)."""
    if STOP_SIGNALS and time.monotonic() - STOP_SIGNALS[0][1] > 1.0:
        os._exit(128 + signum)
    if STOP_SIGNALS:
        return
    STOP_SIGNALS.append((signum, time.monotonic()))
    print(f"\n{signal.Signals(signum).name}: finishing this update, then saving a checkpoint", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------ training
def ppo_epochs(model, optimizer, scaler, autocast, batch, args):
    """5. PPO epochs: num_ppo_epochs passes over this rank's rollout batch in shuffled minibatches, one optimizer step
    each; a minibatch is gradient_accumulation_steps micro-batches. model: PolicyAndValue, bare or wrapped in DDP,
    or with FSDP2-sharded parts. batch: the rollout (query_responses, attention_mask, context_length, response_mask,
    lengths, logprobs, values, advantages, returns). The loss is the mean over the real tokens of the whole minibatch,
    on all ranks together: a micro-batch's token mean is weighted by its share of those tokens (times the number of
    ranks, as DDP and FSDP average the ranks' gradients). -> stats (lists per micro-batch), stop reason, steps, tokens."""
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    query_responses, attention_mask, response_mask = batch["query_responses"], batch["attention_mask"], batch["response_mask"]
    lengths, P = batch["lengths"], batch["context_length"]
    B = len(query_responses)
    mini_batch_size = B // args.num_mini_batches
    micro_batch_size = mini_batch_size // args.gradient_accumulation_steps
    params = [p for p in model.parameters() if p.requires_grad]
    fsdp_units = [m for m in model.modules() if hasattr(m, "set_requires_gradient_sync")]
    stats, stop_reason, optimizer_steps, train_tokens = defaultdict(list), None, 0, 0
    for epoch in range(args.num_ppo_epochs):
        for mb_rows in torch.randperm(B, device=lengths.device).split(mini_batch_size):
            mb_tokens = all_ranks_sum(lengths[mb_rows].sum().float())  # real response tokens of the global minibatch
            mb_approxkl, non_finite = [], torch.zeros((), device=lengths.device)
            micro_batches = mb_rows.split(micro_batch_size)
            for i, micro_rows in enumerate(micro_batches):
                sync = i == len(micro_batches) - 1  # reduce gradients across ranks after the last micro-batch only
                for unit in fsdp_units:
                    unit.set_requires_gradient_sync(sync, recurse=False)
                L = lengths[micro_rows].max().item()  # pay only for real tokens
                mb_ids, mb_mask = query_responses[micro_rows, : P + L], attention_mask[micro_rows, : P + L]
                mb_response_mask = response_mask[micro_rows, :L]
                old_logprobs = batch["logprobs"][micro_rows, :L]
                with nullcontext() if sync or not hasattr(model, "no_sync") else model.no_sync():
                    with autocast:
                        new_logprobs, entropy, new_values = model(mb_ids, mb_mask, P, args.temperature)
                    pg_loss, pg_clipfrac, approxkl = policy_loss(new_logprobs, old_logprobs, batch["advantages"][micro_rows, :L],
                                                                 mb_response_mask, args.cliprange)
                    vf_loss, vf_clipfrac = value_loss(new_values.float(), batch["values"][micro_rows, :L],
                                                      batch["returns"][micro_rows, :L], mb_response_mask, args.cliprange_value)
                    loss = pg_loss + args.vf_coef * vf_loss
                    non_finite += ~torch.isfinite(loss)  # decided for all ranks together below: one rank alone would hang
                    scaler.scale(loss * (mb_response_mask.sum() * world_size / mb_tokens)).backward()
                with torch.no_grad():
                    ratio = (new_logprobs - old_logprobs).exp()
                    outside = ((ratio - 1).abs() > args.cliprange).float()
                    for key, value in {"policy/approxkl_avg": approxkl, "policy/clipfrac_avg": pg_clipfrac,
                                       "policy/entropy_avg": masked_mean(entropy, mb_response_mask),
                                       "policy/ratio_outside_clip_avg": masked_mean(outside, mb_response_mask),
                                       "loss/policy_avg": pg_loss, "loss/value_avg": vf_loss, "val/clipfrac_avg": vf_clipfrac,
                                       "val/ratio": masked_mean(ratio, mb_response_mask),
                                       "val/ratio_var": masked_var(ratio, mb_response_mask)}.items():
                        stats[key].append(value.detach().float())
                mb_approxkl.append(approxkl.detach())
                train_tokens += mb_mask.sum().item()
            approxkl_sum, non_finite = all_ranks_sum(torch.stack([torch.stack(mb_approxkl).mean(), non_finite]))
            if non_finite:
                stop_reason = "non-finite loss"
                break
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
            grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm  # FSDP2: a DTensor
            if not torch.isfinite(grad_norm) and not scaler.is_enabled():  # GradScaler skips such steps by itself
                stop_reason = "non-finite gradient"
                break
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            if torch.isfinite(grad_norm):  # fp16: GradScaler skipped this step and lowered its scale
                stats["policy/grad_norm"].append(grad_norm.float())
            optimizer_steps += 1
            if args.target_kl is not None and approxkl_sum / world_size > args.target_kl:
                stop_reason = "target_kl"
                break
        if stop_reason:
            break
    optimizer.zero_grad(set_to_none=True)
    return stats, stop_reason, optimizer_steps, train_tokens


def main(args: Args):
    # --- sizes (per device): rollout batch -> num_mini_batches minibatches -> gradient_accumulation_steps micro-batches
    batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps
    if args.per_device_train_batch_size < 1 or args.gradient_accumulation_steps < 1 or args.num_mini_batches < 1:
        fail("--per_device_train_batch_size, --gradient_accumulation_steps and --num_mini_batches must be >= 1")
    if batch_size % args.num_mini_batches:
        fail(f"rollout batch {batch_size} (--per_device_train_batch_size x --gradient_accumulation_steps) "
             f"is not divisible by --num_mini_batches {args.num_mini_batches}")
    mini_batch_size = batch_size // args.num_mini_batches
    if mini_batch_size % args.gradient_accumulation_steps:
        fail(f"minibatch {mini_batch_size} is not divisible by --gradient_accumulation_steps {args.gradient_accumulation_steps}")
    micro_batch_size = mini_batch_size // args.gradient_accumulation_steps
    if args.num_ppo_epochs < 1:
        fail(f"--num_ppo_epochs must be >= 1, got {args.num_ppo_epochs}")
    if args.response_length < 1:
        fail(f"--response_length must be >= 1, got {args.response_length}")
    if args.temperature <= 0:
        fail(f"--temperature must be > 0, got {args.temperature}")

    # --- the built-in task, written by each process into its own folder (before the process group exists: under
    #     torchrun, save_pretrained writes on rank 0 only), loaded like any model, deleted when the process ends
    model_path, dataset = args.model_name_or_path, args.dataset
    if "builtin" in (model_path, dataset):
        builtin_dir = tempfile.mkdtemp(prefix="ppo_rlhf_builtin_")
        atexit.register(shutil.rmtree, builtin_dir, ignore_errors=True)
        builtin_model, builtin_prompts = build_addition_task(builtin_dir, args.seed)
        model_path = builtin_model if model_path == "builtin" else model_path
        dataset = builtin_prompts if dataset == "builtin" else dataset

    # --- torchrun sets RANK, LOCAL_RANK and WORLD_SIZE; without them this is one process and no process group
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if "RANK" in os.environ and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=args.dist_timeout_s))
    distributed = dist.is_available() and dist.is_initialized()
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    fsdp = distributed and args.distributed == "fsdp"
    if fsdp and args.dtype == "fp16":
        fail("--dtype fp16 with --distributed fsdp: GradScaler would skip steps on some shards only; use --dtype bf16")
    global_batch_size = batch_size * world_size  # prompts per update over all ranks
    num_updates = args.total_episodes // global_batch_size
    if num_updates < 1:
        fail(f"--total_episodes {args.total_episodes} is less than one rollout batch ({global_batch_size} over all ranks)")
    output_dir = [args.output_dir or f"runs/{args.exp_name}__{args.seed}__{int(time.time())}"]
    if distributed:
        dist.broadcast_object_list(output_dir)  # rank 0's clock names the run
    output_dir = output_dir[0]
    metrics_path = os.path.join(output_dir, "metrics.jsonl")
    if os.path.exists(metrics_path) and not args.resume:
        fail(f"--output_dir {output_dir!r} already holds a run (metrics.jsonl); pass --resume auto or choose another --output_dir")

    def log(*lines, file=sys.stdout):  # only rank 0 prints and writes
        if rank == 0:
            print(*lines, file=file, flush=True)

    random.seed(args.seed)
    torch.manual_seed(args.seed)  # the same on every rank: a new value head starts identical everywhere
    transformers.utils.logging.disable_progress_bar()  # loading bars would bury the per-update lines
    low_dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    autocast = torch.autocast(device.type, dtype=low_dtype) if low_dtype else nullcontext()
    scaler = torch.amp.GradScaler(device.type, enabled=args.dtype == "fp16")  # fp16 gradients underflow unscaled
    no_grad = torch.no_grad if fsdp else torch.inference_mode  # FSDP2 cannot reuse weights gathered in inference mode

    # --- models and data
    tokenizer = ensure_pad_token(load_tokenizer(model_path, "model_name_or_path", args))
    stop_token_id = args.stop_token_id if args.stop_token_id is not None else (
        tokenizer.eos_token_id if args.stop_token == "eos" else None)
    policy = load_pretrained(AutoModelForCausalLM, model_path, "model_name_or_path", args)
    fit_tokenizer(policy, tokenizer)
    ref_policy = (load_pretrained(AutoModelForCausalLM, args.ref_model_path, "ref_model_path", args)
                  if args.ref_model_path else copy.deepcopy(policy))
    fit_tokenizer(ref_policy, tokenizer)
    reward_model = reward_tokenizer = reward_fn = None
    if args.reward_model_path:
        reward_model = load_pretrained(AutoModelForSequenceClassification, args.reward_model_path, "reward_model_path", args)
        if reward_model.config.num_labels != 1:
            fail(f"--reward_model_path {args.reward_model_path!r} has {reward_model.config.num_labels} labels; "
                 "a reward model has 1")
        reward_tokenizer = load_tokenizer(args.reward_model_path, "reward_model_path", args)
        if tokenizer.get_vocab().items() >= reward_tokenizer.get_vocab().items():
            reward_tokenizer = None  # same vocabulary: score the policy's token ids directly
            fit_tokenizer(reward_model, tokenizer)
        elif reward_tokenizer.pad_token is None:
            reward_tokenizer.pad_token = reward_tokenizer.eos_token
        reward_model.requires_grad_(False).eval().to(device, low_dtype)
    elif args.reward_fn:
        reward_fn = load_reward_fn(args.reward_fn)
    else:
        fail("no reward: give --reward_model_path or --reward_fn")
    # the value model reads the policy's token ids: start from the reward model only if it shares the vocabulary
    value_path = args.value_model_path or (args.reward_model_path if reward_model is not None and reward_tokenizer is None
                                           else model_path)
    value_model = load_pretrained(AutoModelForSequenceClassification, value_path, "value_model_path", args, num_labels=1)
    if not hasattr(value_model, "score"):
        fail(f"--value_model_path {value_path!r}: need a decoder with a per-token `score` head "
             "(a *ForSequenceClassification of a causal LM)")
    fit_tokenizer(value_model, tokenizer)
    ref_policy.requires_grad_(False).eval().to(device, low_dtype)
    policy.to(device)
    value_model.to(device)
    if args.gradient_checkpointing:
        for model in (policy, value_model):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # log-probs straight from the hidden states where the model allows it; a sharded model's output layer is only
    # whole inside its own forward, so FSDP-sharded models make their (B, R, V) logits
    policy_head = None if fsdp else output_layer(policy)
    ref_head = None if fsdp and args.shard_frozen_models else output_layer(ref_policy)
    if fsdp:  # every rank keeps 1/world_size of these weights (and of their gradients and optimizer state)
        for model in [policy, value_model] + ([ref_policy, reward_model] if args.shard_frozen_models else []):
            if model is not None:
                shard(model, frozen=model in (ref_policy, reward_model))
    model = PolicyAndValue(policy, value_model, fused_head=policy_head is not None)
    if distributed and not fsdp:  # DDP: whole models on every rank, gradients averaged by all-reduce
        ddp = torch.nn.parallel.DistributedDataParallel
        no_buffer_sync = {"forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(ddp).parameters
                          else "broadcast_buffers": False}  # buffers are constants: no collective per forward
        model = ddp(model, device_ids=[local_rank] if device.type == "cuda" else None, **no_buffer_sync)

    prompt_texts, prompt_ids, prompt_messages = render_prompts(read_prompts(dataset, args.dataset_train_split), tokenizer)
    if not prompt_texts:
        fail(f"--dataset {dataset!r} holds no prompts")
    if min(len(ids) for ids in prompt_ids) == 0:
        fail(f"--dataset {dataset!r}: prompt {[len(i) for i in prompt_ids].index(0)} is empty after tokenization")
    context = getattr(policy.config, "max_position_embeddings", None)
    longest = max(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    if context and len(prompt_ids[longest]) + args.response_length > context:
        fail(f"--dataset: prompt {longest} has {len(prompt_ids[longest])} tokens, which with --response_length "
             f"{args.response_length} exceeds the model's context of {context}; shorten the prompts or the response")

    params = [p for p in model.parameters() if p.requires_grad]
    # fp32 state; fused: 0.06 vs 0.40 s per step for 52M parameters on a 2-core CPU, timed alone
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, eps=1e-8, weight_decay=0.0,
                                  fused=device.type in ("cpu", "cuda"))
    schedule = lambda u: 1.0 - u / num_updates if args.anneal_lr else 1.0  # noqa: E731
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    if args.track and rank == 0:
        try:
            import wandb
        except ImportError:
            fail("--track needs `pip install wandb`")
        wandb.init(project=args.wandb_project_name, name=os.path.basename(output_dir), config=asdict(args))
    if rank == 0:
        os.makedirs(output_dir, exist_ok=True)
    sample_every = max(1, num_updates // args.num_sample_generations) if args.num_sample_generations else 0
    mode = f"{world_size} processes ({args.distributed}), " if distributed else ""
    log(f"ppo_rlhf: {num_updates} updates of {global_batch_size} prompts ({mode}{batch_size} per device, "
        f"{args.num_mini_batches} minibatches of {mini_batch_size}, micro-batches of {micro_batch_size}), "
        f"{len(prompt_texts)} prompts, device {device}, {args.dtype}, output {output_dir}")

    # --- resume: the newest checkpoint that loads; a damaged one is skipped with a warning, never half-loaded
    start_update = 0
    if args.resume:
        candidates = [list_checkpoints(output_dir)[::-1] if args.resume == "auto" and os.path.isdir(output_dir) else (
            [] if args.resume == "auto" else [args.resume])]
        if distributed:  # rank 0's view of the folder decides, so every rank tries the same checkpoints in order
            dist.broadcast_object_list(candidates)
        candidates = candidates[0]
        for i, path in enumerate(candidates):
            try:
                start_update = load_checkpoint(path, model, optimizer, lr_scheduler, scaler, args, world_size)
                log(f"resumed from {path} after update {start_update}")
                break
            except (OSError, RuntimeError, KeyError, EOFError, pickle.UnpicklingError) as e:
                if args.resume != "auto" or i == len(candidates) - 1:
                    fail(f"--resume {path!r} cannot be loaded: {str(e).strip().splitlines()[0]}")
                log(f"warning: skipping damaged checkpoint {path}: {str(e).strip().splitlines()[0]}", file=sys.stderr)
        if not candidates and os.path.exists(metrics_path):
            fail(f"--resume auto: {output_dir!r} has metrics.jsonl but no checkpoint to resume from")
        if all_ranks_sum(torch.tensor([start_update], device=device)).item() != start_update * world_size:
            fail(f"--resume: the ranks loaded different checkpoints (this one: update {start_update}); "
                 "is --output_dir on a filesystem every node sees?")
        if rank == 0 and os.path.exists(metrics_path):  # drop lines of updates after the checkpoint: no duplicate, no gap
            with open(metrics_path) as f:
                kept = [line for line in f if line.strip() and json.loads(line)["update"] <= start_update]
            with open(metrics_path + ".tmp", "w") as f:
                f.writelines(kept)
            os.replace(metrics_path + ".tmp", metrics_path)
    chunk = args.local_rollout_forward_batch_size
    start_time, bad_updates, metrics = time.time(), 0, None
    for update in range(start_update, num_updates):
        update_start = time.perf_counter()
        # each rank takes its own slice of the update's global batch, and its own seed (ints hash to themselves,
        # so this is the same in every run): a resumed run continues exactly, with no RNG state to restore
        rows = prompt_indices(len(prompt_ids), batch_size, update, args.seed, rank, world_size).tolist()
        random.seed(hash((args.seed, update, rank)))
        torch.manual_seed(hash((args.seed, update, rank)) % 2**63)
        queries, query_mask = left_pad([prompt_ids[i] for i in rows], tokenizer.pad_token_id)
        queries, query_mask = queries.to(device), query_mask.to(device)
        B, P = queries.shape  # P = context_length: every response starts at column P
        policy.eval(), value_model.eval()  # dropout is off anyway; eval() keeps the KV cache on under gradient checkpointing

        # 1. rollout: sample responses with the current policy π_old, keeping log π_old of each sampled token
        with no_grad(), autocast, gathered(policy, fsdp and args.rollout_unshard):
            generated = [generate(policy, queries[i : i + chunk], query_mask[i : i + chunk], args.response_length,
                                  args.temperature, stop_token_id, tokenizer.pad_token_id,
                                  sync_ranks=fsdp and not args.rollout_unshard) for i in range(0, B, chunk)]
        R = max(r.shape[1] for r, _ in generated)
        responses = torch.cat([F.pad(r, (0, R - r.shape[1]), value=tokenizer.pad_token_id) for r, _ in generated])
        logprobs = torch.cat([F.pad(lp, (0, R - lp.shape[1])) for _, lp in generated])
        lengths = response_lengths(responses, stop_token_id)  # (B,) real tokens, stop token included
        response_mask = torch.arange(R, device=device) < lengths[:, None]  # (B, R), True = real token
        query_responses = torch.cat([queries, responses], 1)  # (B, P + R)
        attention_mask = torch.cat([query_mask, response_mask], 1)
        generate_time = time.perf_counter() - update_start

        # 2. score: reference log-probs, values V(s_t), and the reward model's score of prompt + truncated response
        completions = tokenizer.batch_decode([r[:n] for r, n in zip(responses.tolist(), lengths.tolist())], skip_special_tokens=True)
        ref_logprobs = torch.zeros(B, R, device=device)
        values = torch.zeros(B, R, device=device)
        scores = torch.zeros(B, device=device)
        with no_grad(), autocast:
            for i in range(0, B, chunk):
                rows_i = slice(i, i + chunk)
                width = P + lengths[rows_i].max().item()  # trim the chunk to its longest real sequence
                ids, mask = query_responses[rows_i, :width], attention_mask[rows_i, :width]
                ref_logprobs[rows_i, : width - P] = response_logprobs(ref_policy, ids, mask, P, args.temperature, ref_head)[0]
                values[rows_i, : width - P] = state_values(value_model, ids, mask, P)
                if low_dtype:  # recompute log π_old with the training forward: the first ratio is then exactly 1
                    logprobs[rows_i, : width - P] = response_logprobs(policy, ids, mask, P, args.temperature, policy_head)[0]
                if reward_model is not None and reward_tokenizer is None:
                    token_scores = forward(reward_model, ids, mask, width - P)  # (b, L): score after each token
                    scores[rows_i] = token_scores.gather(1, lengths[rows_i, None] - 1).squeeze(1)
        if reward_model is not None and reward_tokenizer is not None:  # re-tokenize the text for the reward model
            texts = [reward_tokenizer.apply_chat_template(prompt_messages[r] + [{"role": "assistant", "content": c}], tokenize=False)
                     if prompt_messages[r] is not None and reward_tokenizer.chat_template else prompt_texts[r] + c
                     for r, c in zip(rows, completions)]
            with no_grad(), autocast:
                scores = torch.cat([score_texts(reward_model, reward_tokenizer, texts[i : i + chunk],
                                                add_special_tokens=prompt_messages[rows[i]] is None) for i in range(0, B, chunk)])
        elif reward_fn is not None:
            scores = check_scores(reward_fn([prompt_texts[r] for r in rows], completions), B, f"--reward_fn {args.reward_fn}").to(device)
        contains_eos = ((responses == tokenizer.eos_token_id) & response_mask).any(1)
        raw_scores = scores.clone()
        if args.missing_eos_penalty is not None:
            scores = scores - args.missing_eos_penalty * (~contains_eos).float()
        score_time = time.perf_counter() - update_start - generate_time

        # 3. KL and rewards: r_t = −β·KL_t per token, plus the score on the last real token
        logprobs, ref_logprobs = logprobs.masked_fill(~response_mask, 0.0), ref_logprobs.masked_fill(~response_mask, 0.0)
        kl = torch.where(response_mask, kl_penalty(logprobs, ref_logprobs, args.kl_estimator), 0.0)  # (B, R)
        rewards = per_token_rewards(scores, kl, response_mask, args.kl_coef)
        if args.whiten_rewards:
            rewards = torch.where(response_mask, masked_whiten(rewards, response_mask, shift_mean=False), 0.0)

        # 4. advantages: GAE, then whitened over the batch's real tokens
        advantages, returns = gae(rewards, values, response_mask, args.gamma, args.lam)
        advantages = torch.where(response_mask, masked_whiten(advantages, response_mask), 0.0)

        # 5. PPO epochs: num_ppo_epochs passes over the batch in shuffled minibatches, one optimizer step each
        policy.train(), value_model.train()
        batch = dict(query_responses=query_responses, attention_mask=attention_mask, context_length=P, response_mask=response_mask,
                     lengths=lengths, logprobs=logprobs, values=values, advantages=advantages, returns=returns)
        stats, stop_reason, optimizer_steps, train_tokens = ppo_epochs(model, optimizer, scaler, autocast, batch, args)
        lr = lr_scheduler.get_last_lr()[0]
        lr_scheduler.step()
        train_time = time.perf_counter() - update_start - generate_time - score_time
        if stop_reason in ("non-finite loss", "non-finite gradient"):
            bad_updates += 1
            log(f"warning: update {update + 1}: {stop_reason}; skipped the rest of this update", file=sys.stderr)
            if bad_updates >= 3:
                fail(f"{bad_updates} updates in a row had a non-finite loss or gradient; lower --learning_rate, "
                     "check the reward scale, or use --dtype fp32")
        else:
            bad_updates = 0

        # 6. log: TRL's metric names; per-sequence sums averaged over the batch, training stats over all micro-batches,
        #    both over all ranks (token and EOS counts summed); times and memory are rank 0's
        update_time = time.perf_counter() - update_start
        peak_memory = (torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda"
                       else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10)  # Linux: KiB
        averaged = {
            "objective/kl": kl.sum(1).mean(),
            "objective/entropy": (-logprobs).sum(1).mean(),
            "objective/non_score_reward": (-args.kl_coef * kl).sum(1).mean(),
            "objective/rlhf_reward": (scores - args.kl_coef * kl.sum(1)).mean(),
            "objective/scores": scores.mean(),
            "val/explained_variance": explained_variance(values, returns, response_mask),  # already global
            "val/mean_response_length": lengths.float().mean(),
            **{key: torch.stack(batch_values).mean() for key, batch_values in stats.items()},
            "policy/epochs": optimizer_steps / args.num_mini_batches,
        }
        if stats:  # π_θ = π_old before the first step: anything but 1 and 0 means training and rollout disagree
            averaged["policy/first_ratio"], averaged["policy/first_approxkl"] = stats["val/ratio"][0], stats["policy/approxkl_avg"][0]
        if reward_fn is not None and args.reward_fn == Args.reward_fn:  # the built-in task: exactly the sum, then EOS
            averaged["objective/success_rate"] = (raw_scores == 1).float().mean()
        summed = {"val/num_eos_tokens": contains_eos.sum(), "rollout": response_mask.sum(), "score": attention_mask.sum(),
                  "train": train_tokens}
        reduced = all_ranks_sum(torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device)
                                             for v in [*averaged.values(), *summed.values()]])).tolist()
        averaged = {key: value / world_size for key, value in zip(averaged, reduced)}
        summed = dict(zip(summed, reduced[len(averaged):]))
        metrics = {
            "update": update + 1,
            "episode": (update + 1) * global_batch_size,
            "eps": (update + 1) * global_batch_size / (time.time() - start_time),
            "lr": lr,
            **averaged,
            "val/num_eos_tokens": summed["val/num_eos_tokens"],
            "time/update_s": update_time,
            "time/generate_s": generate_time,
            "time/score_s": score_time,
            "time/train_s": train_time,
            "time/rollout_tokens_per_s": summed["rollout"] / generate_time,  # all ranks' tokens
            "time/score_tokens_per_s": summed["score"] / score_time,
            "time/train_tokens_per_s": summed["train"] / max(train_time, 1e-9),
            "memory/peak_mib": peak_memory,
        }
        if rank == 0:
            with open(metrics_path, "a") as f:  # one whole line per update, written when the update is done
                f.write(json.dumps(metrics) + "\n")
            if args.track:
                wandb.log(metrics, step=update + 1)
        success = f"success {metrics['objective/success_rate']:4.0%}  " if "objective/success_rate" in metrics else ""
        log(f"update {update + 1}/{num_updates}  {success}score {metrics['objective/scores']:.3f}  "
            f"kl {metrics['objective/kl']:.3f}  approxkl {metrics.get('policy/approxkl_avg', float('nan')):.4f}  "
            f"clipfrac {metrics.get('policy/clipfrac_avg', float('nan')):.3f}  "
            f"vloss {metrics.get('loss/value_avg', float('nan')):.4f}  ev {metrics['val/explained_variance']:.2f}  "
            f"len {metrics['val/mean_response_length']:.1f}  | {update_time:.2f}s: generate {generate_time:.2f}  "
            f"score {score_time:.2f}  train {train_time:.2f}  | {peak_memory:.0f} MiB")
        if sample_every and (update % sample_every == 0 or update == num_updates - 1):
            for r, c, s in list(zip(rows, completions, scores.tolist()))[:3]:
                log(f"    {prompt_texts[r]!r} -> {c!r}  score {s:.2f}")

        stop = all_ranks_sum(torch.tensor([len(STOP_SIGNALS)], device=device)).item() > 0  # a signal on any rank
        if stop or (args.save_every and (update + 1) % args.save_every == 0):
            path = save_checkpoint(output_dir, update + 1, model, optimizer, lr_scheduler, scaler, args, world_size)
            if stop:
                log(f"saved {path}; continue with the same flags plus --resume auto")
                return metrics
    weights = full_state_dict(model)  # a collective: every rank takes part, rank 0 writes
    if rank == 0:
        for name, part in (("policy", policy), ("value_model", value_model)):
            state_dict = {key.split(".", 1)[1]: value for key, value in weights.items() if key.startswith(name + ".")}
            save_pretrained_atomic(part, state_dict, tokenizer, os.path.join(output_dir, name))
        log(f"saved policy and value model to {output_dir}")
        if args.track:
            wandb.finish()
    return metrics


if __name__ == "__main__":
    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    main(tyro.cli(Args))
    if dist.is_initialized():
        dist.destroy_process_group()
