"""PPO for RLHF in one file: fine-tune a language model against a reward model or reward function.

    python ppo_rlhf.py                  # built-in toy task, offline, CPU, ~2 min: a tiny Llama adds
    python ppo_rlhf.py --model_name_or_path <sft> --reward_model_path <rm> --dataset prompts.jsonl
    torchrun --nproc_per_node 8 ppo_rlhf.py --distributed fsdp ...   # one node; --nnodes M: several

A state s_t is the prompt x plus the response so far y_<t, an action is the next token y_t. For a
response y_1..y_L sampled from π_old (the policy that generated it), per token:
    r_t    = −β·KL_t + [t = L]·score(x, y)       KL_t = log π_old(y_t|s_t) − log π_ref(y_t|s_t)
    A_t    = GAE(γ, λ) of r_t with the value model V(s_t);   R_t = A_t + V_old(s_t)
    L_clip = −E_t[min(ρ_t·A_t, clip(ρ_t, 1−ε, 1+ε)·A_t)]      ρ_t = π_θ(y_t|s_t) / π_old(y_t|s_t)
    L_V    = ½·E_t[max((V − R_t)², (clip(V, V_old ± ε_v) − R_t)²)]       loss = L_clip + c_v·L_V
PPO is on-policy: sample a batch with the current policy, keep each token's log-prob, take
num_ppo_epochs passes of small steps over that fresh batch, throw it away. ρ_t corrects for π_θ
drifting from π_old inside those epochs, but only for the choice of token, not for the states a
drifted policy would visit: the clip, the KL penalty to π_ref and target_kl early stopping keep π_θ
close enough for that to hold. Its relatives (RLOO, GRPO, Dr. GRPO, REINFORCE++, KL as a loss, clip
variants, CISPO, SAPO, GSPO, replay of older batches, the sampler's mismatch corrected) are
switches, each a few lines next to the formula it changes. Follows Schulman et al. 2017 (PPO),
Ziegler et al. 2019 and Stiennon et al. 2020 (RLHF), Huang et al. 2024 ("The N+ implementation
details of RLHF with PPO"); names as TRL's. Differs from TRL on purpose: the score lands on the last
real response token (TRL: one past it), every forward gets position_ids, sampling is a plain loop
over softmax(z / T), and the loss is the token mean over the whole minibatch on all devices (TRL: a
mean of micro-batch means). A first reading stops after main.
"""
import asyncio
import atexit
import copy
import gc
import importlib
import inspect
import json
import math
import numbers
import os
import pickle
import random
import re
import resource
import runpy
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections import defaultdict, deque
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, fields
from datetime import timedelta
from functools import partial
from types import SimpleNamespace
from typing import Literal, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
import tyro
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers import AutoModelForSequenceClassification


# ------------------------------------------------------------------------------------------ options
@dataclass
class Args:
    # --- experiment
    exp_name: str = "ppo_rlhf"
    """name of this run (in the default output_dir and in wandb)"""
    seed: int = 1
    """seed of python and torch: prompt order, sampling, new weights"""
    output_dir: Optional[str] = None
    """where metrics, checkpoints and models go; default runs/<exp_name>__<seed>__<unix time>"""
    track: bool = False
    """log metrics to Weights & Biases (needs `pip install wandb`)"""
    wandb_project_name: str = "ppo_rlhf"
    """wandb project, with --track"""
    num_sample_generations: int = 10
    """print samples and evaluate this many times during training, and after the last update"""
    eval_dataset: Optional[str] = "auto"
    """held-out prompts (as --dataset); auto: the built-in task's 20 for it, else none"""
    eval_temperature: float = 0.0
    """sampling temperature of the evaluation (0: greedy)"""
    eval_on_start: bool = True
    """evaluate the policy before its first update too, as update 0 (not on a resume)"""
    health_window: int = 50
    """health hints judge this many last updates, each at most once per window (0: none)"""
    save_every: int = 0
    """write a resumable checkpoint every this many updates (0: only when stopped by a signal)"""
    save_total_limit: int = 2
    """keep this many newest checkpoints (0: keep all)"""
    resume: Optional[str] = None
    """`auto`: continue from the newest checkpoint of output_dir (if any); or a checkpoint folder"""
    export_checkpoint: bool = False
    """with --resume FOLDER: no update; write its models to output_dir as the final ones"""
    # --- models and data
    model_name_or_path: str = "builtin"
    """policy (SFT) checkpoint, hub name or folder; `builtin`: the toy task's tiny Llama"""
    ref_model_path: Optional[str] = None
    """reference policy π_ref of the KL penalty; default: a frozen copy of the initial policy"""
    value_model_path: Optional[str] = None
    """value model init; default: the reward model if it shares the vocabulary, else the policy"""
    reward_model_path: Optional[list[str]] = None
    """reward models (sequence classifiers, 1 label), each may have its own tokenizer"""
    reward_fn: Optional[list[str]] = None
    """reward functions `module:function` or `file.py:function`, called as TRL calls them"""
    reward_weights: Optional[list[float]] = None
    """w_i of score = Σ_i w_i·s_i over reward models then functions; unset: their mean"""
    dataset: str = "builtin"
    """prompts: .txt, .jsonl (`prompt` or chat `messages`, other fields), or a hub dataset"""
    dataset_train_split: str = "train"
    """split of a hub --dataset"""
    dataset_test_split: str = "test"
    """split of a hub --eval_dataset (a .txt or .jsonl file has none: unused)"""
    max_prompt_length: Optional[int] = None
    """most tokens of a prompt; default: the policy's context minus --response_length"""
    overlong_prompts: Literal["error", "filter", "truncate_left"] = "error"
    """prompts over max_prompt_length: error, filter (leave out), truncate_left (their last ids)"""
    trust_remote_code: bool = False
    """allow models and tokenizers that ship their own code"""
    # --- rollout
    total_episodes: int = 51200
    """responses sampled over the run; updates = total_episodes // rollout batch"""
    response_length: int = 2
    """most tokens sampled per response"""
    temperature: float = 1.0
    """T: the policy is softmax(logits / T), in rollout and in training"""
    stop_token: Optional[Literal["eos"]] = "eos"
    """eos: end at the tokenizer's EOS or an eos_token_id of the generation config; None: never"""
    stop_token_id: Optional[list[int]] = None
    """end responses at any of these token ids instead"""
    missing_eos_penalty: Optional[float] = None
    """subtracted from the score of responses without a stop id"""
    score_scaling: Literal["none", "running_std"] = "none"
    """running_std: score / running std of all scores so far (shaped_scores)"""
    score_clip: Optional[float] = None
    """clip the (scaled) score to [−c, c]"""
    length_penalty: float = 0.0
    """λ: score −= λ·(response tokens)"""
    overlong_buffer: int = 0
    """L of DAPO's overlong penalty on the last L of response_length (shaped_scores); 0: off"""
    overlong_penalty: float = 1.0
    """p, the overlong penalty at response_length"""
    mask_truncated_completions: bool = False
    """leave responses cut off before a stop id out of the loss"""
    local_rollout_forward_batch_size: int = 64
    """rows per generation and scoring forward"""
    # --- PPO
    per_device_train_batch_size: int = 128
    """responses per micro-batch; rollout batch = this x gradient_accumulation_steps"""
    gradient_accumulation_steps: int = 1
    """micro-batches per minibatch (one optimizer step per minibatch)"""
    num_mini_batches: int = 2
    """minibatches (optimizer steps) per pass over the rollout batch"""
    num_ppo_epochs: int = 4
    """passes over each rollout batch"""
    num_generations: int = 1
    """k: responses per prompt, in consecutive rows of one device (batch sizes count responses)"""
    advantage_estimator: Literal["gae", "rloo", "grpo", "dr_grpo", "reinforce_pp",
                                 "reinforce_pp_baseline"] = "gae"
    """gae: PPO's value model; the others are value-free (baselined_scores)"""
    kl_coef: float = 0.05
    """β, the KL coefficient (0: no reference model is loaded)"""
    kl_in: Literal["reward", "loss"] = "reward"
    """reward: r_t −= β·KL_t; loss: loss += β·agg(KL_t), a gradient through π_θ (ppo_loss)"""
    kl_estimator: Optional[Literal["k1", "k2", "k3"]] = None
    """KL_t per token from samples (kl_estimate); unset: k1 in the reward, k3 in the loss"""
    use_bias_correction_kl: bool = True
    """--kl_in loss: ρ_t·KL_t (TRL): ∇KL(π_θ‖π_ref) at any θ; off: k3's ∇KL(π_ref‖π_θ) at θ_old"""
    adaptive_kl_target: Optional[float] = None
    """adapt β towards this KL per response after each update (adaptive_kl_coef); unset: fixed"""
    adaptive_kl_horizon: int = 10000
    """the horizon (in responses) of the adaptive KL controller"""
    cliprange: float = 0.2
    """ε of the clipped surrogate: ρ is clipped to [1 − ε, 1 + ε_high]"""
    cliprange_high: Optional[float] = None
    """ε_high (clip-higher, DAPO); unset: ε"""
    dual_clip: Optional[float] = None
    """c > 1: where A < 0 a token's loss is at most c·|A| (dual clip); unset: off"""
    policy_loss: Literal["clip", "cispo", "sapo", "vespo"] = "clip"
    """clip: PPO's; cispo: MiniMax-M1's truncated weight; sapo: Qwen's soft gate; vespo: φ(w)"""
    cispo_max: float = 5.0
    """the cap of CISPO's weight sg(min(ρ, c)) (ScaleRL's 5)"""
    sapo_temperature_pos: float = 1.0
    """τ of SAPO's gate σ(τ(ρ − 1)) where A > 0"""
    sapo_temperature_neg: float = 1.05
    """τ of SAPO's gate where A <= 0"""
    vespo_k_pos: float = 2.0
    """k of VESPO's weight φ(w) = exp(λ + k·log w − λ·w) of a response's ratio w, where A >= 0"""
    vespo_lambda_pos: float = 3.0
    """λ of VESPO's weight where A >= 0"""
    vespo_k_neg: float = 3.0
    """k of VESPO's weight where A < 0"""
    vespo_lambda_neg: float = 2.0
    """λ of VESPO's weight where A < 0"""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """sequence: GSPO's one ratio per response (value-free; its paper clips ε 3e-4, ε_high 4e-4)"""
    off_policy_mask_threshold: Optional[float] = None
    """δ: responses with A < 0 and mean_t log(μ/π_θ) > δ leave the policy loss (DeepSeek-V3.2)"""
    filter_zero_std_groups: bool = False
    """groups whose scored rows score alike leave the loss (no signal, yet they dilute its mean)"""
    rollout_correction: Literal["none", "token_truncate", "token_mask", "sequence_truncate",
                                "sequence_mask"] = "none"
    """weight L_clip by w = π_old/μ, the sampler's mismatch (bf16/fp16), per token or response"""
    rollout_correction_cap: float = 3.0
    """C of --rollout_correction: min(w, C) (truncate) or 0 where w > C (mask)"""
    loss_agg: Optional[Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
                               "seq_mean_token_sum_norm"]] = None
    """the terms' mean (aggregate); unset: seq_mean_token_mean with GSPO or SAPO, else token_mean"""
    entropy_coef: float = 0.0
    """c_H: loss −= c_H·agg(entropy of π_θ)"""
    top_entropy_quantile: float = 1.0
    """q: the policy loss of the top q of loss tokens by entropy only (Wang et al. 2025); 1: all"""
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
    """stop the update's epochs once a minibatch's approx KL(π_old‖π_θ) exceeds this"""
    replay_rounds: int = 0
    """N: also train on the last N updates' batches, off-policy (0: on-policy); see replay_batch"""
    replay_correction: Optional[Literal["naive", "decoupled"]] = None
    """naive: ρ = π_θ/μ (μ: the sampler); decoupled: π_θ/π_prox, weighted π_prox/μ (0 above c)"""
    replay_weight_cap: Optional[float] = None
    """c of --replay_correction decoupled: tokens with π_prox/μ > c leave the loss (unset: 2)"""
    # --- optimisation
    learning_rate: Optional[float] = None
    """AdamW learning rate; unset: 1e-6 (TRL's, for real models), 1e-3 for the built-in toy model"""
    lr_scheduler_type: Literal["linear", "cosine", "constant"] = "linear"
    """the learning rate over the updates (get_scheduler): linear to 0, cosine, constant"""
    warmup_ratio: float = 0.0
    """share of the updates that warm the learning rate up from 0 (linear, cosine)"""
    max_grad_norm: float = 1.0
    """clip the global gradient norm of policy + value parameters"""
    # --- LoRA (needs `pip install peft`)
    lora_r: int = 0
    """LoRA rank r (0: off): adapters W + (α/r)·B·A train; π_ref: the adapter switched off"""
    lora_alpha: float = 16.0
    """α: the adapter's update is scaled by α/r"""
    lora_target_modules: Optional[list[str]] = None
    """layers that get adapters; default every linear layer of attention and MLP (not the output)"""
    # --- system; distributed: under torchrun, batch sizes above per device
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """autocast dtype; trained weights, AdamW and π_ref (as π_θ) fp32, reward models this one"""
    save_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """dtype of the saved policy and value model"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass: less memory, ~1/3 more compute"""
    distributed: Literal["ddp", "fsdp"] = "ddp"
    """ddp: whole models on every device; fsdp: FSDP2 shards weights, gradients, optimizer state"""
    shard_frozen_models: bool = False
    """with fsdp: shard the reference and reward models too"""
    rollout_unshard: bool = True
    """with fsdp: gather the policy once for the rollout (off: if it cannot fit one device)"""
    dist_timeout_s: int = 1800
    """seconds a collective waits for the other ranks before the run fails"""


# -------------------------------------------------------------------------------------- math (pure)
def masked_mean(x, mask):
    """Σ x·m / Σ m over the real (mask=True) entries; 0 if there are none."""
    return torch.where(mask, x, 0.0).sum() / mask.sum().clamp(min=1)


def masked_whiten(x, mask, mean, var, shift_mean=True):
    """(x − μ) / σ on the real entries, 0 elsewhere (shift_mean=False keeps μ). μ, σ²: under
    torchrun the global batch's (global_mean_var), so that every rank whitens alike."""
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    return torch.where(mask, whitened if shift_mean else whitened + mean, 0.0)


def is_stop(tokens, stop_token_ids):
    """Which tokens are stop ids (a list of ints; none: no token is). Same shape as tokens."""
    return torch.isin(tokens, tokens.new_tensor(stop_token_ids))


def response_lengths(responses, stop_token_ids):
    """Real tokens per response (B, R) -> (B,): up to and including the first stop id, else R."""
    R = responses.shape[1]
    ends = torch.arange(1, R + 1, device=responses.device)  # the length if the first stop
    return torch.where(is_stop(responses, stop_token_ids), ends, R).min(-1).values


def kl_estimate(logprobs, ref_logprobs, kl_estimator):
    """KL(π‖π_ref) per token sampled by π, ρ = π_ref/π (Schulman 2020): k1 = −log ρ, k3 = ρ − 1 −
    log ρ (unbiased); k2 = ½(log ρ)² (biased; as a loss its gradient is ∇KL)."""
    log_ratio = ref_logprobs - logprobs
    if kl_estimator == "k1":
        return -log_ratio
    if kl_estimator == "k2":
        return 0.5 * log_ratio**2
    if kl_estimator == "k3":
        return log_ratio.exp() - 1 - log_ratio
    raise ValueError(f"kl_estimate: no branch for --kl_estimator {kl_estimator!r}")


def adaptive_kl_coef(kl_coef, kl, target, batch_size, horizon):
    """Ziegler et al. 2019: β ← β·(1 + clip(KL/target − 1, ±0.2)·batch/horizon), KL per response:
    β grows while the policy runs from π_ref, shrinks while it stays near."""
    return kl_coef * (1 + min(max(kl / target - 1, -0.2), 0.2) * batch_size / horizon)


def shaped_scores(scores, lengths, std, args):
    """The score (B,): / running std (--score_scaling), clipped (--score_clip), − λ·length, − DAPO's
    overlong penalty p·(len − (max − L))/L over the last L = --overlong_buffer tokens."""
    if args.score_scaling == "running_std":
        scores = scores / std
    if args.score_clip is not None:
        scores = scores.clamp(-args.score_clip, args.score_clip)
    if args.length_penalty:
        scores = scores - args.length_penalty * lengths
    if args.overlong_buffer:
        expected = args.response_length - args.overlong_buffer
        over = (lengths - expected).clamp(min=0) / args.overlong_buffer
        scores = scores - args.overlong_penalty * over
    return scores


def running_moments(moments, mean, var, n):
    """A batch's mean and unbiased variance of n values merged into (count, mean, M2) (Chan et al.
    1979). -> the new moments, the running std (1 until there are two values)."""
    count, running_mean, m2 = moments
    delta, total = mean - running_mean, count + n
    m2 = m2 + var * (n - 1) + delta**2 * count * n / total
    std = math.sqrt(m2 / (total - 1)) if total > 1 and m2 > 0 else 1.0
    return (total, running_mean + delta * n / total, m2), std


# What the rest of the file knows of each estimator (its branch: baselined_scores): grouped (a
# baseline over the k responses to a prompt: k >= 2), whitened (A over the batch), learns V.
ESTIMATORS = {"gae": dict(grouped=False, whitened=True, learns_value=True),
              "rloo": dict(grouped=True, whitened=False, learns_value=False),
              "grpo": dict(grouped=True, whitened=False, learns_value=False),
              "dr_grpo": dict(grouped=True, whitened=False, learns_value=False),
              "reinforce_pp": dict(grouped=False, whitened=True, learns_value=False),
              "reinforce_pp_baseline": dict(grouped=True, whitened=True, learns_value=False)}


def baselined_scores(scores, lengths, num_generations, advantage_estimator):
    """s_i (B,) minus its group's baseline (k consecutive rows): rloo s_i − mean of the others; grpo
    (s_i − mean)/(std + 1e-4); dr_grpo, reinforce_pp_baseline s_i − mean; gae, reinforce_pp s_i.
    NaN (no source scored it) stays out of its group's statistics (TRL's nanmean, nanstd); a group
    of fewer than 2 scored rows gets NaN. lengths (B,): for a baseline that weighs them."""
    if advantage_estimator in ("gae", "reinforce_pp"):
        return scores
    groups = scores.view(-1, num_generations)  # (B/k, k)
    scored = groups.isfinite()
    n = scored.sum(1, keepdim=True)  # scored rows per group
    total = groups.nansum(1, keepdim=True)
    mean = torch.where(n >= 2, total / n, math.nan)
    if advantage_estimator == "rloo":
        return (groups - (total - groups) / (n - 1)).flatten()  # n = 1: 0/0
    centered = groups - mean
    if advantage_estimator == "grpo":  # the std of the scored rows (n = k: torch's own)
        spread = groups.where(scored, mean).std(1, keepdim=True)  # Σ over k rows, / (k − 1)
        std = spread * ((num_generations - 1) / (n - 1)).sqrt()
        return (centered / (std + 1e-4)).flatten()
    if advantage_estimator in ("dr_grpo", "reinforce_pp_baseline"):
        return centered.flatten()
    raise ValueError(f"baselined_scores: no branch for --advantage_estimator {advantage_estimator}")


def equal_score_groups(scores, num_generations):
    """Groups (k consecutive rows) whose 2 or more scored rows (NaN: unscored) score alike, compared
    exactly as TRL's is_std_zero (float32's std of eight 0.1 is 8e-9): no signal. (B,) -> (B/k,)."""
    groups = scores.view(-1, num_generations)
    scored = groups.isfinite()
    low, high = groups.where(scored, math.inf).amin(1), groups.where(scored, -math.inf).amax(1)
    return (low == high) & (scored.sum(1) >= 2)


def per_token_rewards(scores, penalties, response_mask):
    """r_t = p_t (the KL penalty), plus the score on the last real token. (B,), (B, T) -> (B, T)."""
    rewards = penalties.clone()
    last = response_mask.sum(-1) - 1
    rewards[torch.arange(len(scores), device=scores.device), last] += scores
    return rewards


def gae(rewards, values, response_mask, gamma, lam):
    """δ_t = r_t + γ·V_{t+1} − V_t;  A_t = δ_t + γλ·A_{t+1};  R_t = A_t + V_t; V, A are 0 after the
    last real token (the episode ends). (B, T) -> (B, T), (B, T)."""
    values = torch.where(response_mask, values, 0.0)
    rewards = torch.where(response_mask, rewards, 0.0)
    advantages = torch.zeros_like(rewards)
    next_value, next_advantage = torch.zeros_like(rewards[:, 0]), torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantages[:, t] = next_advantage = delta + gamma * lam * next_advantage
        next_value = values[:, t]
    return advantages, advantages + values


def response_mean(x, mask):
    """mean_t x over each response's real tokens: (B, T) -> (B, 1); 0 for a response of none."""
    return torch.where(mask, x, 0.0).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)


# What the rest of the file knows of each policy loss (its branch: policy_loss): --loss_agg when
# unset, the ratio levels it takes, whether the ratio hint reads it (a clip band of PPO's ε).
POLICY_LOSSES = {"clip": dict(loss_agg="token_mean", levels=("token", "sequence"), ratio_hint=True),
                 "cispo": dict(loss_agg="token_mean", levels=("token",), ratio_hint=False),
                 "sapo": dict(loss_agg="seq_mean_token_mean", levels=("token", "sequence"),
                              ratio_hint=False),
                 "vespo": dict(loss_agg="token_mean", levels=("token",), ratio_hint=False)}


def policy_loss(logprobs, old_logprobs, advantages, mask, args, weights=None):
    """Per token, of ρ = π_θ/π_old (--policy_loss): clip max(−ρ·A, −clip(ρ, 1−ε, 1+ε_high)·A), at
    most c·|A| where A < 0 (dual clip); cispo −sg(min(ρ, c))·A·log π_θ (MiniMax-M1); sapo
    −σ(τ(ρ − 1))·(4/τ)·A with τ = τ+ where A > 0, else τ− (SAPO, Qwen); vespo −sg(φ(w))·A·log π_θ,
    φ = exp(λ + k·log w − λ·w), w = Π_t ρ_t·v_t over the response (clamped as TRL), (k, λ) by
    A's sign. sequence: ρ is GSPO's s_i = exp(mean_t log ρ_t) of the response (response_mean), its
    gradient on every token. weights v_t (B, T): the sampler's correction, times each token's loss
    (vespo: in w). -> it (B, T); per token: ρ, approx KL (ρ − 1) − log ρ, clipped (cispo: capped),
    dual-clipped (None: off), outside [1 − ε, 1 + ε_high]; vespo's φ per response (B, 1). args:
    importance_sampling_level, cliprange, dual_clip, cliprange_high, policy_loss, cispo_max,
    sapo_temperature_pos, sapo_temperature_neg, vespo_k_pos, vespo_lambda_pos, vespo_k_neg,
    vespo_lambda_neg."""
    log_ratio = logprobs - old_logprobs
    if args.importance_sampling_level == "sequence":  # the value log s_i, gradient ∇log π_θ(y_t)
        log_ratio = response_mean(log_ratio, mask).detach() + logprobs - logprobs.detach()
    ratio = log_ratio.exp()
    low, high = 1.0 - args.cliprange, 1.0 + (args.cliprange_high or args.cliprange)
    if args.policy_loss == "clip":
        unclipped, clipped = -advantages * ratio, -advantages * ratio.clamp(low, high)
        loss, is_clipped = torch.max(unclipped, clipped), clipped > unclipped
    elif args.policy_loss == "cispo":  # every token keeps its gradient; only the weight is capped
        loss = -ratio.clamp(max=args.cispo_max).detach() * advantages * logprobs
        is_clipped = ratio > args.cispo_max
    elif args.policy_loss == "sapo":  # a soft gate in place of the clip, of slope 1 at ρ = 1
        taus = ratio.new_tensor([args.sapo_temperature_pos, args.sapo_temperature_neg])
        tau = torch.where(advantages > 0, *taus)
        loss = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * advantages
        is_clipped = torch.zeros_like(loss, dtype=torch.bool)
    elif args.policy_loss == "vespo":  # a soft weight of the whole response's ratio (VESPO, TRL)
        floor = math.log(1e-8)
        log_v = 0.0 if weights is None else weights.log().clamp(floor, 20.0)  # w holds them
        log_w = torch.where(mask, log_ratio.clamp(-20.0, 20.0) + log_v, 0.0).sum(-1, keepdim=True)
        log_w, weights = log_w.clamp(floor, 20.0), None  # (B, 1)
        positive = advantages >= 0
        k = torch.where(positive, args.vespo_k_pos, args.vespo_k_neg)
        lam = torch.where(positive, args.vespo_lambda_pos, args.vespo_lambda_neg)
        phi = (lam + k * log_w - lam * log_w.exp()).exp().nan_to_num(0.0, 0.0, 0.0).detach()
        loss = -phi * advantages * logprobs
        is_clipped = torch.zeros_like(loss, dtype=torch.bool)
    else:
        raise ValueError(f"policy_loss: no branch for --policy_loss {args.policy_loss!r}")
    dual_clipped = None
    if args.dual_clip is not None:
        dual_clipped = (advantages < 0) & (loss > -args.dual_clip * advantages)
        loss = torch.where(dual_clipped, -args.dual_clip * advantages, loss)
    if weights is not None:
        loss = weights * loss
    phi = response_mean(phi, mask) if args.policy_loss == "vespo" else None
    return loss, dict(ratio=ratio, approxkl=(ratio - 1) - log_ratio, clipped=is_clipped,
                      dual_clipped=dual_clipped, outside=(ratio < low) | (ratio > high), phi=phi)


def high_entropy_tokens(entropy, mask, entropies, q):
    """The loss tokens whose entropy (B, T) is at least the (1 − q)-quantile of `entropies`, those
    of the loss tokens of all ranks (float32, linear; TRL's; "Beyond the 80/20 rule", 2025)."""
    if not len(entropies):  # no loss token anywhere
        return torch.zeros_like(mask)
    return mask & (entropy >= torch.quantile(entropies.float(), 1 - q))


def rollout_weights(logprobs, sampler_logprobs, mask, mode, cap):
    """A weight on each token's policy loss for the sampler's mismatch (TRL's vLLM importance
    sampling): w = π/μ per token (token_*) or exp(Σ_t log w_t) per response (sequence_*), then
    min(w, C) (truncate) or 0 where w > C (mask). (B, T) -> (B, T)."""
    log_w = torch.where(mask, logprobs - sampler_logprobs, 0.0)
    level, _, action = mode.partition("_")
    if level == "sequence":
        log_w = log_w.sum(-1, keepdim=True).expand_as(log_w)
    elif level != "token":
        raise ValueError(f"rollout_weights: no branch for --rollout_correction {mode!r}")
    w = log_w.exp()
    if action == "truncate":
        return w.clamp(max=cap)
    if action == "mask":
        return torch.where(w <= cap, w, 0.0)
    raise ValueError(f"rollout_weights: no branch for --rollout_correction {mode!r}")


def value_loss(values, old_values, returns, mask, cliprange_value):
    """½·E[max((V − R)², (V_old + clip(V − V_old, ±ε_v) − R)²)], clipped share (masked_mean)"""
    clipped_values = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    unclipped_loss, clipped_loss = (values - returns) ** 2, (clipped_values - returns) ** 2
    loss = 0.5 * masked_mean(torch.max(unclipped_loss, clipped_loss), mask)
    return loss, masked_mean((clipped_loss > unclipped_loss).to(loss.dtype), mask)


def aggregate(x, mask, loss_agg, response_length):
    """A minibatch's loss from per-token x (B, T): token_mean Σx/Σm (masked_mean);
    seq_mean_token_mean mean over responses of Σ_t x/length (response_mean); seq_mean_token_sum
    Σx/B (veRL's; LUSPO's); seq_mean_token_sum_norm Σx/(B·response_length) (Dr. GRPO); B counts
    responses with a token in the loss (0 if none)."""
    if loss_agg == "token_mean":
        return masked_mean(x, mask)
    responses = mask.any(-1).sum().clamp(min=1)
    if loss_agg == "seq_mean_token_mean":
        return response_mean(x, mask).sum() / responses
    total = torch.where(mask, x, 0.0).sum(-1).sum()
    if loss_agg == "seq_mean_token_sum":
        return total / responses
    if loss_agg == "seq_mean_token_sum_norm":
        return total / (responses * response_length)
    raise ValueError(f"aggregate: no branch for loss_agg {loss_agg!r}")


# ------------------------------------------------------------------------ π and V on padded batches
def forward_kwargs(input_ids, attention_mask):
    """position_ids count real tokens: left padding changes nothing (GPT-2 is off without)."""
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                use_cache=False)


def backbone(model):
    """The decoder stack of a causal LM or sequence classifier (under peft: of its base model)"""
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(model, model.base_model_prefix)


def forward(model, input_ids, attention_mask, keep):
    """One forward over a padded batch (B, S) -> the last `keep` positions: logits (B, keep, V), or
    the scalar (B, keep) of a sequence classifier's `score` head."""
    if hasattr(model, "score"):  # on the backbone's last hidden states
        hidden = backbone(model)(**forward_kwargs(input_ids, attention_mask)).last_hidden_state
        hidden = hidden[:, -keep:]
        return model.score(hidden).squeeze(-1).float()
    return model(**forward_kwargs(input_ids, attention_mask), logits_to_keep=keep).logits


def logprobs_chunk_rows(vocab_size):
    """Rows of (rows, V) float32 logits held at once: about 64 MiB (chunked_logprobs)."""
    return max(1, 2**24 // vocab_size)


def token_logprobs(logits, tokens, temperature):
    """log π(token) = log_softmax(z)[token] = z_token − logsumexp(z) with z = logits / T, and the
    entropy H = −Σ_v π_v·log π_v, float32. (..., V), (...) -> (...), (...)."""
    z = logits.float() / temperature
    log_softmax = z - z.logsumexp(-1, keepdim=True)  # log π over the vocabulary
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    return log_softmax.gather(-1, tokens[..., None]).squeeze(-1), entropy


def response_logprobs(policy, query_responses, attention_mask, context_length, temperature,
                      head=None):
    """log π(y_t|s_t), entropy (B, R): position context_length−1+t predicts y_t; head or None."""
    responses = query_responses[:, context_length:]
    ids, mask, R = query_responses[:, :-1], attention_mask[:, :-1], responses.shape[1]
    if responses.numel() <= logprobs_chunk_rows(policy.get_output_embeddings().weight.shape[0]):
        return token_logprobs(forward(policy, ids, mask, R), responses, temperature)  # one chunk
    x = forward(policy, ids, mask, R) if head is None else last_hidden(policy, ids, mask, R)
    return chunked_logprobs(x, responses, temperature, head)  # memory-efficient, behind its banner


def state_values(value_model, query_responses, attention_mask, context_length):
    """V(s_t) for every response position (B, R), read at the token before y_t."""
    R = query_responses.shape[1] - context_length
    return forward(value_model, query_responses[:, :-1], attention_mask[:, :-1], R)


# ------------------------------------------------------------------------------ rollout and scoring
def prompt_indices(num_prompts, batch_size, update, seed, rank=0, world_size=1):
    """This rank's prompts for update `update`: the next world_size x batch_size of an endless
    stream of reshuffled passes; rank r's the r-th slice."""
    start = (update * world_size + rank) * batch_size
    passes = range(start // num_prompts, (start + batch_size - 1) // num_prompts + 1)
    seeds = [seed * 1_000_003 + p for p in passes]  # not seed + p: seeds would share passes
    stream = torch.cat([torch.randperm(num_prompts,
                                       generator=torch.Generator().manual_seed(s)) for s in seeds])
    offset = start - passes[0] * num_prompts
    return stream[offset : offset + batch_size]


def left_pad(sequences, pad_token_id):
    """Lists of token ids -> ids and attention mask (B, P), padded on the left."""
    pad = torch.nn.utils.rnn.pad_sequence  # (sequences, batch_first, padding_value, padding_side)
    ids = pad([torch.tensor(s, dtype=torch.long) for s in sequences], True, pad_token_id, "left")
    return ids, pad([torch.ones(len(s), dtype=torch.bool) for s in sequences], True, False, "left")


def generate(policy, queries, query_mask, max_new_tokens, temperature, stop_token_ids, pad_token_id,
             sync_ranks=False, generator=None):
    """y_t ~ softmax(z_t / T) (T = 0: argmax) with a KV cache -> responses, log π_old(y_t|s_t)
    (B, L), pad and 0 after a stop id. sync_ranks: step until all ranks are done (FSDP)."""
    # exactly the policy we train (no top-k/top-p); T = 0 gets T = 1's log-probs; under no_grad
    new = "cache" in inspect.signature(backbone(policy).forward).parameters  # transformers >= 5.24
    cache = {"cache" if new else "past_key_values": transformers.DynamicCache(config=policy.config)}
    ids, mask, positions = queries, query_mask, (query_mask.cumsum(-1) - 1).clamp(min=0)
    done = torch.zeros(len(queries), dtype=torch.bool, device=queries.device)
    tokens, logprobs = [], []
    for _ in range(max_new_tokens):
        out = policy(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                     logits_to_keep=1, **cache)
        logp = torch.log_softmax(out.logits[:, -1].float() / (temperature or 1.0), dim=-1)  # (B, V)
        sampled = temperature and torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1)
        token = sampled if temperature else logp.argmax(-1)
        token = token.masked_fill(done, pad_token_id)
        tokens.append(token)
        logprobs.append(logp.gather(1, token[:, None]).squeeze(1).masked_fill(done, 0.0))
        done |= is_stop(token, stop_token_ids)
        if (all_ranks_sum((~done).sum()[None]) if sync_ranks else (~done).sum()) == 0:
            break
        ids, positions = token[:, None], positions[:, -1:] + 1
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    return torch.stack(tokens, 1), torch.stack(logprobs, 1)


def rollout(models, queries, query_mask, args, rt, temperature=None, generator=None):
    """Phase 1: a response to each query (B, P) from π_old, with log π_old -> query_responses,
    attention_mask, response_mask (B, R), lengths, truncated (B,), logprobs, context_length."""
    chunk, pad = args.local_rollout_forward_batch_size, models.pad_token_id
    stop = models.stop_token_ids
    with rt.no_grad(), rt.autocast(), gathered(models.policy, rt.fsdp and args.rollout_unshard):
        generated = [generate(models.policy, queries[i : i + chunk], query_mask[i : i + chunk],
                              args.response_length,
                              args.temperature if temperature is None else temperature, stop, pad,
                              sync_ranks=rt.fsdp and not args.rollout_unshard, generator=generator)
                     for i in range(0, len(queries), chunk)]
    R = max(r.shape[1] for r, _ in generated)
    responses = torch.cat([F.pad(r, (0, R - r.shape[1]), value=pad) for r, _ in generated])
    lengths = response_lengths(responses, stop)
    response_mask = torch.arange(R, device=responses.device) < lengths[:, None]
    truncated = ~(is_stop(responses, stop) & response_mask).any(1)  # no stop id: all
    return dict(query_responses=torch.cat([queries, responses], 1), context_length=queries.shape[1],
                attention_mask=torch.cat([query_mask, response_mask], 1),
                response_mask=response_mask, lengths=lengths, truncated=truncated,
                logprobs=torch.cat([F.pad(lp, (0, R - lp.shape[1])) for _, lp in generated]))


def response_chunks(batch, chunk):
    """A batch's rows `chunk` at a time for the no-grad forwards, cut after their longest real
    response L: -> rows (a slice), L, query_responses and attention_mask (b, context_length + L)."""
    for i in range(0, len(batch["lengths"]), chunk):
        rows = slice(i, i + chunk)
        L = batch["lengths"][rows].max().item()
        width = batch["context_length"] + L
        yield rows, L, batch["query_responses"][rows, :width], batch["attention_mask"][rows, :width]


def trainer_state(updates_done, sizes, args, prompts):
    """TRL's trainer_state for reward functions: updates done, in the run, passes over prompts."""
    epoch = updates_done * sizes.batch_size / args.num_generations / len(prompts.ids)
    return SimpleNamespace(global_step=updates_done, max_steps=sizes.num_updates, epoch=epoch)


def score(models, batch, prompts, rows, args, rt, trainer_state, scores_only=False):
    """Phase 2: no-grad forwards of the frozen models -> ref_logprobs, values (B, R), completions,
    source_scores (B, S; NaN: None), raw_scores Σ w·s (B,), scored (B,; False: every source gave
    None, raw score 0); logprobs: log π_old as training computes it (bf16/fp16: recomputed; fp32:
    μ), sampler_logprobs μ. scores_only: reward sources only."""
    context_length, lengths = batch["context_length"], batch["lengths"]
    mask = batch["response_mask"]
    sampler_logprobs = batch["logprobs"]  # μ (B, R), also log π_old unless bf16/fp16 (below)
    logprobs = sampler_logprobs.clone() if rt.low_dtype else sampler_logprobs
    ref_logprobs = logprobs if models.ref_policy is None else torch.zeros_like(logprobs)  # KL 0
    values = torch.zeros_like(logprobs)
    rm_scores = [torch.zeros(len(mask), device=rt.device) for _ in models.reward_models]
    chunk = args.local_rollout_forward_batch_size
    with rt.no_grad(), rt.autocast():
        for rows_i, L, ids, ids_mask in response_chunks(batch, chunk):
            if models.ref_policy is not None and not scores_only:
                with models.reference():  # LoRA: the policy with its adapter off
                    ref_logprobs[rows_i, :L] = response_logprobs(
                        models.ref_policy, ids, ids_mask, context_length, args.temperature,
                        models.ref_head)[0]
            if models.value_model is not None and not scores_only:
                values[rows_i, :L] = state_values(models.value_model, ids, ids_mask, context_length)
            if rt.low_dtype and not scores_only:  # log π_old as training computes it: ρ_1 = 1
                logprobs[rows_i, :L] = response_logprobs(models.policy, ids, ids_mask,
                                                         context_length, args.temperature,
                                                         models.policy_head)[0]
            for j, (reward_model, reward_tokenizer) in enumerate(models.reward_models):
                if reward_tokenizer is None:  # the policy's token ids, read at the last real token
                    token_scores = forward(reward_model, ids, ids_mask, L)  # (b, L)
                    last = lengths[rows_i, None] - 1
                    rm_scores[j][rows_i] = token_scores.gather(1, last).squeeze(1)
    responses = [r[context_length : context_length + n]
                 for r, n in zip(batch["query_responses"].tolist(), lengths.tolist())]
    completions = models.tokenizer.batch_decode(responses, skip_special_tokens=True)
    # the reward models that read text with their own tokenizer, and the reward functions: (B, S)
    source_scores = text_scores(models, rm_scores, prompts, rows, completions, responses,
                                trainer_state, chunk, rt)
    return dict(logprobs=logprobs.masked_fill(~mask, 0.0),
                ref_logprobs=ref_logprobs.masked_fill(~mask, 0.0),
                values=values.masked_fill(~mask, 0.0), completions=completions,
                source_scores=source_scores,
                raw_scores=(source_scores * models.reward_weights).nansum(1),
                sampler_logprobs=sampler_logprobs, scored=~source_scores.isnan().all(1))


# ----------------------------------------------------------------------------------- the PPO update
def advantages_and_returns(scores, kl, kl_coef, values, mask, loss_mask, args):
    """Phase 4, run once per update (replay trains on what it made): p_t, every per-token term but
    the score (−β·KL_t where --kl_in puts it); r_t = p_t, plus the score minus its group's baseline
    on the last real token; A_t, R_t = A_t + V_t by GAE (value-free: V = 0, λ = 1, the reward-to-
    go), whitened with the global statistics of the tokens in the loss where the estimator is; the
    loss mask less the rows with no baseline (NaN). (B,), (B, R) -> those, (B, R); β a float."""
    if args.kl_in == "reward":
        penalties = torch.where(mask, -kl_coef * kl, 0.0)
    elif args.kl_in == "loss":  # ppo_loss's term, with a gradient through π_θ
        penalties = torch.zeros_like(kl)
    else:
        raise ValueError(f"advantages_and_returns: no branch for --kl_in {args.kl_in!r}")
    baselined = baselined_scores(scores, mask.sum(-1), args.num_generations,
                                 args.advantage_estimator)
    loss_mask = loss_mask & baselined.isfinite()[:, None]  # NaN: no score, or no group to compare
    rewards = per_token_rewards(baselined.nan_to_num(), penalties, mask)  # (B, R)
    if args.whiten_rewards:  # over all ranks, mean kept
        rewards = masked_whiten(rewards, mask, *global_mean_var(rewards, mask), shift_mean=False)
    estimator = ESTIMATORS[args.advantage_estimator]
    lam = args.lam if estimator["learns_value"] else 1.0  # value-free: the reward-to-go
    advantages, returns = gae(rewards, values, mask, args.gamma, lam)
    if estimator["whitened"]:
        advantages = masked_whiten(advantages, mask, *global_mean_var(advantages, loss_mask))
    return dict(penalties=penalties, rewards=rewards, advantages=advantages, returns=returns,
                loss_mask=loss_mask)


MICRO_BATCH_KEYS = ("logprobs", "ref_logprobs", "values", "advantages", "returns", "weights",
                    "sampler_logprobs")  # (B, R) tensors a micro-batch takes


def ppo_epochs(model, optimizer, scaler, batch, args, sizes, rt):
    """Phase 5: num_ppo_epochs passes over this rank's batch, a step per minibatch. -> stats (per
    micro-batch), stop_reason, optimizer_steps (those taken), train_tokens."""
    lengths, context_length = batch["lengths"], batch["context_length"]
    params = [p for p in model.parameters() if p.requires_grad]
    stats, stop_reason, optimizer_steps, train_tokens = defaultdict(list), None, 0, 0
    for epoch in range(args.num_ppo_epochs):
        order = torch.randperm(len(lengths), device=lengths.device)
        for mb_rows in order.split(sizes.local_mini_batch_size):
            # tokens and responses in the global minibatch's loss (--mask_truncated_completions)
            loss_mask = batch["loss_mask"][mb_rows]
            mb_tokens, mb_responses = all_ranks_sum(torch.stack([loss_mask.sum(),
                                                                 loss_mask.any(1).sum()]).float())
            if mb_tokens == 0:  # no token in the loss: no step
                continue
            approxkl_sum, non_finite = torch.zeros(2, device=lengths.device)  # this rank's sums
            micro_batches = mb_rows.split(sizes.micro_batch_size)
            for i, rows in enumerate(micro_batches):
                L = lengths[rows].max().item()  # pay only for real tokens
                mb = {k: batch[k][rows, :L] for k in MICRO_BATCH_KEYS if k in batch}
                mb.update({"age": batch["age"][rows]} if "age" in batch else {})  # replay_batch's
                mb["response_mask"] = batch["loss_mask"][rows, :L]  # the tokens in the loss
                # the whole minibatch's loss on all ranks: this micro-batch's share of its tokens
                # or responses, times world_size (DDP and FSDP average the ranks' gradients)
                token_share = mb["response_mask"].sum() * rt.world_size / mb_tokens
                response_share = mb["response_mask"].any(1).sum() * rt.world_size / mb_responses
                policy_share = token_share if args.loss_agg == "token_mean" else response_share
                with gradient_sync(model, i == len(micro_batches) - 1):  # after its last
                    with rt.autocast():
                        width = context_length + L  # log π_θ(y_t|s_t), its entropy, V(s_t) (B, R)
                        ids = batch["query_responses"][rows, :width]
                        ids_mask = batch["attention_mask"][rows, :width]
                        new_logprobs, entropy, new_values = model(ids, ids_mask, context_length,
                                                                  args.temperature)
                    policy_term, vf_loss, losses, tokens = ppo_loss(
                        new_logprobs, entropy, new_values, mb, batch["kl_coef"], args)
                    loss = policy_term * policy_share
                    if vf_loss is not None:
                        loss = loss + args.vf_coef * vf_loss * token_share
                    non_finite += ~torch.isfinite(loss)  # voted on by all ranks below
                    scaler.scale(loss).backward()
                update_stats(stats, mb, entropy, losses, tokens)
                approxkl_sum += tokens["approxkl"].detach().where(mb["response_mask"], 0.0).sum()
                train_tokens += ids_mask.sum().item()
            # early stop and the non-finite vote use every rank's numbers: all take the same path
            approxkl_sum, non_finite = all_ranks_sum(torch.stack([approxkl_sum, non_finite]))
            approxkl = approxkl_sum / mb_tokens  # the minibatch's token mean over all ranks
            stats["policy/approxkl_avg"].append(approxkl)
            grad_norm = None if non_finite else optimizer_step(optimizer, scaler, params,
                                                               args.max_grad_norm)
            if grad_norm is None:
                stop_reason = "non-finite loss" if non_finite else "non-finite gradient"
                break
            if torch.isfinite(grad_norm):  # else GradScaler skipped it
                stats["policy/grad_norm"].append(grad_norm.float())
                optimizer_steps += 1
            if args.target_kl is not None and approxkl > args.target_kl:
                stop_reason = "target_kl"
                break
        if stop_reason:
            break
    optimizer.zero_grad(set_to_none=True)
    return SimpleNamespace(stats=stats, stop_reason=stop_reason, optimizer_steps=optimizer_steps,
                           train_tokens=train_tokens,
                           steps_per_epoch=len(lengths) // sizes.local_mini_batch_size)


def ppo_loss(new_logprobs, entropy, new_values, mb, kl_coef, args):
    """One micro-batch's loss: the policy term (L_clip + β·KL, --kl_in loss, − c_H·H, as --loss_agg)
    and L_V (None without V). -> those, the named losses, policy_loss's token statistics."""
    mask = mb["response_mask"]
    agg = lambda x: aggregate(x, mask, args.loss_agg, args.response_length)  # noqa: E731
    pg_tokens, tokens = policy_loss(new_logprobs, mb["logprobs"], mb["advantages"], mask, args,
                                    mb.get("weights"))  # phase 2's --rollout_correction, replay's
    if args.off_policy_mask_threshold is not None:  # DeepSeek-V3.2: a response whose return is < 0
        drift = response_mean(mb["sampler_logprobs"] - new_logprobs.detach(), mask)  # (b, 1)
        negative = mb["advantages"][:, :1] < 0  # A at its first token: the whole response's
        tokens["off_policy_masked"] = out = negative & (drift > args.off_policy_mask_threshold)
        pg_tokens = pg_tokens * ~out
    q = args.top_entropy_quantile
    if q < 1:  # the policy term (and H) of the highest-entropy tokens only, over all ranks' tokens
        entropies = all_ranks_cat(entropy.detach()[mask])  # a collective: every rank is here
        high = high_entropy_tokens(entropy.detach(), mask, entropies, q)
        tokens["entropy_masked"] = mask & ~high
        pg_tokens, entropy = pg_tokens * high, entropy * high
    policy_term = agg(pg_tokens)
    losses = {"loss/policy_avg": policy_term}
    if args.kl_in == "loss" and kl_coef:  # a gradient through π_θ
        kl = kl_estimate(new_logprobs, mb["ref_logprobs"], args.kl_estimator)
        if args.use_bias_correction_kl:  # E_π_old[ρ·k] = E_π_θ[k]: ∇KL(π_θ‖π_ref) at any θ
            rho = (new_logprobs - mb["logprobs"]).exp()  # π_θ/π_old, the clip's π_old
            kl = kl * (rho.detach() if args.kl_estimator == "k2" else rho)  # k2: exact with sg(ρ)
        losses["loss/kl_avg"] = kl_loss = agg(kl)
        policy_term = policy_term + kl_coef * kl_loss
    if args.entropy_coef:
        policy_term = policy_term - args.entropy_coef * agg(entropy)
    vf_loss = None
    if new_values is not None:
        vf_loss, losses["val/clipfrac_avg"] = value_loss(new_values.float(), mb["values"],
                                                         mb["returns"], mask, args.cliprange_value)
        losses["loss/value_avg"] = vf_loss
    return policy_term, vf_loss, losses, tokens


def optimizer_step(optimizer, scaler, params, max_grad_norm):
    """Unscale, clip the gradient norm, step, zero. -> the norm, None if not finite."""
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm  # FSDP2
    if not torch.isfinite(grad_norm) and not scaler.is_enabled():
        return None
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    return grad_norm


# --------------------------------------------------------- main: setup, then the loop in six phases
ON_FAILURE = []  # checkpoint(failing=True) while the weights are the last update's; errors run it


def main(args: Args):
    ON_FAILURE.clear()  # an earlier run's, in this process
    sizes = agreed(check_args, args)  # a bad flag fails before loading
    model_path, dataset, eval_dataset = builtin_task(args)  # before the process group
    rt = start_processes(args)  # torchrun: join the process group; device and precision
    output_dir = run_folder(args, rt)
    if output_dir is None:  # --resume auto on a finished run: it says so, nothing is redone
        return None
    inputs = agreed(check_inputs, args, model_path, dataset, eval_dataset, output_dir)  # no model
    prompts = inputs.prompts
    torch.manual_seed(args.seed)  # a new value head: the same on all ranks
    models, model = load_models(args, model_path, inputs, rt)  # model: policy and value as one
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],  # fp32 state
                                  lr=args.learning_rate, eps=1e-8, weight_decay=0.0,
                                  fused=rt.device.type in ("cpu", "cuda"))
    warmup, steps = math.ceil(args.warmup_ratio * sizes.num_updates), sizes.num_updates  # updates
    lr_scheduler = transformers.get_scheduler(args.lr_scheduler_type, optimizer, warmup, steps)
    scaler = torch.amp.GradScaler(rt.device.type, enabled=args.dtype == "fp16")  # fp16: scaled
    log = Logger(args, output_dir, sizes, rt, inputs, models)
    with log.ending():  # the run folder says how the run ended (stopped.txt)
        saved = (model, optimizer, lr_scheduler, scaler, args, rt, models, log)  # checkpoint()'s
        start_update, progress = resume(output_dir, *saved)
        kl_coef = progress["kl_coef"]  # β; the adaptive controller changes it
        last_update = start_update if args.export_checkpoint else sizes.num_updates
        for update in range(start_update, last_update):
            model.eval()  # 4.x: train() mode drops the KV cache
            if update == 0 and args.eval_on_start and inputs.eval_prompts:  # the policy before
                log.evaluation(*evaluate(models, inputs.eval_prompts, -1, args, rt,
                                         trainer_state(0, sizes, args, prompts)), True)
            log.start_update()  # the clock of its phases
            done = {**progress, "kl_coef": kl_coef}  # the loop's state after `update` updates
            save = partial(checkpoint, output_dir, update, done, *saved, failing=True)  # on failure
            ON_FAILURE[:] = [save] if update else []
            # this rank's slice; seeds from (seed, update, rank) (ints hash to themselves): resumes
            rows = prompt_indices(len(prompts.ids), sizes.local_num_prompts, update, args.seed,
                                  rt.rank, rt.world_size)
            rows = rows.repeat_interleave(args.num_generations).tolist()  # a group: k rows
            random.seed(hash((args.seed, update, rt.rank)))
            torch.manual_seed(hash((args.seed, update, rt.rank)) % 2**63)

            # 1. rollout: sample responses with the current policy π_old, keeping each log π_old
            queries, query_mask = left_pad([prompts.ids[i] for i in rows], models.pad_token_id)
            batch = rollout(models, queries.to(rt.device), query_mask.to(rt.device), args, rt)
            mask = batch["response_mask"]  # (B, R), True = real response token
            log.lap("generate")

            # 2. score: log π_ref and V(s_t) of every response token, and each response's score
            batch.update(score(models, batch, prompts, rows, args, rt,
                               trainer_state(update, sizes, args, prompts)))
            scored = batch["scored"]  # (B,): False where no reward source scored the row (None)
            warn_unscored(scored, prompts, rows, models, update)  # over all ranks
            scores = batch["raw_scores"]  # (B,)
            if args.missing_eos_penalty is not None:  # responses without a stop id
                scores = scores - args.missing_eos_penalty * batch["truncated"].float()
            std = 1.0
            if args.score_scaling == "running_std":  # moments of the global batch (all ranks)
                mean, var = global_mean_var(scores, scored)
                progress["score_moments"], std = running_moments(
                    progress["score_moments"], mean.item(), var.item(), sizes.batch_size)
            scores = shaped_scores(scores, batch["lengths"].float(), std, args)  # as the flags say
            scores = scores.where(scored, math.nan)  # NaN: no reward source scored it
            if args.rollout_correction != "none":  # w = π_old/μ: the sampler's mismatch (bf16)
                batch["weights"] = rollout_weights(batch["logprobs"], batch["sampler_logprobs"],
                                                   mask, args.rollout_correction,
                                                   args.rollout_correction_cap)
            log.lap("score")

            # 3. KL: KL_t of every response token, an estimate of KL(π_old‖π_ref) from its samples
            kl = kl_estimate(batch["logprobs"], batch["ref_logprobs"], args.kl_estimator)
            kl = kl.where(mask, 0.0)  # (B, R)

            # 4. rewards and advantages: r_t = −β·KL_t (or the KL is a loss term) + the score (minus
            # its group's baseline) on the last token; GAE, whitened over the tokens in the loss
            loss_mask = mask  # phase 4 leaves out the rows with no baseline (no score)
            if args.mask_truncated_completions:
                loss_mask = loss_mask & ~batch["truncated"][:, None]
            if args.filter_zero_std_groups:  # scores that carry no signal (DAPO), yet fill the mean
                equal = equal_score_groups(scores, args.num_generations)
                loss_mask = loss_mask & ~equal.repeat_interleave(args.num_generations)[:, None]
            batch.update(scores=scores, kl=kl, kl_coef=kl_coef, **advantages_and_returns(
                scores, kl, kl_coef, batch["values"], mask, loss_mask, args))

            # 5. PPO epochs: num_ppo_epochs passes over the batch, an optimizer step per minibatch
            ON_FAILURE.clear()  # the weights move: no longer the last update's
            train_batch = batch  # with --replay_rounds N also the last N batches, off-policy
            if args.replay_rounds:
                train_batch = replay_batch(progress, batch, update, models, args, rt)
            model.train()
            trained = ppo_epochs(model, optimizer, scaler, train_batch, args, sizes, rt)
            lr = lr_scheduler.get_last_lr()[0]
            with warnings.catch_warnings():  # no warning if no step was taken
                warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step")
                lr_scheduler.step()
            log.count_bad_updates(progress, trained.stop_reason, update)
            log.lap("train")

            # 6. log: TRL's metric names, over the global batch and all micro-batches of all epochs
            metrics, token_counts = update_metrics(batch, trained, models, args, rt)
            samples = []
            if inputs.eval_prompts and update in log.evaluated:  # held-out prompts
                model.eval()
                eval_metrics, samples = evaluate(models, inputs.eval_prompts, update, args, rt,
                                                 trainer_state(update + 1, sizes, args, prompts))
                metrics.update(eval_metrics)
            log.update(update, lr, metrics, token_counts, batch, prompts, rows, samples)
            if args.adaptive_kl_target is not None:  # the global KL: the same β everywhere
                kl_coef = adaptive_kl_coef(kl_coef, metrics["objective/kl"],
                                           args.adaptive_kl_target, sizes.batch_size,
                                           args.adaptive_kl_horizon)
            if checkpoint(output_dir, update + 1, {**progress, "kl_coef": kl_coef}, *saved):  # stop
                return log.last
        ON_FAILURE.clear()
        written = save_final(model, models, args, output_dir, rt, last_update)
        log.finish(f"saved {written} to {output_dir}")
    return log.last


# ====== Behind main (a first reading may stop here): checks, evaluation, models, systems ======
# -------------------------------------------------- flags and inputs, checked before anything loads
def fail(message):
    """Bad input: one line naming the flag to fix (no traceback); nothing written is touched."""
    raise SystemExit(f"error: {message}")


@contextmanager
def flag_errors(what):
    """Around a library's or the user's call: its exception fails as one line, `error: {what}: {the
    exception}`; one from a function of this file below the block (a bug) keeps its traceback."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 (the library's own words say what is wrong)
        frames = traceback.extract_tb(e.__traceback__)[2:]  # below this and the block's own frame
        if any(f.filename == __file__ and not f.name.startswith("<") for f in frames):
            raise
        fail(f"{what}: {one_line(e)}")


def warn(line):
    """A warning on stderr, from rank 0 only: every rank runs the checks."""
    if os.environ.get("RANK", "0") == "0":
        say(line, sys.stderr)


# What check_args allows of every flag with a range: {what is allowed: (its test, the flags)}.
FLAG_RANGES = {
    ">= 1": (lambda v: v >= 1, "per_device_train_batch_size gradient_accumulation_steps"
             " num_mini_batches num_ppo_epochs response_length local_rollout_forward_batch_size"
             " total_episodes num_generations adaptive_kl_horizon"),
    "> 0": (lambda v: v > 0, "temperature cliprange cliprange_value max_grad_norm dist_timeout_s"
            " lora_alpha cispo_max sapo_temperature_pos sapo_temperature_neg"
            " rollout_correction_cap vespo_k_pos vespo_lambda_pos vespo_k_neg vespo_lambda_neg"),
    ">= 0": (lambda v: v >= 0, "kl_coef vf_coef save_every save_total_limit"
             " num_sample_generations lora_r eval_temperature overlong_buffer health_window"
             " replay_rounds"),
    "in [0, 1]": (lambda v: 0 <= v <= 1, "gamma lam warmup_ratio"),
    "in (0, 1]": (lambda v: 0 < v <= 1, "top_entropy_quantile"),
    "> 0 (or unset)": (lambda v: v is None or v > 0, "target_kl adaptive_kl_target cliprange_high"
                       " score_clip"),
    ">= 0 (or unset)": (lambda v: v is None or v >= 0, "learning_rate"),
    "> 1 (or unset)": (lambda v: v is None or v > 1, "dual_clip"),
    ">= 1 (or unset)": (lambda v: v is None or v >= 1, "replay_weight_cap max_prompt_length"),
    "token ids >= 0, at least one (or unset)": (lambda v: v is None or (v and min(v) >= 0),
                                                "stop_token_id"),
    "a finite number (or unset)": (lambda v: True, "missing_eos_penalty entropy_coef length_penalty"
                                   " overlong_penalty off_policy_mask_threshold"),
    "finite numbers (or unset)": (lambda v: v is None or all(map(math.isfinite, v)),
                                  "reward_weights"),
    "any integer": (lambda v: True, "seed"),
}
# What check_args refuses of flags together: {the error: when}; ranges are checked first.
FLAG_CONFLICTS = {
    "--advantage_estimator: a group baseline compares the responses to one prompt: give "
    "--num_generations >= 2": lambda a: ESTIMATORS[a.advantage_estimator]["grouped"]
        and a.num_generations == 1,
    "--value_model_path is unused: the --advantage_estimator has no value model":
        lambda a: a.value_model_path and not ESTIMATORS[a.advantage_estimator]["learns_value"],
    "--overlong_buffer is over --response_length": lambda a: a.overlong_buffer > a.response_length,
    "--dtype fp16 with --distributed fsdp: GradScaler would skip steps on some shards only; use "
    "--dtype bf16":
        lambda a: a.dtype == "fp16" and a.distributed == "fsdp" and "RANK" in os.environ,
    "--ref_model_path is unused: --kl_coef 0 has no KL term":
        lambda a: a.ref_model_path and a.kl_coef == 0,
    "--ref_model_path is unused with --lora_r: the reference is the policy, adapter off":
        lambda a: a.ref_model_path and a.lora_r,
    "--export_checkpoint needs --resume FOLDER, the checkpoint it writes":
        lambda a: a.export_checkpoint and a.resume in (None, "auto"),
    "--lora_target_modules needs --lora_r > 0": lambda a: a.lora_target_modules and not a.lora_r,
    "--replay_rounds N > 0 and --replay_correction naive|decoupled go together":
        lambda a: bool(a.replay_rounds) != (a.replay_correction is not None),
    "--replay_weight_cap needs --replay_correction decoupled (it caps its weights)":
        lambda a: a.replay_weight_cap and a.replay_correction != "decoupled",
    "--warmup_ratio needs --lr_scheduler_type linear or cosine (constant has no warmup)":
        lambda a: a.lr_scheduler_type == "constant" and a.warmup_ratio,  # transformers' ignores it
    # E_π_old[∇k1] = −∇KL(π_old‖π_θ): nothing toward π_ref (ρ·k1's is ∇KL(π_θ‖π_ref))
    "--kl_estimator k1, --kl_in loss and --no-use-bias-correction-kl pull nothing toward π_ref":
        lambda a: a.kl_in == "loss" and a.kl_estimator == "k1" and not a.use_bias_correction_kl,
    "--adaptive_kl_target scales --kl_coef, which is 0: give --kl_coef > 0":
        lambda a: a.adaptive_kl_target and a.kl_coef == 0,
    "--dual_clip bounds the clipped surrogate: it needs --policy_loss clip":
        lambda a: a.dual_clip and a.policy_loss != "clip",
    "--cliprange_high is the clip's upper band: --policy_loss cispo, sapo and vespo clip nothing":
        lambda a: a.cliprange_high and a.policy_loss != "clip",
    "--rollout_correction sequence_* with --policy_loss vespo: its w takes token weights (as TRL)":
        lambda a: a.policy_loss == "vespo" and a.rollout_correction.startswith("sequence"),
    "--importance_sampling_level sequence needs a value-free --advantage_estimator (A per token), "
    "no --dual_clip": lambda a: a.importance_sampling_level == "sequence" and (
        ESTIMATORS[a.advantage_estimator]["learns_value"] or a.dual_clip),
    "--importance_sampling_level: --policy_loss does not take it (POLICY_LOSSES' levels)":
        lambda a: a.importance_sampling_level not in POLICY_LOSSES[a.policy_loss]["levels"],
    "--off_policy_mask_threshold needs a value-free --advantage_estimator (it judges whole "
    "responses)": lambda a: a.off_policy_mask_threshold is not None
        and ESTIMATORS[a.advantage_estimator]["learns_value"],
    "--filter_zero_std_groups needs a group --advantage_estimator (ESTIMATORS' grouped)":
        lambda a: a.filter_zero_std_groups and not ESTIMATORS[a.advantage_estimator]["grouped"],
    "--rollout_correction needs --dtype bf16 or fp16: in fp32 the sampler's μ is π_old itself "
    "(w = 1)": lambda a: a.rollout_correction != "none" and a.dtype == "fp32",
    "--rollout_correction with --replay_rounds: replay's μ is the sampler's, --replay_correction "
    "decoupled weights every row by π_prox/μ already":
        lambda a: a.rollout_correction != "none" and a.replay_rounds,
}


def derive_sizes(args, world_size):
    """Batch sizes per rank (`local_`) and over all: rollout batch, minibatches, micro-batches."""
    local_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps
    local_mini_batch_size = local_batch_size // args.num_mini_batches
    batch_size = local_batch_size * world_size  # responses per update over all ranks
    return SimpleNamespace(
        world_size=world_size, batch_size=batch_size, local_batch_size=local_batch_size,
        local_num_prompts=local_batch_size // args.num_generations,
        local_mini_batch_size=local_mini_batch_size,
        micro_batch_size=local_mini_batch_size // args.gradient_accumulation_steps,
        num_updates=args.total_episodes // batch_size)


def check_args(args):
    """Every check that needs only the flags (and torchrun's WORLD_SIZE). -> the derived sizes, and
    the flags as given (changed_flags, before a default resolves)."""
    given = changed_flags(args)
    if isinstance(args.stop_token_id, int):  # from Python, Args(stop_token_id=5): a list of one
        args.stop_token_id = [args.stop_token_id]
    args.kl_estimator = args.kl_estimator or ("k3" if args.kl_in == "loss" else "k1")  # as in TRL
    for flag, table in (("advantage_estimator", ESTIMATORS), ("policy_loss", POLICY_LOSSES)):
        if getattr(args, flag) not in table:  # a fork's new value without its facts
            fail(f"--{flag} {getattr(args, flag)}: no row of facts beside its branch")
    loss_agg = POLICY_LOSSES[args.policy_loss]["loss_agg"]
    if args.importance_sampling_level == "sequence":  # as veRL: one ratio per response counts once
        loss_agg = "seq_mean_token_mean"
    # LUSPO (GSPO's ratio, summed per response): weighed by length on purpose
    luspo = args.importance_sampling_level == "sequence" and args.loss_agg == "seq_mean_token_sum"
    if args.loss_agg not in (None, loss_agg) and loss_agg == "seq_mean_token_mean" and not luspo:
        warn(f"warning: --loss_agg {args.loss_agg} weights each response by its length; GSPO and "
             "SAPO average per response (seq_mean_token_mean)")
    args.loss_agg = args.loss_agg or loss_agg
    for allowed, (ok, flags) in FLAG_RANGES.items():
        for flag in flags.split():  # NaN fails every comparison; inf is refused too
            value = getattr(args, flag)
            if not ok(value) or (isinstance(value, float) and not math.isfinite(value)):
                fail(f"--{flag} {value} is out of range: it must be {allowed}")
    for field in fields(args):  # Args(reward_fn="m:f")
        if "list" in str(field.type) and isinstance(getattr(args, field.name), str):
            fail(f"--{field.name} takes a list: {field.name}=[{getattr(args, field.name)!r}]")
    num_sources = len(args.reward_model_path or []) + len(args.reward_fn or []) or 1  # 0: built-in
    if args.reward_weights is not None and len(args.reward_weights) != num_sources:
        fail(f"--reward_weights {args.reward_weights} does not give one weight per reward source "
             f"({num_sources}: the reward models, then the reward functions)")
    sizes = derive_sizes(args, int(os.environ.get("WORLD_SIZE", 1)))
    for flag in ("num_mini_batches", "num_generations"):
        if sizes.local_batch_size % getattr(args, flag):
            fail(f"rollout batch {sizes.local_batch_size} (--per_device_train_batch_size x "
                 f"--gradient_accumulation_steps) is not divisible by --{flag} "
                 f"{getattr(args, flag)}")
    if sizes.local_mini_batch_size % args.gradient_accumulation_steps:
        fail(f"minibatch {sizes.local_mini_batch_size} is not divisible by "
             f"--gradient_accumulation_steps {args.gradient_accumulation_steps}")
    for message, refused in FLAG_CONFLICTS.items():
        if refused(args):
            fail(message)
    if args.total_episodes < sizes.batch_size:
        fail(f"--total_episodes {args.total_episodes} is less than one rollout batch "
             f"({sizes.batch_size} over all ranks)")
    sizes.flags = given
    return sizes


def check_inputs(args, model_path, dataset, eval_dataset, output_dir):
    """Every check that needs files but no weights: output, configs, prompts, rewards."""
    if not args.reward_model_path and not args.reward_fn and args.dataset != "builtin":  # first
        fail("no reward for these prompts: give --reward_model_path or --reward_fn (the built-in "
             "reward scores only the built-in task's sums)")
    parent = os.path.abspath(output_dir)  # the output folder: writable, no run in it unless resumed
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        fail(f"--output_dir {output_dir!r}: {parent!r} is a file; give a folder")
    if not os.access(parent, os.W_OK):
        fail(f"--output_dir {output_dir!r} cannot be written ({parent!r} is not writable)")
    if os.path.exists(os.path.join(output_dir, "metrics.jsonl")) and not args.resume:
        fail(f"--output_dir {output_dir!r} already holds a run (metrics.jsonl); pass --resume auto "
             "(it continues the run, or with no checkpoint sets its metrics.jsonl aside and starts "
             "over) or choose another --output_dir")
    if args.track:
        with flag_errors("--track needs `pip install wandb`"):
            importlib.import_module("wandb")
    if args.lora_r:
        with flag_errors("--lora_r needs `pip install peft`"):
            importlib.import_module("peft")
    configs = check_configs(args, model_path)
    base_model = adapter_base(model_path) or model_path  # an adapter's base, else the model itself
    policy_config = configs[base_model]
    own_tokenizer = os.path.isfile(os.path.join(os.path.expanduser(model_path),
                                                "tokenizer_config.json"))
    tokenizer = from_pretrained(AutoTokenizer, model_path if own_tokenizer else base_model,
                                "model_name_or_path", args)
    stop_token_ids = resolve_stop_token_ids(args, tokenizer, base_model, policy_config)
    vocab_size = getattr(policy_config.get_text_config(), "vocab_size", None) or len(tokenizer)
    outside = [i for i in stop_token_ids if not 0 <= i < vocab_size]  # not grown for a pad
    if outside:
        fail(f"--stop_token_id {outside}: not in the policy's vocabulary [0, {vocab_size})")
    lr_source = check_resume(args, output_dir, stop_token_ids)
    if not stop_token_ids and int(os.environ.get("RANK", 0)) == 0:
        say("note: no stop id (--stop_token, --stop_token_id, the tokenizer, generation_config): "
            f"every response runs to --response_length {args.response_length}")
    context = check_context(f"--model_name_or_path {model_path!r}", policy_config,
                            (args.max_prompt_length or 1) + args.response_length,
                            f"--max_prompt_length {args.max_prompt_length or 1} + "
                            f"--response_length {args.response_length}",
                            "lower --max_prompt_length or --response_length")
    if (args.eval_dataset == args.dataset and not args.dataset.endswith((".txt", ".jsonl"))
            and args.dataset_test_split == args.dataset_train_split):  # a hub dataset
        fail(f"--eval_dataset {args.eval_dataset!r} is --dataset with the same split "
             f"({args.dataset_train_split!r}): it would evaluate on training prompts; give another "
             "--dataset_test_split")
    prompt_sets = {"dataset": load_prompts(dataset, args, tokenizer, context)}
    if eval_dataset:
        prompt_sets["eval_dataset"] = load_prompts(eval_dataset, args, tokenizer, context,
                                                   "eval_dataset")
    if max(max(i) for p in prompt_sets.values() for i in p.ids) >= vocab_size:
        fail(f"--model_name_or_path {model_path!r}: its tokenizer gives prompt ids past the "
             f"model's vocabulary of {vocab_size}; give the tokenizer that matches the model")
    if (eval_dataset and os.path.isfile(dataset) and os.path.isfile(eval_dataset)  # local files
            and os.path.samefile(dataset, eval_dataset)):
        warn(f"warning: --eval_dataset {eval_dataset!r} is the --dataset file: it evaluates on "
             "training prompts")
    return SimpleNamespace(tokenizer=tokenizer, prompts=prompt_sets["dataset"],
                           eval_prompts=prompt_sets.get("eval_dataset"), lr_source=lr_source,
                           stop_token_ids=stop_token_ids,
                           **check_rewards(args, tokenizer, configs, prompt_sets, stop_token_ids))


def check_resume(args, output_dir, stop_token_ids):
    """The checkpoint to resume (resume()'s first; auto skips a damaged one) against this run; the
    learning rate: given, else the checkpoint's, else the default. -> where it comes from."""
    lr = args.learning_rate
    for path in resume_candidates(args, output_dir)[:1]:
        try:  # with no --learning_rate, the checkpoint's
            check_checkpoint(path, args, stop_token_ids, int(os.environ.get("WORLD_SIZE", 1)))
        except DAMAGED as e:  # a checkpoint that cannot be read
            if args.resume != "auto":
                fail(f"--resume {path!r}: {one_line(e)}")
    if args.learning_rate is None:  # a real model's 1e-6 (TRL's); the built-in toy's 1e-3
        builtin = args.model_name_or_path == "builtin"
        args.learning_rate = 1e-3 if builtin else 1e-6
        return "the built-in task's" if builtin else "a real model's default, TRL's"
    return "--learning_rate" if lr is not None else "the checkpoint's"


def check_configs(args, model_path):
    """Every config by path (an adapter's: its base's); reward models: 1-label classifiers."""
    configs = {}
    for flag, path in {"model_name_or_path": model_path, "ref_model_path": args.ref_model_path,
                       "value_model_path": args.value_model_path}.items():
        if path:
            base = adapter_base(path, flag)
            if base:  # an adapter checkpoint: peft, and its base's config
                with flag_errors(f"--{flag} {path!r} (an adapter) needs `pip install peft`"):
                    importlib.import_module("peft")
            configs[base or path] = from_pretrained(AutoConfig, base or path, flag, args)
    for path in args.reward_model_path or []:
        config = configs[path] = from_pretrained(AutoConfig, path, "reward_model_path", args)
        kind = (config.architectures or [type(config).__name__])[0]
        if config.architectures and not kind.endswith("ForSequenceClassification"):
            fail(f"--reward_model_path {path!r} is a {kind} checkpoint, which has no reward head; "
                 "give a sequence classifier (*ForSequenceClassification) with one label")
        if config.num_labels != 1:
            fail(f"--reward_model_path {path!r} is a {kind} with {config.num_labels} labels, not 1")
    bf16_stored = [p for p, config in configs.items() if stored_dtype(p, config) == torch.bfloat16]
    if args.dtype == "fp16" and bf16_stored:
        warn(f"warning: {', '.join(bf16_stored)}: stored in bf16, whose range fp16 lacks: --dtype "
             "fp16 can overflow where bf16 does not (--dtype bf16 avoids it)")
    return configs


def check_rewards(args, tokenizer, configs, prompt_sets, stop_token_ids):
    """Each reward model's tokenizer (None: the policy's ids), context checked; the functions."""
    reward_tokenizers = []
    for path in args.reward_model_path or []:
        reward_tokenizer = from_pretrained(AutoTokenizer, path, "reward_model_path", args)
        if tokenizer.get_vocab().items() >= reward_tokenizer.get_vocab().items():
            reward_tokenizer = None  # same vocabulary: it scores the policy's token ids directly
        elif reward_tokenizer.pad_token is None:
            reward_tokenizer.pad_token = reward_tokenizer.eos_token
        reward_tokenizers.append(reward_tokenizer)
        for prompts in prompt_sets.values():  # its context: the longest prompt, in its tokens
            ids = prompts.ids if reward_tokenizer is None else [
                reward_tokenizer(reward_text(reward_tokenizer, prompts, r, ""),
                                 add_special_tokens=m is None)["input_ids"]
                for r, m in enumerate(prompts.messages)]
            longest = max(map(len, ids))
            check_context(f"--reward_model_path {path!r}", configs[path],
                          longest + args.response_length,
                          f"a prompt of {longest} + --response_length {args.response_length}",
                          "shorten the prompts (--max_prompt_length) or --response_length")
    reward_fns = [(load_reward_fn(spec), spec) for spec in args.reward_fn or []]
    if not reward_fns and not args.reward_model_path:  # the built-in prompts
        reward_fns = [(addition_reward, "addition_reward")]
        if ADDITION_WORDS.index("<eos>") not in stop_token_ids:
            fail("the built-in task's answers end at its EOS, which is not a stop id here: keep "
                 "--stop_token eos")
    fields = {flag: prompts.fields for flag, prompts in prompt_sets.items()}  # their names
    return dict(reward_tokenizers=reward_tokenizers,
                reward_fns=[(fn, spec, reward_call(fn, spec, fields)) for fn, spec in reward_fns])


def stored_dtype(path, config):
    """A checkpoint's storage dtype: its config's, else its first tensor's (None: unknown)."""
    dtype = getattr(config, "dtype", None)  # hub configs with `torch_dtype` read as dtype too
    folder = os.path.expanduser(path)
    if dtype is None and os.path.isdir(folder):
        files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
        if files:
            from safetensors import safe_open
            with safe_open(os.path.join(folder, files[0]), "pt") as f:
                keys = list(f.keys())
                dtype = keys and {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}.get(
                    f.get_slice(keys[0]).get_dtype())
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else None


def resolve_stop_token_ids(args, tokenizer, path, config):
    """--stop_token_id, or with --stop_token eos the tokenizer's and generation config's EOS."""
    ids = args.stop_token_id or []  # [] is refused by check_args
    if not ids and args.stop_token == "eos":
        try:
            eos = transformers.GenerationConfig.from_pretrained(path).eos_token_id
        except OSError:  # no generation_config.json
            eos = transformers.GenerationConfig.from_model_config(config).eos_token_id
        ids = [tokenizer.eos_token_id, *(eos if isinstance(eos, (list, tuple)) else [eos])]
    ids = list(dict.fromkeys(i for i in ids if i is not None))  # once each
    if not ids and (args.mask_truncated_completions or args.missing_eos_penalty is not None):
        flag = ("--mask_truncated_completions" if args.mask_truncated_completions
                else "--missing_eos_penalty")
        fail(f"{flag} needs a stop id, and there is none (--stop_token None): every response would "
             "count as cut off")
    return ids


def check_context(model, config, tokens, what, fix):
    """The one length check: prompt + response `tokens` must fit the model's context (-> it)."""
    context = getattr(config, "max_position_embeddings", None)
    if context and tokens > context:
        fail(f"{model}: {what} is {tokens} tokens, more than its context of {context}; {fix}")
    return context


# -------------------------------------------------------------------------- the held-out evaluation


def evaluate(models, prompts, update, args, rt, trainer_state):
    """Held-out evaluation, its own random stream -> eval/ metrics (all ranks), samples."""
    n = len(prompts.ids)
    per_rank = -(-n // rt.world_size)  # equal slices (FSDP): the last prompt fills them up
    slots = rt.rank * per_rank + torch.arange(per_rank, device=rt.device)
    rows, real = slots.clamp(max=n - 1).tolist(), slots < n
    # its own stream: a run trains the same with or without evaluation
    stream = torch.Generator(rt.device).manual_seed(hash((args.seed, update, rt.rank, 1)) % 2**63)
    queries = left_pad([prompts.ids[r] for r in rows], models.pad_token_id)  # and their mask
    batch = rollout(models, *(x.to(rt.device) for x in queries), args, rt, args.eval_temperature,
                    stream)
    scored = score(models, batch, prompts, rows, args, rt, trainer_state, scores_only=True)
    scores, num_rms = scored["raw_scores"], len(models.reward_models)
    metrics = {"eval/score": scores, "eval/response_length": batch["lengths"]}  # (B,) each
    if models.builtin_reward:
        metrics["eval/success_rate"] = scores == 1
    if num_rms > 1:  # as objective/rm_spread
        metrics["eval/rm_spread"] = reward_model_spread(scored["source_scores"], num_rms)
    # Σ over the real rows of all ranks; last, the rows a source scored (eval/score's count)
    totals = all_ranks_sum(torch.stack([(v * real).sum().double()
                                        for v in (*metrics.values(), scored["scored"])]))
    means = dict(zip(metrics, (totals[:-1] / n).tolist()))
    means["eval/score"] = (totals[0] / totals[-1]).nan_to_num().item()
    samples = [dict(update=update + 1, prompt=prompts.texts[i], completion=c,
                    score=s if ok else None)  # None: no source scored it
               for i, c, s, ok in zip(slots.tolist(), scored["completions"], scores.tolist(),
                                      scored["scored"].tolist()) if i < n]
    return means, samples


# ----------------------------------------------------- replay: off-policy updates (--replay_rounds)
# What a batch keeps, fixed when it was sampled: its rows, μ (the sampler's log-probs), log π_ref,
# and what phase 4 made of them (A, R, the loss mask), which replay trains on as they are. Per rank
# N·B·(9·P + 27·R) bytes for N batches of B rows of P + R tokens (ids int64, masks bool, 4 float32
# rows): no logits.
REPLAY_KEYS = ("query_responses", "attention_mask", "response_mask", "loss_mask", "lengths",
               "sampler_logprobs", "ref_logprobs", "advantages", "returns")


def replay_batch(progress, batch, update, models, args, rt):
    """This update's rows: the fresh batch and the last N, as phase 4 left them, at one width, with
    π_prox and V of now (the decoupled ratio's denominator and weights, the value clip's centre)."""
    fresh = dict({k: batch[k] for k in (*REPLAY_KEYS, "context_length")}, update=update)
    old = progress["replay"]
    progress["replay"] = [*old, fresh][-args.replay_rounds:]
    parts = [dict(fresh, prox=batch["logprobs"], values=batch["values"])]  # π_prox = π_old
    for b in old:  # π_prox: the policy now, at the start of the update
        prox, values = recomputed(models, b, args, rt)
        parts.append(dict(b, prox=prox, values=values))
    P = max(b["context_length"] for b in parts)
    R = max(b["response_mask"].shape[1] for b in parts)

    def padded(b, k):  # one width: prompts padded left, responses right (positions: the mask)
        left = P - b["context_length"] if k in ("query_responses", "attention_mask") else 0
        value = models.pad_token_id if k == "query_responses" else 0
        right = R - b["response_mask"].shape[1]
        return F.pad(b[k], (left, right), value=value) if b[k].dim() == 2 else b[k]  # (B,) as it is
    train = {k: torch.cat([padded(b, k) for b in parts]) for k in (*REPLAY_KEYS, "prox", "values")}
    age = torch.cat([torch.full_like(b["lengths"], update - b["update"]) for b in parts])  # (ΣB,)
    train.update(context_length=P, kl_coef=batch["kl_coef"], age=age)
    mask, age, prox = train["response_mask"], age[:, None], train["prox"]
    mu = train["sampler_logprobs"]
    # how stale the rows are (k3: KL(μ‖π_prox); π_prox/μ before the cap, the share above it), each
    # Σ x·m / Σ m over all ranks (0 / 0: NaN)
    k3, weight, replayed = kl_estimate(mu, prox, "k3"), (prox - mu).exp(), mask & (age > 0)
    cap = args.replay_weight_cap or 2.0
    ratios = {"replay/share": (replayed, mask), "replay/mean_age": (age, mask),
              **{f"replay/kl_age{a}": (k3, mask & (age == a))
                 for a in range(1, args.replay_rounds + 1)},
              "replay/weight_mean": (weight, replayed),
              "replay/weight_masked": (weight > cap, replayed)}
    sums = all_ranks_sum(torch.stack([y.sum().double() for x, m in ratios.values()
                                      for y in (x * m, m)]))
    weight_max = max(all_ranks_objects(torch.where(replayed, weight, -math.inf).max().item()))
    batch["replay_metrics"] = {**dict(zip(ratios, (sums[::2] / sums[1::2]).tolist())),
                               "replay/weight_max": weight_max}
    train["logprobs"] = mu  # the ratio's denominator; naive: μ
    # decoupled: clip around π_prox (Hilton et al. 2021), weight π_prox/μ, 0 above c as AReaL
    if args.replay_correction == "decoupled":
        train["weights"] = rollout_weights(prox, mu, mask, "token_mask", cap)
        train["logprobs"] = prox
    return train


def recomputed(models, b, args, rt):
    """log π(y_t|s_t) at --temperature and V(s_t) (0 without V) of a batch's rows with the models
    of now: (2, B, R), 0 at padding."""
    c, pad = b["context_length"], ~b["response_mask"]
    out = torch.zeros(2, *pad.shape, device=pad.device)
    with rt.no_grad(), rt.autocast():
        for rows, L, ids, ids_mask in response_chunks(b, args.local_rollout_forward_batch_size):
            out[0, rows, :L] = response_logprobs(models.policy, ids, ids_mask, c, args.temperature,
                                                 models.policy_head)[0]
            if models.value_model is not None:
                out[1, rows, :L] = state_values(models.value_model, ids, ids_mask, c)
    return out.masked_fill(pad, 0.0)


# ------------------------------------------------------------------------- models, data and rewards
def from_pretrained(cls, path, flag, args, **kwargs):
    """cls.from_pretrained(path), or one line naming the flag when that fails."""
    # a local folder that is not there (transformers would say "Repo id must be in the form ...")
    if path.startswith(("/", ".", "~")) and not os.path.isdir(os.path.expanduser(path)):
        fail(f"--{flag} {path!r}: no such folder (give a model folder or hub name like org/model)")
    with flag_errors(f"--{flag} {path!r} could not be loaded"):  # transformers reads no `~`
        path = os.path.expanduser(path)
        return cls.from_pretrained(path, trust_remote_code=args.trust_remote_code, **kwargs)


def load_pretrained(cls, path, flag, args, dtype=torch.float32, new_head=False, rt=None,
                    frozen=False, **kwargs):
    """A model in `dtype`, dropout off (it would break π_old), one line for missing weights;
    given rt under FSDP2, loaded into its shards where it can be (load_into_shards)."""
    base = adapter_base(path, flag)
    if base:  # an adapter checkpoint (peft): its base model with the adapter merged in
        model = load_pretrained(cls, base, flag, args, dtype, new_head, **kwargs)
        import peft  # check_configs found it
        with flag_errors(f"--{flag} {path!r} could not be loaded"), quietly():
            path = os.path.expanduser(path)
            return peft.PeftModel.from_pretrained(model, path).merge_and_unload()
    config = from_pretrained(AutoConfig, path, flag, args, **kwargs)
    for key, value in config.to_dict().items():
        if ("dropout" in key or key.endswith("pdrop")) and isinstance(value, float):
            setattr(config, key, 0.0)
    loaded = rt and rt.fsdp and load_into_shards(cls, path, flag, config, dtype, rt, frozen)
    if not loaded:  # transformers' report of missing and unused weights: said below, a line each
        no_report = lambda r: not re.search(r"^Some weights of|LOAD REPORT", r.getMessage())
        log = transformers.utils.logging.get_logger("transformers.modeling_utils")
        log.addFilter(no_report)
        try:  # dtype: transformers >= 5 would keep the storage's
            loaded = from_pretrained(cls, path, flag, args, config=config, dtype=dtype,
                                     output_loading_info=True)
        finally:
            log.removeFilter(no_report)
    model, info = loaded
    missing = [k for k in info["missing_keys"] if not (new_head and k.startswith("score."))]
    for kind, keys in (("missing from", missing), ("unused by", info["unexpected_keys"])):
        if keys:
            say(f"warning: --{flag} {path!r}: {len(keys)} weights {kind} the checkpoint "
                f"({', '.join(sorted(keys)[:3])}{', ...' if len(keys) > 3 else ''})",
                file=sys.stderr)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    model.new_head = len(missing) < len(info["missing_keys"])  # a score head was left out
    return model


def adapter_base(path, flag="model_name_or_path"):
    """The base model an adapter folder's adapter_config.json names; None for a model."""
    config = os.path.join(os.path.expanduser(path), "adapter_config.json")
    if not os.path.isfile(config):
        return None
    with flag_errors(f"--{flag} {path!r}: adapter_config.json cannot be read"), open(config) as f:
        return json.load(f)["base_model_name_or_path"]


def load_models(args, model_path, inputs, rt):
    """Every model on rt.device, trained ones fp32 and wrapped (wrap_for_training)."""
    frozen_dtype = rt.low_dtype or torch.float32
    dtype = frozen_dtype if args.lora_r else torch.float32  # of trained models (LoRA: frozen)
    frozen = lambda m, dtype=frozen_dtype: m.requires_grad_(False).eval().to(rt.device, dtype)
    frozen_rt = rt if args.shard_frozen_models else None
    if rt.fsdp and args.lora_r and rt.rank == 0:
        say("note: --lora_r: peft adapts whole models: each rank loads them, then shards them")
    policy = load_pretrained(AutoModelForCausalLM, model_path, "model_name_or_path", args, dtype,
                             rt=None if args.lora_r else rt)  # FSDP2: into shards (not for peft)
    if args.lora_r:
        policy = add_lora(policy, args)
    policy.to(rt.device)
    # log-probs straight from the hidden states where the model allows it (probed before the other
    # models load: under FSDP2 its forward gathers)
    policy_head = output_layer(policy)
    ref_policy = ref_head = None  # --kl_coef 0: no KL, no reference model
    if args.kl_coef and args.lora_r:  # the same weights: score() switches the adapter off
        ref_policy, ref_head = policy, policy_head
    elif args.kl_coef:  # in the policy's precision, so that where π_θ = π_ref the KL is 0, not a
        # bf16 floor: fp32 under autocast, the bf16 of its gathers under FSDP2 (loaded again: the
        # policy is in shards); RoPE's inv_freq as loaded
        ref_policy = frozen(load_pretrained(
            AutoModelForCausalLM, args.ref_model_path or model_path, "ref_model_path", args,
            frozen_dtype if rt.fsdp else dtype, rt=frozen_rt, frozen=True)
            if rt.fsdp or args.ref_model_path else copy.deepcopy(policy), None)
        # a sharded frozen model's output layer is whole only inside its forward: (B, R, V) logits
        ref_head = None if rt.fsdp and args.shard_frozen_models else output_layer(ref_policy)
    reward_models = [(frozen(load_pretrained(  # (model, its tokenizer, or None: the policy's ids)
        AutoModelForSequenceClassification, path, "reward_model_path", args, frozen_dtype,
        rt=frozen_rt, frozen=True)), reward_tokenizer)
        for path, reward_tokenizer in zip(args.reward_model_path or [], inputs.reward_tokenizers)]
    value_model, value_source, value_path = load_value_model(args, model_path, inputs, dtype, rt)
    # a path that still holds the base weights after the run (not the built-in task's temp folder,
    # nor a merged adapter); else None, and a LoRA run saves them beside its adapter
    base_paths = {k: None if args.model_name_or_path == "builtin" and p == model_path
                  or adapter_base(p) else p
                  for k, p in {"policy": model_path, "value_model": value_path}.items() if p}
    num_sources = len(reward_models + inputs.reward_fns)
    tokenizer = inputs.tokenizer
    models = SimpleNamespace(
        tokenizer=tokenizer, policy=policy, ref_policy=ref_policy, value_model=value_model,
        pad_token_id=next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0)
                          if i is not None),  # any id will do: masks come from lengths
        reference=policy.disable_adapter if args.lora_r else nullcontext,  # around ref_policy
        stop_token_ids=inputs.stop_token_ids, value_source=value_source, ref_head=ref_head,
        policy_head=policy_head, reward_models=reward_models, reward_fns=inputs.reward_fns,
        builtin_reward=not (args.reward_fn or args.reward_model_path),  # addition_reward alone
        reward_weights=torch.tensor(args.reward_weights or [1 / num_sources] * num_sources,
                                    device=rt.device),
        base_paths=base_paths)
    return models, wrap_for_training(models, args, rt)


def load_value_model(args, model_path, inputs, dtype, rt):
    """The value model (fp32), where it came from, its path; none without GAE."""
    if not ESTIMATORS[args.advantage_estimator]["learns_value"]:
        return None, f"no value model (--advantage_estimator {args.advantage_estimator})", None
    shared = inputs.reward_tokenizers[:1] == [None]  # reward model 1 reads the policy's ids
    path = args.value_model_path or (args.reward_model_path[0] if shared else model_path)
    model = load_pretrained(AutoModelForSequenceClassification, path, "value_model_path", args,
                            dtype, new_head=True, rt=None if args.lora_r else rt, num_labels=1)
    if not hasattr(model, "score"):
        fail(f"--value_model_path {path!r}: need a decoder with a per-token `score` head "
             "(a *ForSequenceClassification of a causal LM)")
    if args.lora_r:  # its own adapter, and the whole score head
        model = add_lora(model, args, modules_to_save=["score"])
    source = "value model from " + (f"--value_model_path {path}" if args.value_model_path else
                                    "the reward model" if path != model_path else "the policy")
    return model.to(rt.device), source, path


def load_prompts(dataset, args, tokenizer, context, flag="dataset"):
    """-> texts, ids, chat messages, the rows' other fields, over-long counts."""
    split = args.dataset_train_split if flag == "dataset" else args.dataset_test_split
    rows, lines = read_prompts(dataset, split, flag)
    where = lambda i: f"row {i + 1}" + (f" (line {lines[i]})" if lines else "")  # from 1, as files
    prompts = [row.get("prompt", row.get("messages")) for row in rows]
    bad = [i for i, p in enumerate(prompts) if not (isinstance(p, str) or isinstance(p, list) and p
           and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                   and isinstance(m.get("content"), str) for m in p))]
    if bad:  # else transformers' chat template fails on it, naming no row
        fail(f"--{flag} {dataset!r}: {where(bad[0])} is not a text or a non-empty list of messages "
             '{"role": str, "content": str}')
    texts, ids, messages = render_prompts(prompts, tokenizer, f"--{flag} {dataset!r}")
    if not texts:
        fail(f"--{flag} {dataset!r} holds no prompts")
    if [] in ids:
        fail(f"--{flag} {dataset!r}: {where(ids.index([]))} is empty after tokenization")
    limit = args.max_prompt_length or (context and context - args.response_length)  # None: none
    over = [i for i, prompt in enumerate(ids) if limit and len(prompt) > limit]
    if over and args.overlong_prompts == "error":
        default = f" (context {context} minus --response_length {args.response_length})"
        fail(f"--{flag} {dataset!r}: {where(over[0])} has {len(ids[over[0]])} tokens, the first of "
             f"{len(over)} longer than --max_prompt_length {limit}"
             f"{'' if args.max_prompt_length else default}; shorten them or pass "
             "--overlong_prompts filter|truncate_left")
    truncated = over if args.overlong_prompts == "truncate_left" else []
    for i in truncated:  # the policy reads the last ids (of a chat row: its template's, as TRL);
        ids[i] = ids[i][-limit:]  # the reward sources the text of those ids, or the messages
        texts[i] = tokenizer.decode(ids[i])
    dropped = set(over) - set(truncated)
    kept = [i for i in range(len(ids)) if i not in dropped]
    if not kept:
        fail(f"--{flag} {dataset!r}: all {len(ids)} prompts are longer than --max_prompt_length "
             f"{limit}, and --overlong_prompts {args.overlong_prompts} leaves none")
    texts, ids, messages, rows = ([x[i] for i in kept] for x in (texts, ids, messages, rows))
    not_passed = "prompt completion completion_ids messages".split()  # TRL passes on the rest
    names = dict.fromkeys(k for row in rows for k in row if k not in not_passed)  # once each
    return SimpleNamespace(texts=texts, ids=ids, messages=messages, origins=list(map(where, kept)),
                           fields={name: [row.get(name) for row in rows] for name in names},
                           filtered=len(dropped), truncated=len(truncated))


def read_prompts(dataset, split, flag):
    """-> the rows (a `prompt` or `messages`, other fields), a file's line numbers."""
    if dataset.endswith((".txt", ".jsonl")):
        with flag_errors(f"--{flag} {dataset!r}"), open(dataset, encoding="utf-8") as f:
            lines = {n: line.rstrip("\n") for n, line in enumerate(f, 1) if line.strip()}
        rows = []
        for n, line in lines.items():
            try:
                row = {"prompt": line} if dataset.endswith(".txt") else json.loads(line)
                if not isinstance(row.get("prompt", row.get("messages")), (str, list)):
                    raise ValueError
            except (ValueError, AttributeError):
                fail(f"--{flag} {dataset!r} line {n}: expected a JSON object with a `prompt` or "
                     "`messages` field")
            rows.append(row)
        return rows, list(lines)
    if os.path.exists(dataset):
        fail(f"--{flag} {dataset!r}: use a .txt or .jsonl file")
    with flag_errors(f"--{flag} {dataset!r} as a hub dataset (`pip install datasets`)"):
        data = importlib.import_module("datasets").load_dataset(dataset, split=split)
    if {"prompt", "messages"}.isdisjoint(data.column_names):
        fail(f"--{flag} {dataset!r} has no `prompt` or `messages` column")
    return list(data), None


def render_prompts(rows, tokenizer, flag):
    """Chat rows through the chat template -> texts, ids, messages (None: plain)."""
    messages = [None if isinstance(r, str) else r[:-1] if r[-1]["role"] == "assistant" else r
                for r in rows]
    with flag_errors(f"{flag}: its chat rows (`messages`, or a `prompt` of messages) through the "
                     "policy's chat template"):
        texts = [r if m is None else tokenizer.apply_chat_template(
            m, tokenize=False, add_generation_prompt=True) for r, m in zip(rows, messages)]
    ids = [tokenizer(t, add_special_tokens=m is None)["input_ids"] for t, m in zip(texts, messages)]
    return texts, ids, messages


def load_reward_fn(spec):
    """`module:function` (the current folder first) or `file.py:function` -> it."""
    module, _, name = spec.rpartition(":")
    with flag_errors(f"--reward_fn {spec!r} (module:function or file.py:function) fails to load"):
        sys.path.insert(0, os.getcwd())  # sys.path[0] is the script's folder, not the current one
        try:
            namespace = (runpy.run_path(module) if module.endswith(".py")
                         else vars(importlib.import_module(module)))
        finally:
            sys.path.remove(os.getcwd())
    if not callable(namespace.get(name)):
        fail(f"--reward_fn {spec!r}: {module} has no function {name!r}")
    return namespace[name]


REWARD_ARGUMENTS = "prompts completions completion_ids trainer_state".split()  # TRL's keywords


def reward_call(fn, spec, fields):
    """How to call a reward function: None (**kwargs), or the names it asks for."""
    params = inspect.signature(fn).parameters.values()
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    trl_only = sorted(named & {"log_extra", "log_metric", "environments"})  # this script lacks them
    if trl_only:
        fail(f"--reward_fn {spec!r} asks for {trl_only}, which only TRL's trainers give")
    required = {p.name for p in params
                if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    for flag, names in fields.items():
        clash = sorted(set(names) & set(REWARD_ARGUMENTS))  # never completion_ids (load_prompts)
        if clash:
            fail(f"--{flag} has a field named {clash[0]!r}, a reward function's argument")
        missing = sorted(required - {*REWARD_ARGUMENTS, *names})
        if missing:  # also where it names none of them, as the positional f(p, c) of old versions
            fail(f"--reward_fn {spec!r} needs {missing[0]!r}, which the rows of --{flag} do not "
                 f"have (their fields: {sorted(names) or 'none'}); it takes "
                 f"{inspect.signature(fn)}: give it (prompts, completions), or keywords "
                 f"({', '.join(REWARD_ARGUMENTS)}, a field of the rows, **kwargs)")
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return None
    asked = named & set(REWARD_ARGUMENTS).union(*fields.values())
    if not asked:  # f(x=0) would score every row with its defaults
        fail(f"--reward_fn {spec!r} takes {inspect.signature(fn)}, none of its arguments: give it "
             f"(prompts, completions), or keywords ({', '.join(REWARD_ARGUMENTS)}, a field)")
    return asked


def text_scores(models, rm_scores, prompts, rows, completions, responses, state, chunk, rt):
    """Every source's scores (B, S): reward models (text ones here), then functions."""
    with rt.no_grad(), rt.autocast():
        for j, (rm, tokenizer) in enumerate(models.reward_models):
            if tokenizer is not None:  # its own tokenizer: it reads the text
                rm_scores[j] = torch.cat([score_texts(rm, tokenizer, prompts, rows[i : i + chunk],
                                                      completions[i : i + chunk], rt.device)
                                          for i in range(0, len(rows), chunk)])
    # a vote, as for a non-finite loss: a reward function that fails on one rank stops them all
    fn_scores = agreed(reward_function_scores, models, prompts, rows, completions, responses, state)
    return torch.column_stack([*rm_scores, fn_scores.to(rt.device)])


def reward_function_scores(models, prompts, rows, completions, completion_ids, trainer_state):
    """Each reward function's scores (B, F), NaN where it gave None."""
    chat = [prompts.messages[r] for r in rows]  # None: a plain prompt
    given = dict(prompts=[prompts.texts[r] if m is None else m for r, m in zip(rows, chat)],
                 completions=[t if m is None else [{"role": "assistant", "content": t}]
                              for t, m in zip(completions, chat)],
                 completion_ids=completion_ids, trainer_state=trainer_state,
                 **{name: [values[r] for r in rows] for name, values in prompts.fields.items()})
    columns = [torch.zeros(len(rows), 0)]  # (B, F), F = 0 too
    for fn, spec, how in models.reward_fns:
        with flag_errors(f"--reward_fn {spec} failed"):  # the user's code: where it raised, too
            out = fn(**{k: v for k, v in given.items() if how is None or k in how})
            if inspect.isawaitable(out):  # an async def function
                out = asyncio.run(out)
            out = list(out)  # a generator runs here
        columns.append(check_scores(out, len(rows), f"--reward_fn {spec}"))
    return torch.column_stack(columns)


def warn_unscored(scored, prompts, rows, models, update):
    """The rows no reward source scored (every function gave None), over all ranks: one warning
    naming their --dataset rows, or a stop (after update 1 with a checkpoint) if no row has one."""
    mine = [prompts.origins[r] for r, s in zip(rows, scored.tolist()) if not s]
    gathered = all_ranks_objects((mine, scored.any().item()))
    missed = [origin for rank_mine, _ in gathered for origin in rank_mine]
    functions = ", ".join(spec for _, spec, _ in models.reward_fns)
    if not any(any_scored for _, any_scored in gathered):  # every rank is here: save together
        fail(f"--reward_fn {functions}: no source scored any response of update {update + 1} (None "
             "from every function)" + "".join(save() for save in ON_FAILURE))
    if missed and int(os.environ.get("RANK", 0)) == 0:
        say(f"warning: update {update + 1}: no reward source scored {len(missed)} responses (None "
            f"from --reward_fn {functions}), to --dataset {', '.join(dict.fromkeys(missed))}: "
            "left out of their group's baseline and of the loss", file=sys.stderr)


def check_scores(scores, n, source):
    """A reward function's list of scores -> float32 (n,), NaN for None, or one line."""
    if len(scores) != n:
        fail(f"{source} returned {len(scores)} scores for {n} completions")
    for i, s in enumerate(scores):
        scalar = torch.is_tensor(s) and s.ndim == 0 and not s.is_complex()
        if not (s is None or (isinstance(s, numbers.Real) or scalar) and math.isfinite(s)):
            fail(f"{source} returned a {type(s).__name__} ({s!r:.40}) for completion {i}: a score "
                 "is a finite real number or None")
    return torch.tensor([math.nan if s is None else float(s) for s in scores])  # default: float32


def reward_text(reward_tokenizer, prompts, r, completion):
    """Prompt r + completion as text: a chat prompt through its chat template."""
    if prompts.messages[r] is not None and reward_tokenizer.chat_template:
        turns = prompts.messages[r] + [{"role": "assistant", "content": completion}]
        return reward_tokenizer.apply_chat_template(turns, tokenize=False)
    return prompts.texts[r] + completion


def score_texts(model, tokenizer, prompts, rows, completions, device):
    """A reward model's scores (B,) from text in its own tokenizer."""
    enc = tokenizer([reward_text(tokenizer, prompts, r, c) for r, c in zip(rows, completions)],
                    padding=True, return_tensors="pt",
                    add_special_tokens=prompts.messages[rows[0]] is None).to(device)
    mask = enc["attention_mask"].bool()
    check_context(f"--reward_model_path {model.name_or_path!r}", model.config, mask.shape[1],
                  "prompt + response in its tokens", "lower --response_length")
    if not hasattr(model, "score"):
        return model(**enc).logits[:, 0].float()
    last = mask.cumsum(1).argmax(1, keepdim=True)  # the last real token: where the count peaks
    return forward(model, enc["input_ids"], mask, mask.shape[1]).gather(1, last).squeeze(1)


ADDITION_WORDS = "<pad> <eos> <unk> + =".split() + [str(i) for i in range(19)]  # its vocabulary
ADDITION_PARTIAL_CREDIT = 0.5


def addition_reward(completion_ids, answer, **kwargs):
    """The built-in reward: 1 for the sum then EOS, partial for the sum alone, else 0."""
    return [0.0 if ids[:1] != [ADDITION_WORDS.index(a)] else
            1.0 if ids[1:] == [ADDITION_WORDS.index("<eos>")] else ADDITION_PARTIAL_CREDIT
            for ids, a in zip(completion_ids, answer)]


def builtin_task(args):
    """-> policy, prompts, eval prompts; `builtin` ones in a temp folder per process."""
    transformers.utils.logging.disable_progress_bar()  # a quiet start, before anything is written
    model_path, dataset = args.model_name_or_path, args.dataset
    eval_dataset = None if args.eval_dataset == "auto" else args.eval_dataset
    if "builtin" in (model_path, dataset):
        folder = tempfile.mkdtemp(prefix=f"ppo_rlhf_builtin_{os.getpid()}_")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        held_out = dataset == "builtin" and args.eval_dataset == "auto"
        model, prompts, evaluated = build_addition_task(folder, args.seed, held_out)
        model_path = model if model_path == "builtin" else model_path
        if dataset == "builtin":
            dataset, eval_dataset = prompts, evaluated or eval_dataset
    return model_path, dataset, eval_dataset


def build_addition_task(folder, seed, held_out=True):
    """The built-in task: a tiny random Llama, a word tokenizer, the 100 sums a + b =."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    words = ADDITION_WORDS
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(cleanup=False)  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                        unk_token="<unk>")
    config = LlamaConfig(vocab_size=len(words), hidden_size=64, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=16,
                         tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    torch.manual_seed(seed)
    model_dir = os.path.join(folder, "model")
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    sums = [json.dumps({"prompt": f"{a} + {b} =", "answer": str(a + b)}) + "\n"
            for a in range(10) for b in range(10)]
    held = torch.randperm(100, generator=torch.Generator().manual_seed(0))[:20].tolist()
    evaluated = sorted(held) if held_out else []
    trained = [i for i in range(100) if i not in evaluated]
    files = []
    for name, rows in ("prompts", trained), ("eval_prompts", evaluated):
        files.append(os.path.join(folder, f"{name}.jsonl") if rows else None)
        if rows:
            with open(files[-1], "w") as f:
                f.writelines(sums[i] for i in rows)
    return model_dir, *files


# --- distributed: torchrun, DDP, FSDP2, statistics over ranks (systems: a first read may skip this)
@dataclass
class Runtime:
    """This process: rank, world size, device, whether torchrun and FSDP2 run it, autocast dtype."""
    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    torchrun: bool = False
    fsdp: bool = False
    low_dtype: Optional[torch.dtype] = None

    def autocast(self):
        on = self.low_dtype is not None
        return torch.autocast(self.device.type, dtype=self.low_dtype) if on else nullcontext()

    def no_grad(self):  # for the rollout: FSDP2 cannot reuse weights gathered under inference_mode
        return torch.no_grad() if self.fsdp else torch.inference_mode()


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CPUINFO = "/proc/cpuinfo"  # its flags name the CPU's bf16 and fp16 units (avx512_bf16, amx_fp16...)


def start_processes(args):
    """Under torchrun (RANK, LOCAL_RANK and WORLD_SIZE set) join its process group. -> Runtime."""
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if "RANK" in os.environ and not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo",
                                timeout=timedelta(seconds=args.dist_timeout_s))
    torchrun = in_process_group()
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if torchrun else (0, 1)
    low_dtype = None if args.dtype == "fp32" else DTYPES[args.dtype]
    if not cuda and low_dtype and rank == 0 and os.access(CPUINFO, os.R_OK):  # Linux
        with open(CPUINFO) as f:
            flags = next((line.split() for line in f if line.startswith("flags")), [])
        units = [f"avx512_{args.dtype}", f"amx_{args.dtype}"]
        if flags and set(units).isdisjoint(flags):
            say(f"note: --dtype {args.dtype} runs slower than fp32 on this CPU (no "
                f"{' or '.join(units)} in {CPUINFO}); choose it to match a GPU run's numbers")
    fsdp = torchrun and args.distributed == "fsdp"
    return Runtime(rank, world_size, device, torchrun, fsdp, low_dtype)


def in_process_group():
    """Whether torchrun's process group is up (False where torch has no torch.distributed)."""
    return dist.is_available() and dist.is_initialized()


def all_ranks_sum(x):
    """Σ of x over all ranks under torchrun (in place); x itself in a single process."""
    if in_process_group():
        dist.all_reduce(x)
    return x


def all_ranks_cat(x):
    """Every rank's x (n,), concatenated in rank order; x itself in a single process."""
    return torch.cat([part.to(x.device) for part in all_ranks_objects(x.cpu())])


def all_ranks_objects(obj):
    """[every rank's obj] (picklable), on every rank; [obj] in a single process."""
    objects = [obj] * (dist.get_world_size() if in_process_group() else 1)
    if len(objects) > 1:
        dist.all_gather_object(objects, obj)
    return objects


def agreed(check, *args):
    """check(*args) on every rank; if it fails on any, all stop with its first failure (a bug, not
    a fail(): its traceback, on the ranks that met it)."""
    result = error = bug = None
    try:
        result = check(*args)
    except SystemExit as e:
        error = str(e)
    except Exception as e:  # noqa: BLE001 (every rank must learn of it)
        error, bug = f"error: {one_line(e)}", e
    failed = list(filter(None, all_ranks_objects(error)))
    if failed:
        saved = "".join(save() for save in ON_FAILURE)  # every rank: the updates done (main's)
        leave_process_group()  # every rank is here, none in a collective: leave together
        if bug:
            raise bug
        # Rank 0 prints the error and fails the run; the others leave with status 0, since a rank
        # that exits 1 first makes torchrun kill rank 0 before it has printed.
        raise SystemExit(failed[0] + saved if os.environ.get("RANK", "0") == "0" else 0)
    return result


def one_line(exception):
    """An exception as one line: type, the first line of its message, and file:line."""
    where = traceback.extract_tb(exception.__traceback__)[-1]
    message = (str(exception).strip().splitlines() or [""])[0]
    return (f"{type(exception).__name__}: {message} "
            f"({os.path.basename(where.filename)}:{where.lineno}, in {where.name})")


def leave_process_group():
    """Free FSDP2's modules, then the group (torn down at exit it can abort)."""
    if in_process_group():
        gc.collect()
        dist.destroy_process_group()


def fsdp_units(model):
    """FSDP2's units among a model's modules (none without FSDP2)."""
    return [m for m in model.modules() if hasattr(m, "unshard")]


def global_mean_var(x, mask):
    """Mean and unbiased variance of the real entries over all ranks (two passes: Σx, Σ(x − μ)²)."""
    n, total = all_ranks_sum(torch.stack([mask.sum().to(x.dtype), torch.where(mask, x, 0.0).sum()]))
    mean = total / n.clamp(min=1)  # no entry (every token out of the loss): 0, not NaN
    return mean, all_ranks_sum(torch.where(mask, (x - mean) ** 2, 0.0).sum()) / (n - 1).clamp(min=1)


class PolicyAndValue(torch.nn.Module):
    """The trained models as one module (DDP averages their gradients in one pass; no V: π)."""

    def __init__(self, policy, value_model, fused_head=False):
        super().__init__()
        self.policy, self.value_model, self.fused_head = policy, value_model, fused_head

    def forward(self, query_responses, attention_mask, context_length, temperature):  # (B, R) x 3
        head = self.policy.get_output_embeddings() if self.fused_head else None
        logprobs, entropy = response_logprobs(self.policy, query_responses, attention_mask,
                                              context_length, temperature, head)  # log π_θ, H
        values = None if self.value_model is None else state_values(  # V(s_t)
            self.value_model, query_responses, attention_mask, context_length)
        return logprobs, entropy, values  # values None: a value-free advantage estimator


def wrap_for_training(models, args, rt):
    """Policy and value as one PolicyAndValue; under torchrun DDP or FSDP2."""
    trained = [m for m in (models.policy, models.value_model) if m is not None]
    for model in trained if args.gradient_checkpointing else []:
        enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.24
        (enable or model.gradient_checkpointing_enable)({"use_reentrant": False})
    model = PolicyAndValue(models.policy, models.value_model,
                           fused_head=models.policy_head is not None)
    if rt.fsdp:  # --shard_frozen_models: the frozen models too, but LoRA's reference is the policy
        frozen = [m for m in (models.ref_policy, *[rm for rm, _ in models.reward_models])
                  if args.shard_frozen_models and m not in (None, models.policy)]
        for module in [m for m in trained + frozen if not fsdp_units(m)]:  # not loaded sharded
            shard(module, module in frozen, rt)
    elif rt.torchrun:
        ddp = torch.nn.parallel.DistributedDataParallel
        new = "forward_sync_buffers" in inspect.signature(ddp).parameters
        no_buffer_sync = {"forward_sync_buffers" if new else "broadcast_buffers": False}  # fixed
        model = ddp(model, device_ids=[rt.device.index] if rt.device.type == "cuda" else None,
                    **no_buffer_sync)
    return model


def shard(model, frozen=False, rt=Runtime()):
    """FSDP2: a unit per decoder block, then the root (a frozen one reshards after forward);
    under bf16 gathered in bf16, gradients reduced in fp32 (the shards, and AdamW, stay in their
    dtype)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    kw = dict(mp_policy=MixedPrecisionPolicy(param_dtype=rt.low_dtype, reduce_dtype=torch.float32))
    for module in model.modules():
        if type(module).__name__ in (model._no_split_modules or ()):
            fully_shard(module, **kw)
    for root in [backbone(model), model.score] if hasattr(model, "score") else [model]:
        fully_shard(root, reshard_after_forward=frozen or None, **kw)


def load_into_shards(cls, path, flag, config, dtype, rt, frozen):
    """FSDP2: build on the meta device, shard, read each rank's slices of the safetensors files. ->
    (model, missing and unused keys), or None: loaded whole, as in one process (said in one
    line)."""
    from glob import glob
    from safetensors import safe_open
    from torch.distributed.checkpoint import HuggingFaceStorageReader, load
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         set_model_state_dict)
    folder, stored = os.path.expanduser(path), set()
    for file in glob(os.path.join(folder, "*.safetensors")):
        with safe_open(file, "pt") as f:
            stored.update(f.keys())
    # parameters on the meta device as they are made (no memory, no init), buffers real: RoPE's
    # inv_freq is in no checkpoint; a tied weight is registered twice, the second time on meta
    with torch.nn.modules.module.register_module_parameter_registration_hook(
            lambda module, name, p: p if p.is_meta else torch.nn.Parameter(p.to("meta"),
                                                                            p.requires_grad)):
        model = cls.from_config(config, dtype=dtype)
    wanted = model.state_dict().keys() - tied_aliases(model)  # a tied weight is stored once
    missing = {k for k in wanted - stored if k.startswith("score.")}  # a new head: initialised
    if not stored or wanted - stored - missing:  # said once, by rank 0
        return rt.rank == 0 and say(f"note: --{flag} {path!r}: not a folder of safetensors files "
                                    "with every weight, so each rank loads it whole and shards it")
    buffers = {k: b.clone() for k, b in model.named_buffers()}  # to_empty() leaves them empty
    shard(model, frozen, rt)
    model.to_empty(device=rt.device)
    for key, buffer in buffers.items():  # on the device, where the inputs are
        model.get_buffer(key).data = buffer.to(rt.device)
    load({k: v for k, v in get_model_state_dict(model).items() if k in wanted - missing},
         storage_reader=HuggingFaceStorageReader(folder))  # into this rank's shards, by name
    if missing:  # a whole head on every rank (the same seed), then its shard
        score = model.score
        head = torch.nn.Linear(score.in_features, score.out_features, score.bias is not None,
                               device="meta")  # no random numbers; then as from_pretrained does
        model._init_weights(head.to_empty(device="cpu"))
        set_model_state_dict(model, {f"score.{k}": v for k, v in head.state_dict().items()},
                             options=StateDictOptions(full_state_dict=True, strict=False))
    # stop ids and sampling settings, read as from_pretrained reads them: every save writes them
    if model.can_generate() and os.path.isfile(os.path.join(folder, "generation_config.json")):
        model.generation_config = transformers.GenerationConfig.from_pretrained(folder)
    return model, {"missing_keys": missing, "unexpected_keys": stored - wanted}


@contextmanager
def gathered(model, enabled):
    """FSDP2: gather a model's weights once for many forwards, then free them."""
    units = fsdp_units(model) if enabled else []
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:  # back to FSDP2's defaults
            unit.reshard()
            unit.set_reshard_after_forward(unit is not model, recurse=False)


@contextmanager
def gradient_sync(model, sync):
    """Reduce gradients over ranks in this backward only if `sync` (DDP: no_sync; FSDP2: a flag)."""
    for unit in fsdp_units(model):
        unit.set_requires_gradient_sync(sync, recurse=False)
    with nullcontext() if sync or not hasattr(model, "no_sync") else model.no_sync():
        yield


# ------------------------------ memory-efficient log-probs (systems: a first reading may skip this)
def last_hidden(model, input_ids, attention_mask, keep):
    """A causal LM's last hidden states (B, keep, H): its own forward with an identity output layer
    (not the backbone's: under FSDP2 the root unit's all-gather then holds that layer for the
    chunks)."""
    head = model.get_output_embeddings()
    model.set_output_embeddings(torch.nn.Identity())
    try:
        return forward(model, input_ids, attention_mask, keep)
    finally:
        model.set_output_embeddings(head)


def chunked_logprobs(x, tokens, temperature=1.0, head=None):
    """token_logprobs by chunks of rows, recomputed in backward: no whole (B·T, V)."""
    n = logprobs_chunk_rows(x.shape[-1] if head is None else head.out_features)

    def chunk(x, tokens):
        return token_logprobs(x if head is None else head(x), tokens, temperature)
    parts = [torch.utils.checkpoint.checkpoint(chunk, x_rows, token_rows, use_reentrant=False)
             for x_rows, token_rows in zip(x.flatten(0, 1).split(n), tokens.flatten().split(n))]
    return tuple(torch.cat(values).view(tokens.shape) for values in zip(*parts))


def output_layer(model):
    """The output layer if the logits are exactly it on the last hidden state, else None."""
    transforms = ("final_logit_softcapping", "logit_scale", "logits_scaling")  # config keys
    head, config = model.get_output_embeddings(), model.config.get_text_config()
    if not isinstance(head, torch.nn.Linear) or any(getattr(config, k, None) not in (None, 1)
                                                    for k in transforms):
        return None  # Gemma-2/3's soft cap, Cohere's and Granite's scales; a probe finds the others
    ids = torch.arange(1, 5, device=head.weight.device)[None] % head.out_features
    mask = torch.ones_like(ids, dtype=torch.bool)
    with (torch.no_grad(), torch.autocast(ids.device.type, enabled=False),  # x 100: a cap shows
          head.register_forward_hook(lambda module, inputs, output: output * 100)):
        logits = forward(model, ids, mask, 4)
        fits = torch.allclose(head(last_hidden(model, ids, mask, 4)), logits, rtol=1e-4, atol=1e-5)
    for unit in fsdp_units(model):  # FSDP2: a root stays whole
        unit.reshard()
    return head if fits else None


# ---------------- LoRA (peft): one block a fork can delete (systems: a first reading may skip this)
def add_lora(model, args, modules_to_save=None):
    """peft LoRA adapters on attention and MLP layers: only they (and modules_to_save) train."""
    import peft  # check_inputs found it
    config = peft.LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                             target_modules=args.lora_target_modules or "all-linear",
                             modules_to_save=modules_to_save)
    with flag_errors(f"--lora_target_modules {args.lora_target_modules}"), quietly():
        model = peft.get_peft_model(model, config)  # (modules not found)
    for p in model.parameters():  # fp32 master weights
        if p.requires_grad:
            p.data = p.data.float()
    return model


@contextmanager
def quietly():
    """Warnings off (peft's notices)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# ------------------------- checkpoints, resume and signals (systems: a first reading may skip this)
# Run-only fields: how a run is launched, stored or watched, not what it learns (beyond rounding:
# --distributed, --shard_frozen_models; --eval_temperature: eval/). A resume may change only these.
RUN_ONLY_FIELDS = set("""exp_name output_dir track wandb_project_name num_sample_generations
    save_every save_total_limit resume export_checkpoint distributed shard_frozen_models
    rollout_unshard dist_timeout_s eval_temperature eval_on_start health_window
    save_dtype""".split())
CHECKPOINT_FORMAT = 5  # of state.pt (5: replay keeps phase 4's output); 3, 4 are still exported
DAMAGED = (OSError, RuntimeError, KeyError, EOFError, pickle.UnpicklingError)  # a checkpoint read
STOP_SIGNALS = []  # (signal, time), appended by request_stop; checkpoint() reads it


def full_state_dict(model, dtypes=None):
    """Full state of a plain, DDP or FSDP2 model on rank 0's CPU: a collective, a tensor at a time.
    dtypes {"policy": bf16, ...}: FSDP2's shards are cast first, so the gather moves (and rank 0
    holds) the saved dtype."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    state, first = {}, not in_process_group() or dist.get_rank() == 0
    for key, value in get_model_state_dict(model).items():  # this rank's shards under FSDP2
        if value.is_floating_point():
            value = value.to((dtypes or {}).get(key.split(".")[0], value.dtype))
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        if first:
            state[key] = value.cpu()
    return state


def save_final(model, models, args, output_dir, rt, num_updates):
    """The trained models as from_pretrained folders in --save_dtype, then complete.json."""
    dtypes = dict.fromkeys(models.base_paths, DTYPES[args.save_dtype])  # no value model: no entry
    weights = full_state_dict(model, None if args.lora_r else dtypes)
    written = defaultdict(list)  # dtype -> what
    if rt.rank:  # after the collective, rank 0 writes
        return ""
    for name, dtype in dtypes.items():
        part = getattr(models, name)
        label, folder = name.replace("_", " "), os.path.join(output_dir, name)
        state = {k.removeprefix(f"{name}."): v for k, v in weights.items()
                 if k.startswith(f"{name}.")}
        base = models.base_paths[name] or os.path.abspath(folder + "_base")  # a LoRA adapter's
        if args.lora_r and not models.base_paths[name]:  # its weights: peft's names, no adapters
            base_state = {re.sub(r"^base_model\.model\.|\.base_layer|\.original_module", "", k): v
                          for k, v in state.items()
                          if not re.search(r"\.lora_|\.modules_to_save\.", k)}
            with save_folder(base) as tmp:
                save_weights(part.get_base_model(), tmp, base_state, dtype)
            written[dtype].append(f"{label} base")
        with save_folder(folder) as tmp:
            if args.lora_r:  # quietly: peft notes that it saves tied embeddings
                part.peft_config["default"].base_model_name_or_path = base
                with quietly():
                    part.save_pretrained(tmp, state_dict=state)
                written[torch.float32].append(f"{label} adapter")
            else:
                save_weights(part, tmp, state, dtype)
                written[dtype].append(label)
            models.tokenizer.save_pretrained(tmp)
    names = {v: k for k, v in DTYPES.items()}  # fp32, bf16, fp16
    saved = ", ".join(f"{' and '.join(w)} ({names[d]})" for d, w in written.items())
    with open(os.path.join(output_dir, "complete.json"), "w") as f:  # after the models (run_folder)
        json.dump({"updates": num_updates, "saved": saved}, f)
    return saved


def save_weights(model, folder, state, dtype):
    """save_pretrained(folder), the float tensors of `state` in dtype; its config.json says so."""
    tied = tied_aliases(model)
    state = {k: v.to(dtype) if v.is_floating_point() else v
             for k, v in state.items() if k not in tied}
    model.save_pretrained(folder, state_dict=state)  # copies share no storage: tied kept once
    model.config.dtype = dtype  # save_pretrained wrote the in-memory one
    model.config.save_pretrained(folder)


def tied_aliases(model):
    """The second names of tied weights (lm_head.weight where it is the input embedding)."""
    every = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    return every - dict(model.named_parameters()).keys()


@contextmanager
def save_folder(path, all_ranks=False):
    """Yields path.tmp to write into (all_ranks: every rank writes), then swaps it in: a crash never
    leaves a half-written one."""
    first = not all_ranks or dist.get_rank() == 0  # makes and swaps the folder
    tmp = path + ".tmp"
    if first:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    if all_ranks:
        dist.barrier()
    yield tmp
    if all_ranks:
        dist.barrier()  # every rank's files are written
    if first:
        if os.path.exists(path):
            os.replace(path, path + ".old")
        os.replace(tmp, path)
        shutil.rmtree(path + ".old", ignore_errors=True)


def list_checkpoints(output_dir):
    """Complete checkpoint folders in output_dir, oldest first (.tmp, .old: a save interrupted)."""
    return sorted(os.path.join(output_dir, d) for d in os.listdir(output_dir)
                  if d.startswith("checkpoint-") and not d.endswith((".tmp", ".old")))


def trained_state(model, optimizer, args):
    """DCP's state: this rank's shards of weights and AdamW state (LoRA: what trains)"""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    weights, optimizer_state = get_state_dict(model, optimizer)
    if args.lora_r:
        inner = getattr(model, "module", model)  # DDP
        weights = {n: weights[n] for n, p in inner.named_parameters() if p.requires_grad}
    return {"model": weights, "optimizer": optimizer_state}


def check_checkpoint(path, args, stop_token_ids, world_size):
    """state.pt (small; weights_only: runs no code) against this run, before weights load. -> it."""
    state = torch.load(os.path.join(path, "state.pt"), weights_only=True, mmap=True)
    found = state.get("format")
    if found == 4 and not state["config"]["replay_rounds"]:  # 5 differs only in replay's buffer
        found = CHECKPOINT_FORMAT
    export = ("export it (--export_checkpoint --resume FOLDER) and start a new run from the "
              "exported policy")
    if found != CHECKPOINT_FORMAT and not (found in (3, 4) and args.export_checkpoint):  # weights
        fail(f"--resume {path!r} was written by another version of ppo_rlhf.py (checkpoint format "
             f"{found}, this one reads {CHECKPOINT_FORMAT}); "
             + (export if found in (3, 4) else "start a new run"))
    stored = state["config"]
    if args.learning_rate is None:  # not given: the run's (before 1e-6 was the default, 1e-3)
        args.learning_rate = stored["learning_rate"]
    changed = [f"--{k} ({stored.get(k)} → {v})" for k, v in asdict(args).items()
               if stored.get(k) != v and k not in RUN_ONLY_FIELDS | {"stop_token", "stop_token_id"}]
    if changed:  # stop ids: below
        fail(f"--resume {path!r} was written with other values of {', '.join(changed)}; resume "
             f"with the stored values, or {export}")
    then = state["stop_token_ids"]
    if then != stop_token_ids:  # however the flags or generation_config name them
        give = f"--stop_token_id {' '.join(map(str, then))}" if then else "--stop_token None"
        fail(f"--resume {path!r} ended responses at stop ids {then}, this run at {stop_token_ids}: "
             f"give {give}")
    if state["world_size"] != world_size and not args.export_checkpoint:  # another prompt stream
        fail(f"--resume {path!r} was written by {state['world_size']} processes; run it with as "
             "many (torchrun --nproc_per_node)")
    return state


def resume(output_dir, model, optimizer, lr_scheduler, scaler, args, rt, models, log):
    """--resume: every rank restores the newest checkpoint that loads; logs are cut back to it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
    # the loop's state besides the weights: non-finite streak, β, score moments (count, mean, M2)
    progress = dict(bad_updates=0, kl_coef=args.kl_coef, score_moments=(0, 0.0, 0.0))
    if args.replay_rounds:  # the last N batches
        progress["replay"] = []
    if not args.resume:
        return 0, progress
    logs = [f"{output_dir}/{f}" for f in ("metrics.jsonl", "samples.jsonl") if rt.rank == 0]
    # rank 0's view of the folder decides, so every rank tries the same checkpoints in order
    candidates = all_ranks_objects(resume_candidates(args, output_dir))[0]
    start_update = 0
    for path in candidates:
        try:
            state = check_checkpoint(path, args, models.stop_token_ids, rt.world_size)
            progress = {key: state[key] for key in progress if key != "replay"}
            if args.replay_rounds and not args.export_checkpoint:  # its replay buffer; export: none
                file, error = f"replay-rank{rt.rank}.pt", None
                try:
                    progress["replay"] = torch.load(os.path.join(path, file), weights_only=True,
                                                    map_location=rt.device)
                except DAMAGED as e:
                    error = f"{file}: {(str(e).strip().splitlines() or [repr(e)])[0]}"
                failed = list(filter(None, all_ranks_objects(error)))  # all ranks skip it, or none
                if failed:
                    raise OSError(failed[0])  # damaged: an older one is tried
            trained = trained_state(model, optimizer, args)
            with quietly():  # its shards
                dcp.load(trained, checkpoint_id=path, no_dist=not rt.torchrun)
            set_state_dict(model, optimizer, options=StateDictOptions(strict=not args.lora_r),
                           model_state_dict=trained["model"], optim_state_dict=trained["optimizer"])
            lr_scheduler.load_state_dict(state["lr_scheduler"])
            scaler.load_state_dict(state["scaler"])
            start_update = state["update"]
            log.print(f"resumed from {path} after update {start_update}")
            break
        except (*DAMAGED, dcp.CheckpointException) as e:  # the latter a BaseException
            reason = (str(e).strip().splitlines() or [repr(e)])[0]  # OSError(): its name
            if path == candidates[-1]:  # the one named, or the oldest
                fail(f"--resume {path!r} cannot be loaded: {reason}")
            log.print(f"warning: skipping damaged checkpoint {path}: {reason}", file=sys.stderr)
    if not candidates and logs and os.path.exists(logs[0]):  # crashed before its first checkpoint
        stale = f".stale-{int(time.time())}"  # its logs are kept under this suffix, not deleted
        for path in filter(os.path.exists, logs):
            os.replace(path, path + stale)
        log.print(f"--resume auto: {output_dir} has metrics.jsonl but no checkpoint (a crashed "
                  f"run): set aside as metrics.jsonl{stale}, starting over at update 1")
    elif not candidates:  # absolute paths: a requeued job started in another folder looks elsewhere
        looked = args.output_dir or f"runs/{args.exp_name}__{args.seed}__*"
        log.print(f"--resume auto: no checkpoint in {os.path.abspath(looked)}, nothing to resume: "
                  f"starting {os.path.abspath(output_dir)} at update 1")
    if len(set(all_ranks_objects(start_update))) > 1:
        fail(f"--resume: the ranks loaded different checkpoints (this one: update {start_update}); "
             "is --output_dir on a filesystem every node sees?")
    for path in filter(os.path.exists, logs):  # no duplicate line, no gap
        with open(path) as f, open(path + ".tmp", "w") as g:
            kept = [ln for ln in f if ln.strip() and json.loads(ln)["update"] <= start_update]
            g.writelines(kept)
        os.replace(path + ".tmp", path)
        for m in map(json.loads, kept if path == logs[0] else []):  # the hints, as they were
            if m["update"]:  # not the evaluation before training
                log.hints({k: math.nan if v is None else v for k, v in m.items()}, quiet=True)
    return start_update, progress


def resume_candidates(args, output_dir):
    """The checkpoints --resume names, in the order resume() tries them: with auto, newest first."""
    if args.resume != "auto":
        return [args.resume] if args.resume else []
    return list_checkpoints(output_dir)[::-1] if os.path.isdir(output_dir) else []


def run_folder(args, rt):
    """--output_dir as rank 0 sees it, by default runs/<exp_name>__<seed>__<unix time> (--resume
    auto: the newest with a checkpoint or complete); None if --resume auto finds a complete run."""
    prefix, marker = f"{args.exp_name}__{args.seed}__", None
    output_dir = args.output_dir or f"runs/{prefix}{int(time.time())}"
    if args.resume == "auto" and not args.output_dir and os.path.isdir("runs"):
        runs = [d for d in os.listdir("runs") if d.startswith(prefix) and d[len(prefix):].isdigit()
                and os.path.isdir(f"runs/{d}")
                and (list_checkpoints(f"runs/{d}") or os.path.isfile(f"runs/{d}/complete.json"))]
        if runs:  # stopped, or finished: says so
            output_dir = f"runs/{max(runs, key=lambda d: int(d.removeprefix(prefix)))}"
    if args.resume == "auto" and os.path.isfile(f"{output_dir}/complete.json"):
        with open(f"{output_dir}/complete.json") as f:
            marker = json.load(f)
    output_dir, marker = all_ranks_objects((output_dir, marker))[0]  # rank 0's
    if marker and rt.rank == 0:
        say(f"--resume auto: {output_dir} holds a complete run of {marker['updates']} updates, "
            f"nothing to resume; saved there: {marker['saved']}")
    return None if marker else output_dir


def checkpoint(output_dir, update, progress, model, optimizer, lr_scheduler, scaler, args, rt,
               models, log, failing=False):
    """All a run needs: every --save_every updates, on a signal, or failing (a reward source's after
    update 1, in agreed()). -> whether to stop; failing: the error line's end, how to go on."""
    stop = any(all_ranks_objects(bool(STOP_SIGNALS)))  # a signal reached any rank
    if not (stop or failing or args.save_every and update % args.save_every == 0):
        return False
    import torch.distributed.checkpoint as dcp
    state = dict(update=update, **progress, lr_scheduler=lr_scheduler.state_dict(),
                 scaler=scaler.state_dict(), world_size=rt.world_size,
                 config={k: v for k, v in asdict(args).items() if k not in RUN_ONLY_FIELDS},
                 stop_token_ids=models.stop_token_ids, format=CHECKPOINT_FORMAT)
    replay = state.pop("replay", None)
    files = {"state.pt": state} if rt.rank == 0 else {}  # the rest, small
    if replay is not None:  # each rank its own buffer, which a resume reads back
        files[f"replay-rank{rt.rank}.pt"] = [{k: v.cpu() if torch.is_tensor(v) else v
                                              for k, v in b.items()} for b in replay]
    path = os.path.join(output_dir, f"checkpoint-{update:06d}")
    with save_folder(path, rt.torchrun) as tmp:  # weights, AdamW: each rank its shards (DCP)
        with quietly():
            dcp.save(trained_state(model, optimizer, args), checkpoint_id=tmp,
                     no_dist=not rt.torchrun)
        for name, value in files.items():  # on disk before the folder is swapped in
            file = os.path.join(tmp, name)
            torch.save(value, file)
            with open(file, "rb") as f:
                os.fsync(f.fileno())
    if rt.rank == 0:
        for old in list_checkpoints(output_dir)[:-args.save_total_limit]:
            shutil.rmtree(old)
    if rt.torchrun:
        dist.barrier()  # wait for the write here
    line = (f"saved {path}; continue with the same flags plus: --output_dir {output_dir} "
            "--resume auto")  # how to go on
    if stop:
        log.print(line)  # in the run folder too: a `| tee` dies with the Ctrl-C
        log.stopped(f"stopped by a signal after update {update}\n{line}")
    return f"; {line}" if failing else stop


def request_stop(signum, frame):
    """SIGINT/SIGTERM/SIGHUP: finish this update, save a checkpoint, exit 0."""
    if STOP_SIGNALS:  # within 1 s: the same one twice (Ctrl-C under torchrun reaches a rank twice)
        if time.monotonic() - STOP_SIGNALS[0][1] > 1.0:  # a later one exits at once
            os._exit(128 + signum)
        return
    STOP_SIGNALS.append((signum, time.monotonic()))
    if os.environ.get("RANK", "0") == "0":  # under torchrun every rank gets the signal; one notice
        say(f"\n{signal.Signals(signum).name}: finishing this update, then saving a checkpoint (a "
            "second Ctrl-C stops at once, losing this update)", file=sys.stderr)


# ------------------------------------- logging and metrics (systems: a first reading may skip this)
def json_line(metrics):
    """One line of strict JSON: a non-finite value (0/0 explained variance) is written as null."""
    return json.dumps({k: v if not isinstance(v, float) or math.isfinite(v) else None
                       for k, v in metrics.items()}, allow_nan=False) + "\n"


def say(line, file=None):
    """print, flushed; a dead reader (EPIPE, EIO) must not end a run: its fd goes to devnull."""
    try:
        print(line, file=file, flush=True)
    except OSError:  # what is still buffered goes there too: Python's flush at exit cannot fail
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, (file or sys.stdout).fileno())  # sys.stdout now, not at import
        os.close(devnull)


def masked_var(x, mask):
    """Unbiased variance of the real entries."""
    n = mask.sum()
    return masked_mean((x - masked_mean(x, mask)) ** 2, mask) * n / (n - 1).clamp(min=1)  # 1: 0


def ratio_stats(tokens, mask):
    """The loss's token statistics as means over the real tokens, a response's (b, 1) over the
    responses, under TRL's names (the approx KL: ppo_epochs', per minibatch)."""
    names = {"clipped": "policy/clipfrac_avg", "ratio": "val/ratio",
             "outside": "policy/ratio_outside_clip_avg", "dual_clipped": "policy/dual_clipfrac_avg",
             "off_policy_masked": "policy/off_policy_masked_frac", "phi": "vespo/phi_seq_mean",
             "entropy_masked": "policy/entropy_masked_frac"}
    ratio = tokens["ratio"]
    stats = {names[k]: masked_mean(x.to(ratio.dtype), mask) if x.shape[1] > 1 else
             masked_mean(x[:, 0].to(ratio.dtype), mask.any(1))
             for k, x in tokens.items() if k in names and x is not None}
    stats["val/ratio_var"] = masked_var(ratio, mask)
    return stats


@torch.no_grad()
def update_stats(stats, mb, entropy, losses, tokens):
    """Append a micro-batch's losses, entropy and ratio statistics to `stats`."""
    mask = mb["response_mask"]
    named = {**losses, **ratio_stats(tokens, mask),
             "policy/entropy_avg": masked_mean(entropy, mask)}
    if "age" in mb:  # replay: token counts of fresh and replayed tokens apart (replay_stats)
        fresh = mask & (mb["age"] == 0)[:, None]
        replayed = mask & ~fresh
        named.update({"replay/fresh": fresh, "replay/replayed": replayed,
                      "replay/clipped_replayed": tokens["clipped"] & replayed,
                      **{f"replay/{k}_fresh": torch.where(fresh, tokens[k], 0.0)
                         for k in ("clipped", "outside", "ratio", "approxkl")}})
    for key, value in named.items():  # Σ: the counts; a scalar itself, made under no_grad: detached
        stats[key].append(value.sum().float())


def reward_model_spread(source_scores, num_reward_models):
    """The reward models' disagreement per response (B,): the std of their scores."""
    return source_scores[:, :num_reward_models].std(1, correction=0)


def explained_variance(residual_var, returns_var):
    """1 − Var[R − V] / Var[R]: 1 is a perfect value function, 0 no better than a constant."""
    return 1 - residual_var / returns_var


def update_metrics(batch, trained, models, args, rt):
    """One update's metrics (TRL's names, over all ranks); [tokens rolled out, scored, trained]."""
    mask, kl, scores = batch["response_mask"], batch["kl"].sum(1), batch["scores"]  # kl: (B,)
    returns, non_score = batch["returns"], batch["penalties"].sum(1)  # Σ_t p_t: as applied
    scored_mean = lambda x: x[batch["scored"]].mean().nan_to_num()  # noqa: E731  scored rows
    kl_loss = batch["kl_coef"] * kl if args.kl_in == "loss" else 0.0  # the KL not in r_t
    stats = trained.stats  # replay's token counts apart (replay_stats)
    averaged = {"objective/entropy": (-batch["logprobs"]).sum(1).mean(),
                "objective/non_score_reward": non_score.mean(),
                "objective/rlhf_reward": scored_mean(scores + non_score - kl_loss),
                "objective/scores": scored_mean(scores),
                "objective/raw_scores": scored_mean(batch["raw_scores"]),
                "val/mean_response_length": batch["lengths"].float().mean(),
                "val/truncated_frac": batch["truncated"].float().mean(),
                **{k: torch.stack(v).mean() for k, v in stats.items() if "replay/" not in k},
                "policy/epochs": trained.optimizer_steps / trained.steps_per_epoch}
    if models.ref_policy is not None:  # --kl_coef 0 loads none
        averaged["objective/kl"] = kl.mean()
    if models.value_model is not None:
        averaged["val/explained_variance"] = explained_variance(
            *[global_mean_var(x, mask)[1] for x in (returns - batch["values"], returns)])
    if args.num_generations > 1:  # groups whose scores carry no signal: the filter's rule
        averaged["objective/frac_reward_zero_std"] = equal_score_groups(
            scores, args.num_generations).float().mean()
    if stats:  # must be 1 and 0 (fresh tokens: replay_stats)
        averaged["policy/first_ratio"] = stats["val/ratio"][0]
        averaged["policy/first_approxkl"] = stats["policy/approxkl_avg"][0]
    if rt.low_dtype:  # the sampler's μ against π_old as score() recomputes it: w = π_old/μ
        mu, old = batch["sampler_logprobs"], batch["logprobs"]
        averaged["rollout/mismatch_kl"] = masked_mean(kl_estimate(mu, old, "k3"), mask)  # KL(μ‖π)
        averaged["rollout/mismatch_outside_frac"] = masked_mean(
            ((old - mu).exp() - 1).abs() > 0.1, mask)
    if models.builtin_reward:  # the built-in task: the share of answers that score 1
        averaged["objective/success_rate"] = (batch["raw_scores"] == 1).float().mean()
    num_rms, source_scores = len(models.reward_models), batch["source_scores"]  # RMs first
    sources = [os.path.basename(os.path.normpath(path)) for path in args.reward_model_path or []]
    sources += [fn.__name__ for fn, _, _ in models.reward_fns]  # TRL's names; _i where two clash
    sources = [f"{name}_{i}" if sources.count(name) > 1 else name for i, name in enumerate(sources)]
    if len(sources) > 1:  # each source's mean raw score, over the rows it scored
        averaged.update({f"objective/raw_scores/{name}": x.nanmean()
                         for name, x in zip(sources, source_scores.T)})
    if num_rms > 1:  # the reward models' disagreement, mean over responses
        averaged["objective/rm_spread"] = reward_model_spread(source_scores, num_rms).mean()
    values = [torch.as_tensor(v, dtype=torch.float64, device=rt.device) for v in [
        *averaged.values(), (~batch["truncated"]).sum(),  # the means; EOS tokens; the tokens
        mask.sum(), batch["attention_mask"].sum(), trained.train_tokens]]  # of each phase
    n = len(averaged)
    values = all_ranks_sum(torch.stack(values)).tolist()  # one all-reduce: means, counts
    averaged = {k: v / rt.world_size for k, v in zip(averaged, values)}
    averaged.update({"objective/kl_coef": batch["kl_coef"], "val/num_eos_tokens": values[n]})
    if "replay/fresh" in stats:  # --replay_rounds: fresh tokens apart
        averaged.update(replay_stats(stats, args.gradient_accumulation_steps),
                        **batch["replay_metrics"])
    return averaged, values[n + 1 :]


def replay_stats(stats, micro_batches):
    """Replay's clip shares of fresh and replayed tokens, first ratio and approx KL."""
    keys = ("fresh", "replayed", "clipped_fresh", "clipped_replayed", "outside_fresh",
            "ratio_fresh", "approxkl_fresh")  # Σ over the update, then its first minibatch
    x = [torch.stack(stats[f"replay/{k}"][:n]).sum() for n in (None, micro_batches) for k in keys]
    x = all_ranks_sum(torch.stack(x).double()).tolist()
    t, f = dict(zip(keys, x)), dict(zip(keys, x[len(keys) :]))  # the update, its first minibatch
    share = lambda a, b: a / b if b else math.nan  # noqa: E731
    return {"replay/clipfrac_fresh": share(t["clipped_fresh"], t["fresh"]),
            "replay/clipfrac_replayed": share(t["clipped_replayed"], t["replayed"]),
            "replay/outside_clip_fresh": share(t["outside_fresh"], t["fresh"]),
            "policy/first_ratio": share(f["ratio_fresh"], f["fresh"]),
            "policy/first_approxkl": share(f["approxkl_fresh"], f["fresh"])}


def health_hints(window, args, has_stop_token):
    """Signs of trouble in the last updates' metrics -> {hint: a line naming the flag}: one row each
    (when, what), on the last update, or on a full window of 2 or more (its halves' means)."""
    if not window:  # --health_window 0
        return {}
    last, n = window[-1], len(window)
    full = n >= max(args.health_window, 2)
    halves = (window[: n // 2], window[n // 2 :])
    kl, score = ([sum(m.get(key, 0.0) for m in h) / max(len(h), 1) for h in halves]
                 for key in ("objective/kl", "objective/scores"))  # older, newer
    outside = last.get("replay/outside_clip_fresh", last.get("policy/ratio_outside_clip_avg", 0.0))
    truncated = [m["val/truncated_frac"] for m in window]
    rows = {"ratio": (outside > 0.5 and args.importance_sampling_level == "token"  # PPO's ε
                      and POLICY_LOSSES[args.policy_loss]["ratio_hint"],
                      f"{outside:.0%} of the importance ratios π_θ/π_old left [1 − ε, 1 + ε_high] "
                      "in this update: the policy moves too far per update; lower --learning_rate "
                      "or --num_ppo_epochs (or set --target_kl)"),
            "kl": (full and "objective/kl" in last and kl[1] > 1.5 * kl[0] and kl[1] - kl[0] > 0.1
                   and score[1] <= score[0],
                   f"the KL to the reference rose from {kl[0]:.2f} to {kl[1]:.2f} over the last "
                   f"{n} updates while the score did not ({score[0]:.3f} -> {score[1]:.3f}): the "
                   "policy drifts without gaining reward (or games it); raise --kl_coef or set "
                   "--adaptive_kl_target, and watch eval/score"),
            "length": (full and has_stop_token and min(truncated) >= 0.9,
                       f"{sum(truncated) / n:.0%} of the responses of the last {n} updates (>= 90% "
                       f"in each) were cut off at --response_length {args.response_length} before "
                       "the stop token: raise --response_length, or penalise it "
                       "(--missing_eos_penalty, --overlong_buffer)")}
    return {name: line for name, (when, line) in rows.items() if when}


def changed_flags(args):
    """The algorithmic flags (not RUN_ONLY_FIELDS) given another value than Args' default, as a
    command line: `--a v --b w` (lists space-separated, booleans --x / --no-x)."""
    default, words = vars(Args()), []
    for name, value in vars(args).items():  # the fields, in their order
        if name in RUN_ONLY_FIELDS or value == default[name]:
            continue
        if isinstance(value, bool):
            words.append(f"--{'' if value else 'no-'}{name}")
        else:
            words += [f"--{name}", *map(str, value if isinstance(value, list) else [value])]
    return " ".join(words) or "(the defaults)"


def described(prompts):
    """'N prompts', with how many over-long ones --overlong_prompts filtered or truncated."""
    cut = [f"{n} over-long {how}"
           for n, how in ((prompts.filtered, "filtered"), (prompts.truncated, "truncated")) if n]
    return f"{len(prompts.texts)} prompts" + (f" ({', '.join(cut)})" if cut else "")


def start_lines(args, sizes, rt, inputs, models, output_dir):
    """What the run trains, on what, where, and the flags that reproduce it (or what it exports)."""
    if args.export_checkpoint:  # no update runs: what it writes, not the training sizes
        names = " and ".join(models.base_paths).replace("_", " ")
        return (f"ppo_rlhf: exporting {args.resume}: {names}, --save_dtype {args.save_dtype}, "
                f"to {output_dir}")
    mode = f"{rt.world_size} processes ({args.distributed}), " if rt.torchrun else ""
    lora, k = "", args.num_generations
    if args.lora_r:  # what trains
        params = [p for m in (models.policy, models.value_model) if m is not None
                  for p in m.parameters()]
        lora = (f"; LoRA r {args.lora_r}: {sum(p.numel() for p in params if p.requires_grad):,}"
                f" of {sum(p.numel() for p in params):,} parameters train")
    what = "prompts" if k == 1 else f"responses to {sizes.batch_size // k} prompts x {k}"
    evaluated = f"eval {described(inputs.eval_prompts)}" if inputs.eval_prompts else "no eval"
    if args.eval_dataset == "auto":  # say what auto chose
        chose = ("the built-in task's held-out sums" if inputs.eval_prompts else
                 "none for one's own --dataset")
        evaluated += f" (--eval_dataset auto: {chose})"
    head = " with a new score head" if getattr(models.value_model, "new_head", False) else ""
    return (f"ppo_rlhf: {sizes.num_updates} updates of {sizes.batch_size} {what} ({mode}"
            f"{sizes.local_batch_size} per device, {args.num_mini_batches} minibatches of "
            f"{sizes.local_mini_batch_size}, micro-batches of {sizes.micro_batch_size}), "
            f"{described(inputs.prompts)}, {evaluated}, device {rt.device}, {args.dtype}, "
            f"lr {args.learning_rate:g} ({inputs.lr_source}), "
            f"stop ids {models.stop_token_ids or 'none'}, output {output_dir}; "
            f"{models.value_source}{head}{lora}\nflags: {sizes.flags}")


# The update line: a column for each of these metrics the run has: name, metrics.jsonl key, format.
COLUMNS = [line.split() for line in """success objective/success_rate 4.0%
    score objective/scores .3f
    kl objective/kl .3f
    approxkl policy/approxkl_avg .4f
    clipfrac policy/clipfrac_avg .3f
    masked policy/off_policy_masked_frac .3f
    zero_std objective/frac_reward_zero_std .2f
    vloss loss/value_avg .4f
    ev val/explained_variance .2f
    len val/mean_response_length .1f
    rm_spread objective/rm_spread .3f""".splitlines()]  # clipfrac: whatever the loss clips or caps


class Logger:
    """Rank 0's lines on stdout, hints on stderr, metrics.jsonl, samples.jsonl (wandb: --track),
    and the run folder's note of how the run ended (stopped.txt)."""

    def __init__(self, args, output_dir, sizes, rt, inputs, models):
        self.args, self.sizes, self.rt, self.output_dir = args, sizes, rt, output_dir
        self.print = say if rt.rank == 0 else lambda line, file=None: None
        self.wandb = rt.rank == 0 and args.track and importlib.import_module("wandb")  # importable
        self.made = rt.rank == 0 and not os.path.exists(output_dir)  # ending() may remove it
        if rt.rank == 0:
            os.makedirs(output_dir, exist_ok=True)
        if self.wandb:
            self.wandb.init(project=args.wandb_project_name, name=os.path.basename(output_dir),
                            config=asdict(args))
        self.print(start_lines(args, sizes, rt, inputs, models, output_dir))
        n, updates = args.num_sample_generations, sizes.num_updates  # evaluated after these
        self.evaluated = {updates - 1, *(range(0, updates, max(1, updates // n)) if n else ())}
        self.last, self.logged, self.start_time = None, 0, time.time()
        self.window, self.quiet_until = deque(maxlen=args.health_window), {}  # {hint: update}
        self.has_stop_token = bool(models.stop_token_ids)

    def start_update(self):
        self.start, self.laps = time.perf_counter(), {}

    def lap(self, name):
        """Seconds of the phase `name`: since the previous lap, or the update's start."""
        self.laps[f"time/{name}_s"] = time.perf_counter() - self.start - sum(self.laps.values())

    def count_bad_updates(self, progress, stop_reason, update):
        """A non-finite loss or gradient skips the update; three in a row stop the run (the streak:
        progress["bad_updates"], checkpointed)."""
        if stop_reason not in ("non-finite loss", "non-finite gradient"):
            progress["bad_updates"] = 0
            return
        self.print(f"warning: update {update + 1}: {stop_reason}; skipped the rest of this update",
                   file=sys.stderr)
        if progress["bad_updates"] >= 2:
            fail("3 updates in a row had a non-finite loss or gradient; lower --learning_rate, "
                 "check the reward scale, or use --dtype fp32")
        progress["bad_updates"] += 1

    def write(self, m, samples):
        """A metrics line into metrics.jsonl, samples into samples.jsonl (whole lines), wandb."""
        for name, objects in (("metrics", [m]), ("samples", samples)):
            if objects and self.rt.rank == 0:
                with open(os.path.join(self.output_dir, f"{name}.jsonl"), "a") as f:
                    f.writelines(map(json_line, objects))
        if self.wandb:  # the evaluation's samples as a table
            tables = {"eval/samples": self.wandb.Table(columns=list(samples[0]), data=[
                list(s.values()) for s in samples])} if samples else {}
            self.wandb.log({**m, **tables}, step=m["update"])

    def evaluation(self, m, samples, before_training=False):
        """The held-out evaluation's line and its first samples (None: no source scored it); one
        before the first update (--eval_on_start) is written as update 0."""
        if before_training:
            self.write({"update": 0, "episode": 0, **m}, samples)
            self.print(f"update 0/{self.sizes.num_updates}  before training")
        success = f"success {m['eval/success_rate']:4.0%}  " if "eval/success_rate" in m else ""
        spread = f"rm_spread {m['eval/rm_spread']:.3f}  " if "eval/rm_spread" in m else ""
        self.print(f"  eval {success}score {m['eval/score']:.3f}  len "
                   f"{m['eval/response_length']:.1f}  {spread}(held-out, T = "
                   f"{self.args.eval_temperature:g})")
        for s in samples[:3]:
            score = "None" if s["score"] is None else f"{s['score']:.2f}"
            self.print(f"    {s['prompt']!r} -> {s['completion']!r}  score {score}")

    def update(self, update, lr, metrics, token_counts, batch, prompts, rows, samples):
        """One update into metrics.jsonl, its samples into samples.jsonl; its lines."""
        t, update, elapsed = self.laps, update + 1, time.time() - self.start_time
        self.logged += 1
        peak_memory = (torch.cuda.max_memory_allocated() / 2**20 if self.rt.device.type == "cuda"
                       else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10)  # KiB
        m = self.last = {
            "update": update, "episode": update * self.sizes.batch_size, "lr": lr, **metrics,
            "eps": self.logged * self.sizes.batch_size / elapsed,
            "time/update_s": time.perf_counter() - self.start, **t,
            **{f"time/{lap}_tokens_per_s": n / max(t[f"time/{lap}_s"], 1e-9)
               for lap, n in zip(("generate", "score", "train"), token_counts)},
            "memory/peak_mib": peak_memory}
        self.write(m, samples)
        hms = lambda s: time.strftime("%H:%M:%S", time.gmtime(s))  # noqa: E731
        columns = "".join(f"{name} {m[key]:{fmt}}  " for name, key, fmt in COLUMNS if key in m)
        self.print(f"update {update}/{self.sizes.num_updates}  {columns}| "
                   f"{m['time/update_s']:.2f}s: generate {t['time/generate_s']:.2f}  score "
                   f"{t['time/score_s']:.2f}  train {t['time/train_s']:.2f}  | {peak_memory:.0f} "
                   f"MiB  | {hms(elapsed)}, eta "
                   f"{hms(elapsed / self.logged * (self.sizes.num_updates - update))}")
        self.hints(m)
        if self.args.num_sample_generations and update - 1 in self.evaluated:  # as it evaluates
            shown = list(zip(rows, batch["completions"], batch["scores"].tolist()))
            for r, c, s in shown[:: self.args.num_generations][:3]:  # one response per prompt
                self.print(f"    {prompts.texts[r]!r} -> {c!r}  score {s:.2f}")
        if samples:
            self.evaluation(m, samples)

    def hints(self, m, quiet=False):
        """The health hints of the window that ends at m (quiet: a resume's, rebuilt unsaid), each
        at most once per window."""
        self.window.append(m)  # stays empty with --health_window 0
        for name, hint in health_hints(list(self.window), self.args, self.has_stop_token).items():
            if m["update"] >= self.quiet_until.get(name, 0):
                self.quiet_until[name] = m["update"] + self.args.health_window
                if not quiet:
                    self.print(f"hint: update {m['update']}: {hint}", file=sys.stderr)

    @contextmanager
    def ending(self):
        """The run folder says how the run ended: a stop that is not completion writes stopped.txt
        (why, and how to go on where a checkpoint is); a run that ends before its first update's
        line removes the folder it made."""
        try:
            yield
        except BaseException as e:  # fail()'s line, a bug's, an interrupt
            if self.made and not self.logged:
                shutil.rmtree(self.output_dir, ignore_errors=True)
            elif self.rt.rank == 0:
                why = str(e) if isinstance(e, SystemExit) else f"error: {one_line(e)}"
                newest = list_checkpoints(self.output_dir)[-1:]
                if newest and "--resume auto" not in why:
                    why += (f"; the newest checkpoint is {newest[0]}: continue with the same flags "
                            f"plus: --output_dir {self.output_dir} --resume auto")
                self.stopped(why)
            raise

    def stopped(self, why):
        """stopped.txt in the run folder: why the run stopped short of its end, how to go on."""
        if self.rt.rank == 0:
            with open(os.path.join(self.output_dir, "stopped.txt"), "w") as f:
                f.write(why + "\n")

    def finish(self, message):
        """The run is complete: its last line; a stopped.txt of an earlier stop goes."""
        self.print(message)
        if self.rt.rank == 0 and os.path.exists(os.path.join(self.output_dir, "stopped.txt")):
            os.remove(os.path.join(self.output_dir, "stopped.txt"))
        if self.wandb:
            self.wandb.finish()


if __name__ == "__main__":
    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    if signal.getsignal(signal.SIGHUP) != signal.SIG_IGN:  # a closed terminal (nohup: ignored)
        signal.signal(signal.SIGHUP, request_stop)
    main(tyro.cli(Args))
    leave_process_group()
