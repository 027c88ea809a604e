"""Tests for ppo_rlhf.py: the math against naive float64 references and closed forms, model-level invariants on
tiny GPT-2 and Llama models saved with save_pretrained and loaded back, and the whole loop end to end. CPU only,
nothing downloaded. Run: pytest -q test_ppo_rlhf.py"""
import contextlib
import dataclasses
import glob
import importlib.util
import inspect
import itertools
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import typing
import warnings
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import tyro
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer,
                          BertConfig, BertForSequenceClassification, GPT2Config, LlamaConfig, PreTrainedTokenizerFast)

import ppo_rlhf as P

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "ppo_rlhf.py")
WORDS = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(37)]


# ---------------------------------------------------------------------------------------- reward functions used by runs
def count_w1(prompts, completions):
    """Rewards completions for each `w1` they contain."""
    return [float(c.split().count("w1")) for c in completions]


def num_words(prompts, completions):
    return [float(len(c.split())) for c in completions]


def words_with_the_prompts(prompts, completions):
    return [float(len(p.split()) + len(c.split())) for p, c in zip(prompts, completions)]


def wrong_count(prompts, completions):
    return [0.0] * (len(completions) - 1)


def nan_score(prompts, completions):
    return [float("nan")] + [0.0] * (len(completions) - 1)


def a_tenth(prompts, completions):
    return [0.1] * len(completions)


def a_tenth_or_none(completion_ids, **kwargs):  # None where the first token's id is a multiple of 3
    return [None if ids[0] % 3 == 0 else 0.1 for ids in completion_ids]


def huge_score(prompts, completions):
    return [1e30 * (i % 2) for i in range(len(completions))]


def log_call(**given):
    """Append what a reward function was given to $REWARD_LOG.<rank> (one JSON line per call)."""
    if os.environ.get("REWARD_LOG"):
        with open(f"{os.environ['REWARD_LOG']}.{os.environ.get('RANK', '0')}", "a") as f:
            f.write(json.dumps(given) + "\n")


def answer_matches(prompts, completions, completion_ids, answer, trainer_state, **kwargs):
    """As TRL calls it: 1 for a completion whose first word is its row's answer."""
    log_call(prompts=prompts, completions=completions, completion_ids=completion_ids, answer=answer, fields=kwargs,
             state=vars(trainer_state))
    return [float(c.split()[:1] == [a]) for c, a in zip(completions, answer)]


def accuracy_reward(completions, solution, **kwargs):
    """The shape of TRL's accuracy_reward: chat completions, the row's `solution`."""
    log_call(prompts=kwargs["prompts"], completions=completions, solution=solution)
    return [float(c[0]["content"].split()[:1] == [s]) for c, s in zip(completions, solution)]


def two_params(p, c):
    """Names none of the arguments (the positional call of old versions is gone): refused before loading."""
    return [0.0] * len(c)


def chat_words(completions, **kwargs):
    """The words of each chat completion (a list of one assistant message)."""
    return [float(len(c[0]["content"].split())) for c in completions]


def none_for_first(completions, **kwargs):
    return [None] + [1.0] * (len(completions) - 1)


def none_for_all(completions, **kwargs):
    return [None] * len(completions)


def none_where_ungradable(completions, answer, **kwargs):
    """TRL's pattern: None where the gold answer cannot be checked (w3, w31: whole groups), and for
    every other response to w5's prompts (part of a group); else the answer's count."""
    return [None if a in ("w3", "w31") or (a == "w5" and i % 2 == 0) else float(c.split().count(a))
            for i, (c, a) in enumerate(zip(completions, answer))]


async def async_count_w1(completions, **kwargs):
    return count_w1(None, completions)


def raises(completions, **kwargs):
    raise ValueError("the grader is down")


def down_at_update_3(completions, trainer_state, **kwargs):
    """count_w1's scores, but at update 3, while $GRADER_DOWN is set, the grader is down."""
    if trainer_state.global_step == 2 and os.environ.get("GRADER_DOWN"):
        raise RuntimeError("the grader is down")
    return count_w1(None, completions)


def fails_on_rank_1(completions, **kwargs):
    if os.environ.get("RANK") == "1":
        raise RuntimeError("rank 1's grader is down")
    return [0.0] * len(completions)


def one_param(x):
    return [0.0] * len(x)


def only_defaults(x=None):
    return [0.0] * 8


def needs_answer(completions, answer):
    return [0.0] * len(completions)


def wants_log_metric(completions, log_metric, **kwargs):
    return [0.0] * len(completions)


# ------------------------------------------------------------------------------------------- tiny models, built offline
def word_tokenizer(words, pad="<pad>", **kwargs):
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=pad, eos_token="<eos>", unk_token="<unk>", **kwargs)


def config(arch, vocab_size, **kwargs):
    shared = dict(vocab_size=vocab_size, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    if arch == "gpt2":
        return GPT2Config(**{**shared, **dict(n_positions=32, n_embd=32, n_layer=2, n_head=2), **kwargs})
    llama = dict(max_position_embeddings=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1)
    return LlamaConfig(**{**shared, **llama, **kwargs})


def save_as_hub(model, path, tokenizer=None, dtype=torch.bfloat16):
    """save_pretrained as the hub stores checkpoints: bf16 safetensors (another dtype where a test needs it)."""
    model.to(dtype).save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return str(path)


CHAT_WORDS = ["<|endoftext|>", "<unk>", "<|im_start|>", "<|im_end|>", "user", "assistant"] + WORDS[3:]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")


def chat_tokenizer():
    """A chat tokenizer as Qwen's: EOS <|endoftext|>, a turn ends in <|im_end|>, no pad token."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(CHAT_WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", unk_token="<unk>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"],
                                   chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """Folders of tiny models and prompt files, stored as the hub stores them (bf16): {gpt2, llama} policies (GPT-2's
    embeddings tied), their reward models, a reward model with a different tokenizer; fp32 copies of the GPT-2 pair;
    a chat model (tied, a tokenizer without pad token, its turn ending in <|im_end|> listed in generation_config.json
    beside EOS) and its chat prompts; prompts (.jsonl, .txt)."""
    root = tmp_path_factory.mktemp("tiny")
    paths = {}
    tokenizer = word_tokenizer(WORDS)
    for i, arch in enumerate(["gpt2", "llama"]):
        torch.manual_seed(i)
        policy = AutoModelForCausalLM.from_config(config(arch, len(WORDS)))
        paths[arch] = save_as_hub(policy, root / arch, tokenizer)
        reward_model = AutoModelForSequenceClassification.from_config(config(arch, len(WORDS), num_labels=1))
        paths[f"{arch}_rm"] = save_as_hub(reward_model, root / f"{arch}_rm", tokenizer)
        if arch == "gpt2":  # the same weights in fp32
            paths["gpt2_fp32"] = save_as_hub(policy, root / "gpt2_fp32", tokenizer, torch.float32)
            paths["gpt2_rm_fp32"] = save_as_hub(reward_model, root / "gpt2_rm_fp32", tokenizer, torch.float32)
    other_words = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in reversed(range(37))] + ["extra"]
    other_rm = AutoModelForSequenceClassification.from_config(config("llama", len(other_words), num_labels=1))
    # same words, other ids: the reward model must re-tokenize the text
    paths["other_rm"] = save_as_hub(other_rm, root / "other_rm", word_tokenizer(other_words, padding_side="left"))
    torch.manual_seed(2)
    chat_config = config("llama", len(CHAT_WORDS), tie_word_embeddings=True, pad_token_id=None, eos_token_id=0,
                         bos_token_id=None)
    chat = AutoModelForCausalLM.from_config(chat_config)
    chat.generation_config.eos_token_id = [3, 0]  # <|im_end|>, <|endoftext|>
    paths["chat"] = save_as_hub(chat, root / "chat", chat_tokenizer())
    paths["chat_prompts"] = str(root / "chat.jsonl")
    with open(paths["chat_prompts"], "w") as f:
        for i in range(12):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"w{i} w{i + 1}"}]}) + "\n")
    paths["prompts"] = str(root / "prompts.jsonl")
    gen = torch.Generator().manual_seed(0)
    with open(paths["prompts"], "w") as f:
        for _ in range(40):
            n = int(torch.randint(2, 7, (1,), generator=gen))
            words = [WORDS[int(t)] for t in torch.randint(3, len(WORDS), (n,), generator=gen)]
            f.write(json.dumps({"prompt": " ".join(words)}) + "\n")
    with open(paths["prompts"]) as f:  # the same prompts with the fields of a verifiable-reward dataset
        rows = [{**json.loads(line), "answer": f"w{i % 7}", **({"note": i} if i % 2 else {})}
                for i, line in enumerate(f)]
    paths["answers"] = str(root / "answers.jsonl")
    with open(paths["answers"], "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    paths["answers_eval"] = str(root / "answers_eval.jsonl")
    with open(paths["answers_eval"], "w") as f:
        f.writelines(json.dumps({"prompt": f"w{i} w{i + 9}", "answer": f"w{30 + i}", "note": -i}) + "\n"
                     for i in range(3))
    paths["chat_solutions"] = str(root / "chat_solutions.jsonl")
    with open(paths["chat_solutions"], "w") as f:  # the last row ends in an assistant turn, which is dropped
        for i in range(8):
            messages = [{"role": "user", "content": f"w{i} w{i + 1}"}]
            messages += [{"role": "assistant", "content": "w9"}] if i == 7 else []
            f.write(json.dumps({"messages": messages, "solution": f"w{i + 2}"}) + "\n")
    paths["txt"] = str(root / "prompts.txt")
    with open(paths["txt"], "w") as f:
        f.write("w1 w2 w3\n\nw4 w5\nw6\n")
    return paths


def run_args(tiny, tmp_path, **overrides):
    kwargs = dict(model_name_or_path=tiny["gpt2"], reward_model_path=[tiny["gpt2_rm"]], dataset=tiny["prompts"],
                  output_dir=str(tmp_path / "run"), total_episodes=16, per_device_train_batch_size=8,
                  num_mini_batches=2, num_ppo_epochs=2, response_length=6, learning_rate=1e-3, num_sample_generations=0)
    kwargs.setdefault("eval_on_start", False)  # these runs' metrics.jsonl start at update 1
    kwargs.update(overrides)
    return P.Args(**kwargs)


def read_lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def checkpoint_state(folder):
    """A checkpoint's weights and AdamW state, written by DCP in shards, as one {"model": ..., "optimizer": ...}."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(folder, os.path.join(tmp, "state.pt"))
        return torch.load(os.path.join(tmp, "state.pt"), weights_only=True)


def read_metrics(output_dir):
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


# -------------------------------------------------------------------------------------------------------------- hygiene
def test_import_has_no_side_effects(tmp_path):
    code = "import sys, torch; import ppo_rlhf; print(torch.cuda.is_initialized(), 'ppo_rlhf' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={**os.environ, "PYTHONPATH": HERE},
                         capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"]
    assert os.listdir(tmp_path) == []


def test_help_documents_every_flag():
    out = subprocess.run([sys.executable, SCRIPT, "--help"], capture_output=True, text=True, check=True).stdout
    for field in P.Args.__dataclass_fields__:
        assert f"--{field.replace('_', '-')}" in out, field
    import ast  # a help text with a line break is printed broken there, whatever the terminal's width
    args = next(n for n in ast.parse(open(SCRIPT).read()).body if getattr(n, "name", "") == "Args")
    helps = [st.value.value for st in args.body if isinstance(st, ast.Expr)]
    assert len(helps) == len(P.Args.__dataclass_fields__) and not [h for h in helps if "\n" in h]


def test_a_renamed_copy_runs_its_own_built_in_task(tmp_path):
    """The default reward is the running file's own addition_reward, not one imported by the module name: a fork
    saved as another name, next to an unchanged ppo_rlhf.py, uses its own (here one that scores everything 0.25,
    defined last, wherever the original is)."""
    source = open(SCRIPT).read()
    own = "def addition_reward(completion_ids, answer, **kwargs):\n    return [0.25] * len(answer)\n\n\n"
    fork = source.replace('\nif __name__ == "__main__":', "\n" + own + 'if __name__ == "__main__":')
    assert fork.count(own) == 1
    (tmp_path / "my_ppo.py").write_text(fork)
    (tmp_path / "ppo_rlhf.py").write_text(source)
    out = str(tmp_path / "run")
    command = [sys.executable, "my_ppo.py", "--total_episodes", "64",
               "--per_device_train_batch_size", "32", "--output_dir", out, "--no-eval-on-start"]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert [m["objective/scores"] for m in read_metrics(out)] == [0.25, 0.25]


# ---------------------------------------------------------------------------------------- math against naive references
def random_mask(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(shape, generator=gen) < 0.7
    mask[:, 0] = True
    return mask


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_masked_stats_match_torch_on_the_real_entries(seed):
    x = torch.randn(5, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    mask = random_mask((5, 9), seed)
    real = x[mask]
    assert torch.allclose(P.masked_mean(x, mask), real.mean())
    assert torch.allclose(P.masked_var(x, mask), real.var(unbiased=True))
    mean, var = P.global_mean_var(x, mask)  # one process: the batch's own statistics
    assert torch.allclose(mean, real.mean()) and torch.allclose(var, real.var(unbiased=True))
    one = torch.zeros_like(mask)
    one[0, 0] = True
    assert P.masked_var(x, one) == 0 and P.global_mean_var(x, one)[1] == 0
    assert torch.isfinite(P.masked_whiten(x, one, *P.global_mean_var(x, one))).all()
    white = P.masked_whiten(x, mask, mean, var)
    assert torch.allclose(white[mask], (real - real.mean()) / (real.var() + 1e-8).sqrt()) and (white[~mask] == 0).all()
    assert torch.allclose(white[mask].mean(), torch.tensor(0.0, dtype=torch.float64), atol=1e-12)
    scaled = P.masked_whiten(x, mask, mean, var, shift_mean=False)
    assert torch.allclose(scaled[mask], (real - real.mean()) / (real.var() + 1e-8).sqrt() + real.mean())
    x_nan = x.masked_fill(~mask, float("nan"))  # what sits under the mask never leaks in
    assert torch.allclose(P.masked_whiten(x_nan, mask, *P.global_mean_var(x_nan, mask)), white)


@pytest.mark.parametrize("dtype,temperature", [(torch.float32, 1.0), (torch.float32, 0.7), (torch.bfloat16, 1.3)])
def test_token_logprobs_match_cross_entropy_values_and_gradients(monkeypatch, dtype, temperature):
    monkeypatch.setattr(P, "logprobs_chunk_rows", lambda vocab_size: 5)  # several chunks, the last one partial
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 7, 50, generator=gen)).to(dtype).requires_grad_()
    tokens = torch.randint(0, 50, (3, 7), generator=gen)
    weights = torch.randn(3, 7, generator=gen)
    logprobs, entropy = P.chunked_logprobs(logits, tokens, temperature)
    assert logprobs.dtype == entropy.dtype == torch.float32
    (logprobs * weights).sum().backward()

    ref_logits = logits.detach().double().requires_grad_()
    z = ref_logits / temperature
    ref = -F.cross_entropy(z.flatten(0, 1), tokens.flatten(), reduction="none").view(3, 7)
    (ref * weights.double()).sum().backward()
    p = z.softmax(-1)
    assert torch.allclose(logprobs.double(), ref, atol=1e-5)
    assert torch.allclose(entropy.double(), -(p * p.log()).sum(-1), atol=1e-5)
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # the gradient is returned in the logits' dtype
    assert logits.grad.dtype == dtype
    assert torch.allclose(logits.grad.double(), ref_logits.grad, atol=tol)


def test_token_logprobs_keep_no_float32_copy_of_the_logits():
    logits = torch.randn(4, 6, 1000, dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        P.chunked_logprobs(logits, torch.randint(0, 1000, (4, 6)))[0].sum()
    big = [t for t in saved if t.numel() >= logits.numel()]
    assert big and all(t.dtype == torch.bfloat16 for t in big)  # only the input itself, no float32 (N, V) copy


@pytest.mark.parametrize("bias,autocast", [(False, False), (True, False), (True, True)])
def test_token_logprobs_from_hidden_states_match_the_full_logits(monkeypatch, bias, autocast):
    monkeypatch.setattr(P, "logprobs_chunk_rows", lambda vocab_size: 4)  # several chunks, the last one partial
    gen = torch.Generator().manual_seed(1)
    head = torch.nn.Linear(8, 50, bias=bias)
    hidden = torch.randn(3, 5, 8, generator=gen, requires_grad=True)
    tokens, weights = torch.randint(0, 50, (3, 5), generator=gen), torch.randn(3, 5, generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logprobs, entropy = P.chunked_logprobs(hidden, tokens, 0.8, head)
    (logprobs * weights).sum().backward()
    ref_hidden = hidden.detach().double().requires_grad_()
    ref_head = torch.nn.Linear(8, 50, bias=bias).double()
    ref_head.load_state_dict(head.state_dict())
    z = ref_head(ref_hidden) / 0.8
    ref = -F.cross_entropy(z.flatten(0, 1), tokens.flatten(), reduction="none").view(3, 5)
    (ref * weights.double()).sum().backward()
    tol = 5e-2 if autocast else 1e-5  # bf16 matmuls: ~3 significant digits
    assert torch.allclose(logprobs.double(), ref, atol=tol)
    assert torch.allclose(entropy.double(), -(z.softmax(-1) * z.log_softmax(-1)).sum(-1), atol=tol)
    pairs = [(hidden, ref_hidden), (head.weight, ref_head.weight)] + [(head.bias, ref_head.bias)] * bias
    for param, ref_param in pairs:
        assert param.grad.dtype == torch.float32 and torch.allclose(param.grad.double(), ref_param.grad, atol=tol)
    saved = []  # nothing of the size of the (N, V) logits is kept for backward (W is 8 x 50)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        P.chunked_logprobs(hidden, tokens, 0.8, head)
    assert saved and max(t.numel() for t in saved) < 15 * 50


@pytest.mark.parametrize("through_head", [False, True])
def test_an_entropy_term_in_the_loss_gets_the_gradient_of_autograd_through_log_softmax(monkeypatch, through_head):
    """An entropy bonus (loss −= c·H) added by a fork must train: the chunked log-probs' gradient for H, alone and
    together with log π, equals autograd's through log_softmax in float64."""
    monkeypatch.setattr(P, "logprobs_chunk_rows", lambda vocab_size: 4)  # several chunks, the last one partial
    gen = torch.Generator().manual_seed(2)
    head = torch.nn.Linear(8, 30) if through_head else None
    x = torch.randn(3, 5, 8 if through_head else 30, generator=gen, requires_grad=True)
    tokens = torch.randint(0, 30, (3, 5), generator=gen)
    w_lp, w_h = torch.randn(3, 5, generator=gen), torch.randn(3, 5, generator=gen)
    ref_x = x.detach().double().requires_grad_()
    ref_head = None
    if through_head:
        ref_head = torch.nn.Linear(8, 30).double()
        ref_head.load_state_dict(head.state_dict())
    params = [x] + (list(head.parameters()) if through_head else [])
    ref_params = [ref_x] + (list(ref_head.parameters()) if through_head else [])
    for loss_of in (lambda lp, h: (h * w_h).sum(), lambda lp, h: (lp * w_lp).sum() - 0.3 * (h * w_h).sum()):
        for p in params + ref_params:
            p.grad = None
        logprobs, entropy = P.chunked_logprobs(x, tokens, 0.7, head)
        loss_of(logprobs, entropy).backward()
        log_p = ((ref_head(ref_x) if through_head else ref_x) / 0.7).log_softmax(-1)
        ref_entropy = -(log_p.exp() * log_p).sum(-1)
        ref_logprobs = log_p.gather(-1, tokens[..., None]).squeeze(-1)
        loss_of(ref_logprobs, ref_entropy).backward()
        assert torch.allclose(entropy.double(), ref_entropy, atol=1e-5)
        for p, ref_p in zip(params, ref_params):
            assert p.grad is not None and p.grad.abs().max() > 0
            assert torch.allclose(p.grad.double(), ref_p.grad, atol=1e-5), (p.grad - ref_p.grad).abs().max()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_response_logprobs_through_the_output_layer_equal_the_models_logits(tiny, arch, monkeypatch):
    monkeypatch.setattr(P, "logprobs_chunk_rows", lambda vocab_size: 4)  # 9 response tokens: more than one chunk
    policy = loaded(tiny, arch)
    head = P.output_layer(policy)
    assert head is policy.get_output_embeddings()
    ids, mask = P.left_pad([[5, 6, 7, 20, 21, 22], [8, 23, 24, 25], [9, 10, 11, 12, 26, 27]], pad_token_id=0)
    full, full_entropy = P.response_logprobs(policy, ids, mask, ids.shape[1] - 3, 0.9)
    full.sum().backward()
    full_grads = [p.grad.clone() for p in policy.parameters()]
    policy.zero_grad()
    fused, fused_entropy = P.response_logprobs(policy, ids, mask, ids.shape[1] - 3, 0.9, head)
    fused.sum().backward()
    assert torch.allclose(fused, full, atol=1e-5) and torch.allclose(fused_entropy, full_entropy, atol=1e-5)
    assert all(torch.allclose(p.grad, g, atol=1e-5) for p, g in zip(policy.parameters(), full_grads))


def test_response_lengths():
    responses = torch.tensor([[5, 1, 7, 1], [5, 6, 7, 8], [1, 0, 0, 0]])
    assert P.response_lengths(responses, [1]).tolist() == [2, 4, 1]
    assert P.response_lengths(responses, [7, 1]).tolist() == [2, 3, 1]  # the first of several stop ids
    assert P.response_lengths(responses, []).tolist() == [4, 4, 4]


def test_kl_estimators():
    gen = torch.Generator().manual_seed(0)
    logp, ref = (torch.randn(1000, dtype=torch.float64, generator=gen) for _ in range(2))
    assert torch.allclose(P.kl_estimate(logp, ref, "k1"), logp - ref)
    k3 = P.kl_estimate(logp, ref, "k3")
    assert (k3 >= 0).all() and torch.allclose(k3, (ref - logp).exp() - 1 - (ref - logp))
    assert torch.allclose(P.kl_estimate(logp, ref, "k2"), 0.5 * (ref - logp) ** 2)
    assert all(P.kl_estimate(logp, logp, k).abs().max() == 0 for k in ("k1", "k2", "k3"))
    # both are unbiased: averaged over tokens sampled from p they give KL(p‖q) of the closed form
    p_logits, q_logits = (torch.randn(6, dtype=torch.float64, generator=gen) for _ in range(2))
    log_p, log_q = p_logits.log_softmax(0), q_logits.log_softmax(0)
    exact = (log_p.exp() * (log_p - log_q)).sum()
    samples = torch.multinomial(log_p.exp(), 400_000, replacement=True, generator=gen)
    for estimator in ("k1", "k3"):
        estimate = P.kl_estimate(log_p[samples], log_q[samples], estimator).mean()
        assert abs(estimate - exact) < 0.01, (estimator, estimate, exact)


def test_per_token_rewards_put_the_score_on_the_last_real_token():
    kl = torch.arange(1.0, 13.0).view(3, 4)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    penalties = torch.where(mask, -0.5 * kl, 0.0)  # −β·KL_t, β = 0.5
    rewards = P.per_token_rewards(torch.tensor([10.0, 20.0, 30.0]), penalties, mask)
    expected = torch.tensor([[-0.5, -1.0 + 10, 0, 0], [-2.5, -3.0, -3.5, -4.0 + 20], [-4.5 + 30, 0, 0, 0]])
    assert torch.allclose(rewards, expected)


def gae_naive(rewards, values, mask, gamma, lam):
    """Per sequence, over its real tokens only, in python floats."""
    advantages = torch.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        n = int(mask[b].sum())
        last = 0.0
        for t in reversed(range(n)):
            next_value = values[b, t + 1].item() if t + 1 < n else 0.0
            delta = rewards[b, t].item() + gamma * next_value - values[b, t].item()
            last = delta + gamma * lam * last
            advantages[b, t] = last
    return advantages


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (0.99, 1.0), (0.5, 0.0)])
def test_gae_matches_a_per_sample_loop(gamma, lam):
    gen = torch.Generator().manual_seed(1)
    rewards, values = (torch.randn(6, 8, dtype=torch.float64, generator=gen) for _ in range(2))
    lengths = torch.tensor([1, 3, 8, 5, 2, 7])
    mask = torch.arange(8) < lengths[:, None]
    advantages, returns = P.gae(rewards, values, mask, gamma, lam)
    expected = gae_naive(rewards, values, mask, gamma, lam)
    assert torch.allclose(advantages, expected)
    assert torch.allclose(returns[mask], (expected + values)[mask])
    assert (advantages[~mask] == 0).all() and (returns[~mask] == 0).all()


def test_gae_closed_forms():
    gen = torch.Generator().manual_seed(2)
    rewards, values = (torch.randn(4, 6, dtype=torch.float64, generator=gen) for _ in range(2))
    mask = torch.arange(6) < torch.tensor([6, 4, 1, 5])[:, None]
    rewards, values = rewards * mask, values * mask
    # λ = 0: A_t = δ_t = r_t + γV_{t+1} − V_t (one-step TD error)
    next_values = torch.cat([values[:, 1:], torch.zeros(4, 1, dtype=torch.float64)], 1) * mask
    assert torch.allclose(P.gae(rewards, values, mask, 0.9, 0.0)[0], (rewards + 0.9 * next_values - values) * mask)
    # γ = λ = 1 and V = 0: A_t = reward-to-go Σ_{k>=t} r_k
    reward_to_go = rewards.flip(1).cumsum(1).flip(1)
    assert torch.allclose(P.gae(rewards, torch.zeros_like(values), mask, 1.0, 1.0)[0], reward_to_go)
    # λ = 1: A_t = discounted return − V_t, whatever V is
    discounts = 0.8 ** torch.arange(6, dtype=torch.float64)
    discounted = torch.stack([(rewards[:, t:] * discounts[: 6 - t]).sum(1) for t in range(6)], 1)
    assert torch.allclose(P.gae(rewards, values, mask, 0.8, 1.0)[0], (discounted - values) * mask)


def test_advantages_are_whitened_with_the_statistics_of_the_tokens_in_the_loss():
    """Phase 4 (advantages_and_returns): p_t = −β·KL_t (the KL in the reward), r_t = p_t + the score
    on the last token; GAE runs over every response token (the returns are GAE's), and the
    whitening takes its mean and variance over the tokens in the loss (loss_mask: here a cut-off
    response is out), so that the tokens that train have mean 0 and variance 1; group baselines are
    not whitened; with the KL in the loss, p = 0."""
    gen = torch.Generator().manual_seed(8)
    mask = torch.arange(6) < torch.tensor([6, 2, 4, 5])[:, None]
    loss_mask = mask & torch.tensor([True, False, True, True])[:, None]  # response 1 was cut off
    kl, values = (torch.randn(4, 6, dtype=torch.float64, generator=gen) for _ in range(2))
    scores = torch.tensor([0.5, 9.0, -1.0, 2.0], dtype=torch.float64)  # 9: far from the rest
    phase_4 = P.advantages_and_returns(scores, kl, 0.2, values, mask, loss_mask, P.Args())
    penalties, rewards = phase_4["penalties"], phase_4["rewards"]
    advantages, returns = phase_4["advantages"], phase_4["returns"]
    assert torch.equal(phase_4["loss_mask"], loss_mask)  # every row scored
    assert torch.equal(penalties, torch.where(mask, -0.2 * kl, 0.0))
    assert torch.equal(rewards, P.per_token_rewards(scores, penalties, mask))
    raw, expected_returns = P.gae(rewards, values, mask, 1.0, 0.95)
    trained = raw[loss_mask]
    expected = (raw - trained.mean()) / (trained.var() + 1e-8).sqrt()
    assert torch.equal(returns, expected_returns)
    assert torch.allclose(advantages[mask], expected[mask])
    assert advantages[loss_mask].mean().abs() < 1e-12
    assert advantages[loss_mask].var() == pytest.approx(1, abs=1e-6)
    over_mask = P.masked_whiten(raw, mask, *P.global_mean_var(raw, mask))
    assert not torch.allclose(advantages[mask], over_mask[mask])
    grpo = P.Args(advantage_estimator="grpo", num_generations=2, kl_in="loss")
    no_value = torch.zeros_like(values)  # value-free: score() leaves V at 0
    phase_4 = P.advantages_and_returns(scores, kl, 0.2, no_value, mask, loss_mask, grpo)
    penalties, rewards, group = phase_4["penalties"], phase_4["rewards"], phase_4["advantages"]
    baselined = P.baselined_scores(scores, mask.sum(1), 2, "grpo")
    assert not penalties.any()
    assert torch.equal(rewards, P.per_token_rewards(baselined, penalties, mask))
    assert torch.equal(group, P.gae(rewards, no_value, mask, 1.0, 1.0)[0])


def test_policy_loss_at_ratio_one():
    gen = torch.Generator().manual_seed(3)
    old = torch.randn(4, 5, dtype=torch.float64, generator=gen)
    advantages = torch.randn(4, 5, dtype=torch.float64, generator=gen)
    mask = random_mask((4, 5), 3)
    new = old.clone().requires_grad_()
    per_token, tokens = P.policy_loss(new, old, advantages, None, P.Args())
    clipfrac = P.ratio_stats(tokens, mask)["policy/clipfrac_avg"]
    approxkl = P.masked_mean(tokens["approxkl"], mask)  # ppo_epochs' statistic on one micro-batch
    loss = P.aggregate(per_token, mask, "token_mean", 5)
    loss.backward()
    assert torch.allclose(loss, -advantages[mask].mean())
    assert clipfrac == 0 and approxkl == 0
    assert torch.allclose(new.grad, -advantages * mask / mask.sum())  # ∂ρ/∂log π = ρ = 1


def test_policy_loss_in_the_clipped_regions():
    eps = 0.2
    log_ratio = torch.tensor([[0.5, -0.5, 0.5, -0.5, 0.1, -0.1]], dtype=torch.float64).log1p()  # ρ = 1.5, 0.5, ..., 0.9
    advantages = torch.tensor([[1.0, -1.0, -1.0, 1.0, 2.0, -2.0]], dtype=torch.float64)
    mask = torch.ones_like(advantages, dtype=torch.bool)
    new = log_ratio.clone().requires_grad_()
    per_token, tokens = P.policy_loss(new, torch.zeros_like(new), advantages, None, P.Args(cliprange=eps))
    clipfrac = P.ratio_stats(tokens, mask)["policy/clipfrac_avg"]
    approxkl = P.masked_mean(tokens["approxkl"], mask)  # ppo_epochs' statistic on one micro-batch
    loss = per_token.mean()
    loss.backward()
    ratio = log_ratio.exp()
    per_token = torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - eps, 1 + eps))
    assert torch.allclose(loss, per_token.mean())
    # A > 0 with ρ > 1+ε, and A < 0 with ρ < 1−ε: clipped, no gradient. The pessimistic other two keep ρ·A.
    assert new.grad[0, :2].abs().max() == 0
    assert torch.allclose(new.grad[0, 2:], (-advantages * ratio)[0, 2:] / 6)
    assert torch.isclose(clipfrac, torch.tensor(2 / 6, dtype=torch.float64))
    assert torch.allclose(approxkl, ((ratio - 1) - log_ratio).mean()) and approxkl > 0


def test_clip_higher_and_dual_clip():
    """ε_high only moves the upper clip; the dual clip caps a token's loss at c·|A| where A < 0, and nowhere else."""
    ratio = torch.tensor([[1.25, 1.25, 0.7, 2.5, 5.0, 5.0]], dtype=torch.float64)
    advantages = torch.tensor([[1.0, -1.0, -1.0, -1.0, -1.0, 1.0]], dtype=torch.float64)
    mask = torch.ones_like(advantages, dtype=torch.bool)
    new = ratio.log().requires_grad_()
    per_token, tokens = P.policy_loss(new, torch.zeros_like(new), advantages, None,
                                      P.Args(cliprange_high=0.28, dual_clip=3.0))
    stats = P.ratio_stats(tokens, mask)
    clipfrac, dual_clipfrac = stats["policy/clipfrac_avg"], stats["policy/dual_clipfrac_avg"]
    # ρ 1.25 < 1.28 is inside the clip for A > 0 (ε_high); A < 0, ρ 2.5 and 5: −ρ·A = 2.5 and 5, capped at c·|A| = 3
    assert per_token[0].tolist() == pytest.approx([-1.25, 1.25, 0.8, 2.5, 3.0, -1.28])
    assert clipfrac == pytest.approx(2 / 6) and dual_clipfrac == pytest.approx(1 / 6)
    per_token.sum().backward()
    assert new.grad[0, 4] == 0 and new.grad[0, 3] != 0  # the capped token has no gradient
    symmetric = P.policy_loss(new, torch.zeros_like(new), advantages, None, P.Args())[0]
    assert symmetric[0, [0, 4]].tolist() == pytest.approx([-1.2, 5.0])  # without them: clipped at 1 + ε, uncapped


def ragged_losses_inputs(seed=3):
    """float64 (B, T) = (5, 6) log-probs with ragged masks, ratios in and far outside the clip, advantages of both
    signs (per response, as the value-free estimators give them), and a sampler's μ near π_old."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.arange(6) < torch.tensor([6, 2, 4, 1, 5])[:, None]
    old = -torch.rand(5, 6, dtype=torch.float64, generator=gen) * 3
    new = old + 0.4 * torch.randn(5, 6, dtype=torch.float64, generator=gen)
    new[0, 1], new[2, 0] = old[0, 1] + 2.0, old[2, 0] - 2.0  # ρ = 7.4 and 0.14
    advantages = torch.tensor([1.5, -0.7, -2.0, 0.3, 0.0], dtype=torch.float64)[:, None].expand(5, 6).clone()
    mu = old + 0.05 * torch.randn(5, 6, dtype=torch.float64, generator=gen)
    return mask, old, new, advantages, mu


def test_cispo_and_sapo_against_their_formulas_per_token():
    """CISPO: −sg(min(ρ, c))·A·log π_θ, so ∂/∂log π_θ = −min(ρ, c)·A on every token, a capped one included (the
    clip would give it none); SAPO: −σ(τ(ρ − 1))·(4/τ)·A with τ = τ+ where A > 0, else τ−, so ∂/∂log π_θ =
    −4·σ·(1 − σ)·ρ·A: slope −A at ρ = 1, as the clip's inside. The capped share is CISPO's clip fraction."""
    mask, old, new, advantages, _ = ragged_losses_inputs()
    for kind in ("cispo", "sapo"):
        args = P.Args(policy_loss=kind, cispo_max=2.5, sapo_temperature_pos=1.3, sapo_temperature_neg=0.6)
        new_ = new.clone().requires_grad_()
        per_token, tokens = P.policy_loss(new_, old, advantages, mask, args)
        grad, = torch.autograd.grad(per_token[mask].sum(), new_)
        for i, t in zip(*torch.nonzero(mask, as_tuple=True)):
            rho, a, logp = math.exp(new[i, t] - old[i, t]), advantages[i, t].item(), new[i, t].item()
            if kind == "cispo":
                loss, slope = -min(rho, 2.5) * a * logp, -min(rho, 2.5) * a
            else:
                tau = 1.3 if a > 0 else 0.6
                sigma = 1 / (1 + math.exp(-tau * (rho - 1)))
                loss, slope = -sigma * 4 / tau * a, -4 * sigma * (1 - sigma) * rho * a
            assert per_token[i, t].item() == pytest.approx(loss, abs=1e-12)
            assert grad[i, t].item() == pytest.approx(slope, abs=1e-12)
        if kind == "cispo":
            assert torch.equal(tokens["clipped"], (new - old).exp() > 2.5) and tokens["clipped"][mask].any()
            assert grad[0, 1] != 0  # ρ = 7.4: capped, not cut off
    at_one = P.policy_loss(old.clone().requires_grad_(), old, advantages, mask, P.Args(policy_loss="sapo"))[0]
    assert torch.allclose(at_one, -advantages * 4 * 0.5 / torch.where(advantages > 0, 1.0, 1.05).double())


def test_gspo_uses_one_ratio_per_response_with_per_token_gradients():
    """--importance_sampling_level sequence: s_i = exp(mean_t log ρ_{i,t}) over the response's real tokens is the
    ratio of each of its tokens, clipped as the token ratio would be; ∂L/∂log π_θ(y_t) = −A·s_i on every token of
    an unclipped response (the token form sg(s_i)·π_θ/sg(π_θ)), 0 on a clipped one; the statistics are s_i's."""
    mask, old, new, advantages, _ = ragged_losses_inputs()
    args = P.Args(importance_sampling_level="sequence", cliprange=0.2, cliprange_high=0.28)
    new_ = new.clone().requires_grad_()
    per_token, tokens = P.policy_loss(new_, old, advantages, mask, args)
    grad, = torch.autograd.grad(per_token[mask].sum(), new_)
    for i in range(5):
        real = mask[i]
        s = math.exp((new[i, real] - old[i, real]).mean().item())
        a = advantages[i, 0].item()
        loss = max(-s * a, -min(max(s, 0.8), 1.28) * a)
        clipped = -min(max(s, 0.8), 1.28) * a > -s * a
        assert per_token[i, real].tolist() == pytest.approx([loss] * int(real.sum()), abs=1e-12)
        assert tokens["ratio"][i, real].tolist() == pytest.approx([s] * int(real.sum()), abs=1e-12)
        assert grad[i, real].tolist() == pytest.approx([0.0 if clipped else -a * s] * int(real.sum()), abs=1e-12)
        assert bool(tokens["clipped"][i, real].all()) == clipped and bool(tokens["outside"][i, 0]) == (
            not 0.8 <= s <= 1.28)
    token_level = P.policy_loss(new, old, advantages, mask, P.Args(cliprange_high=0.28))[1]["ratio"]
    assert not torch.allclose(token_level[mask], tokens["ratio"][mask])


def test_rollout_weights_per_token_and_per_response():
    """w = π_old/μ per token, or exp(Σ_t log w_t) over each response's real tokens; truncate: min(w, C); mask: 0
    where w > C (TRL's vllm_importance_sampling_mode values)."""
    mask, old, _, _, mu = ragged_losses_inputs()
    mu[1, 0] = old[1, 0] - 2.0  # w = 7.4 on one token of a two-token response
    w = (old - mu).exp()
    for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
        weights = P.rollout_weights(old, mu, mask, mode, 3.0)
        for i in range(5):
            for t in range(int(mask[i].sum())):
                x = math.exp((old[i, mask[i]] - mu[i, mask[i]]).sum().item()) if mode[0] == "s" else w[i, t].item()
                expected = min(x, 3.0) if mode.endswith("truncate") else (x if x <= 3.0 else 0.0)
                assert weights[i, t].item() == pytest.approx(expected, abs=1e-12), (mode, i, t)
    assert P.rollout_weights(old, mu, mask, "sequence_mask", 3.0)[1, :2].tolist() == [0.0, 0.0]
    assert P.rollout_weights(old, old, mask, "token_truncate", 3.0).unique().tolist() == [1.0]  # fp32: μ = π_old


def test_the_off_policy_mask_drops_negative_responses_that_drifted_from_the_sampler():
    """--off_policy_mask_threshold δ (DeepSeek-V3.2): a response whose advantage at its first token
    (its whole return) is < 0 and whose mean_t(log μ − log π_θ) > δ leaves the policy term whole
    (not its denominator), even where a later token's A is > 0 (a reward-to-go that changes sign, as
    the KL in the reward makes it); A_0 ≥ 0 or a drift ≤ δ stays whole, negative later tokens too;
    KL and entropy stay; the share of responses is policy/off_policy_masked_frac."""
    mask, old, new, advantages, mu = ragged_losses_inputs()
    advantages[1, 1] = 0.4  # A_0 < 0, a positive later token: masked with its response
    advantages[4, 2:] = -0.5  # A_0 = 0, negative later tokens: kept with their response
    mu[2] -= 1.0  # near π_θ, far from π_old: the drift is from μ
    drift = torch.where(mask, mu - new, 0.0).sum(1) / mask.sum(1)
    delta = drift[4].item() / 2  # responses 1, 3, 4 drift past δ
    assert max(drift[0], drift[2]) < delta < drift[[1, 3, 4]].min()
    drift_from_old = torch.where(mask, old - new, 0.0).sum(1) / mask.sum(1)
    assert drift_from_old[2] > delta  # from π_old response 2 would leave
    mb = {"response_mask": mask, "logprobs": old, "advantages": advantages, "ref_logprobs": old - 0.1,
          "sampler_logprobs": mu}
    args = P.Args(off_policy_mask_threshold=delta, kl_in="loss", kl_estimator="k3",
                  entropy_coef=0.1, loss_agg="token_mean", use_bias_correction_kl=False)
    entropy = torch.rand(5, 6, dtype=torch.float64)
    term, _, _, tokens = P.ppo_loss(new, entropy, None, mb, 0.2, args)
    out = (advantages[:, 0] < 0) & (drift > delta)
    keep = mask & ~out[:, None]
    pg = P.policy_loss(new, old, advantages, mask, args)[0]
    kl = P.kl_estimate(new, mb["ref_logprobs"], "k3")
    expected = (pg[keep].sum() + 0.2 * kl[mask].sum() - 0.1 * entropy[mask].sum()) / mask.sum()
    assert out.tolist() == [False, True, False, False, False] and torch.allclose(term, expected)
    assert P.ratio_stats(tokens, mask)["policy/off_policy_masked_frac"] == pytest.approx(1 / 5)


def test_loss_aggregation_on_ragged_lengths():
    x = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0], [5.0, 6.0, 7.0, 8.0]], dtype=torch.float64)
    mask = torch.arange(4) < torch.tensor([3, 1, 4])[:, None]
    assert P.aggregate(x, mask, "token_mean", 6) == pytest.approx((1 + 2 + 3 + 4 + 5 + 6 + 7 + 8) / 8)
    assert P.aggregate(x, mask, "seq_mean_token_mean", 6) == pytest.approx((6 / 3 + 4 / 1 + 26 / 4) / 3)
    assert P.aggregate(x, mask, "seq_mean_token_sum_norm", 6) == pytest.approx(36 / (3 * 6))  # response_length 6
    assert P.aggregate(x, mask, "seq_mean_token_sum", 6) == pytest.approx(36 / 3)
    mask[1] = False  # a response left out of the loss (--mask_truncated_completions) counts in no denominator
    assert P.aggregate(x, mask, "seq_mean_token_mean", 6) == pytest.approx((6 / 3 + 26 / 4) / 2)
    assert P.aggregate(x, mask, "seq_mean_token_sum_norm", 6) == pytest.approx(32 / (2 * 6))
    assert P.aggregate(x, mask, "seq_mean_token_sum", 6) == pytest.approx(32 / 2)
    nothing = torch.zeros_like(mask)
    assert all(P.aggregate(x, nothing, agg, 6) == 0 for agg in switch_values("loss_agg"))


def trl_case(seed, B=5, T=6):
    """A random float64 micro-batch: ragged lengths (padded rows; one of 1 token), per-token
    advantages of both signs, log-ratios near 0 and one row far off (VESPO's clamps), μ, π_ref."""
    gen = torch.Generator().manual_seed(seed)
    randn = lambda: torch.randn(B, T, dtype=torch.float64, generator=gen)  # noqa: E731
    mask = torch.arange(T) < torch.tensor([6, 2, 4, 1, 5])[:, None]
    old = -torch.rand(B, T, dtype=torch.float64, generator=gen) - 0.1
    new = old + 0.3 * randn()
    new[4] = old[4] + 5.0  # Σ_t log ρ_t = 25 for that row: w clamped at e^20
    mu, ref, advantages = old + 0.2 * randn(), old + 0.5 * randn(), randn()
    assert (advantages[mask] > 0).any() and (advantages[mask] < 0).any()
    return new.requires_grad_(), old, advantages, mask, mu, ref


def trl_kl(new, old, ref, beta):
    """TRL's KL term per token with use_bias_correction_kl (its default): β·k3·exp(log ρ_t)."""
    d = ref - new
    return beta * (d.exp() - d - 1) * (new - old).exp()


def naive_vespo(new, old, advantages, mask, v, beta, ref, k=(2.0, 3.0), lam=(3.0, 2.0)):
    """TRL 1.16's loss_type vespo, from its formulas, a row and a token at a time: log w = clamp(Σ_t
    clamp(log ρ_t, ±20) + Σ_t clamp(log v_t, log 1e-8, 20), log 1e-8, 20); φ = exp(λ + k·log w −
    λ·w), (k, λ) by the sign of the token's A (A >= 0: the first), detached; −φ·A·log π_θ, plus the
    KL term; Σ over the loss tokens / their count."""
    total, floor = 0.0, math.log(1e-8)
    for i in range(len(new)):
        real = [t for t in range(new.shape[1]) if mask[i, t]]
        log_w = sum((new[i, t] - old[i, t]).clamp(-20, 20) for t in real)
        if v is not None:
            log_w = log_w + sum(min(max(math.log(v[i, t].item()), floor), 20.0) for t in real)
        log_w = min(max(float(log_w.detach()), floor), 20.0)  # detached: φ is
        for t in real:
            j = 0 if advantages[i, t] >= 0 else 1
            phi = math.exp(lam[j] + k[j] * log_w - lam[j] * math.exp(log_w))
            total = total - phi * advantages[i, t] * new[i, t] + trl_kl(new[i, t], old[i, t],
                                                                        ref[i, t], beta)
    return total / mask.sum()


@pytest.mark.parametrize("beta,correction", [(0.0, False), (0.04, False), (0.0, True),
                                             (0.04, True)])
def test_vespo_equals_trls_loss_in_value_and_gradient(beta, correction):
    """--policy_loss vespo (ppo_loss, --kl_in loss with k3 and the bias correction, token_mean)
    against naive_vespo at 1e-10 in float64: padded rows, per-token A of both signs, a row whose
    ratio leaves the clamp; with --rollout_correction token_truncate the weights are in w, not on
    the loss again."""
    for seed in range(3):
        new, old, advantages, mask, mu, ref = trl_case(seed)
        args = P.Args(policy_loss="vespo", kl_in="loss", kl_coef=beta, kl_estimator="k3")
        P.check_args(args)
        mb = dict(logprobs=old, advantages=advantages, response_mask=mask, ref_logprobs=ref)
        v = None
        if correction:  # π_old/μ truncated at 1.2: some tokens capped
            v = mb["weights"] = P.rollout_weights(old, mu, mask, "token_truncate", 1.2)
            assert (v[mask] == 1.2).any() and (v[mask] < 1.2).any()
        ours, _, _, tokens = P.ppo_loss(new, torch.zeros_like(new), None, mb, beta, args)
        theirs = naive_vespo(new, old, advantages, mask, v, beta, ref)
        (grad_ours,), (grad_theirs,) = (torch.autograd.grad(x, new) for x in (ours, theirs))
        assert abs(ours.item() - theirs.item()) < 1e-10 and ours.abs() > 1e-3
        assert torch.allclose(grad_ours, grad_theirs, rtol=0, atol=1e-10)
        assert tokens["phi"][4].item() == 0.0  # w = e^20: φ underflows to 0 (TRL's nan_to_num)
        assert 0 < tokens["phi"][0].item() and tokens["phi"].shape == (5, 1)


def test_luspo_equals_trls_loss_in_value_and_gradient():
    """LUSPO: --importance_sampling_level sequence --loss_agg seq_mean_token_sum: TRL 1.16's luspo
    from its formulas, s_i = exp(mean_t log ρ_t) with its gradient, −min(s_i·A_i, clip(s_i)·A_i)
    summed over the response's tokens, a mean over responses, at 1e-10 in float64 (β = 0: TRL
    weights the KL term by s_i, this file by ρ_t). No length warning for it."""
    for seed in range(3):
        new, old, advantages, mask, _, _ = trl_case(seed)
        advantages = advantages[:, :1].expand_as(advantages)  # one A per response: value-free
        args = P.Args(importance_sampling_level="sequence", loss_agg="seq_mean_token_sum",
                      advantage_estimator="grpo", num_generations=5, per_device_train_batch_size=5,
                      num_mini_batches=1, cliprange=0.2, cliprange_high=0.28)
        P.check_args(args)
        mb = dict(logprobs=old, advantages=advantages, response_mask=mask)
        ours = P.ppo_loss(new, torch.zeros_like(new), None, mb, 0.0, args)[0]
        rows = []
        for i in range(len(new)):
            real = mask[i]
            s = ((new[i] - old[i])[real].sum() / real.sum()).exp()
            a = advantages[i, 0]
            rows.append(-torch.min(s * a, s.clamp(0.8, 1.28) * a) * real.sum())
        theirs = torch.stack(rows).mean()
        (grad_ours,), (grad_theirs,) = (torch.autograd.grad(x, new) for x in (ours, theirs))
        assert abs(ours.item() - theirs.item()) < 1e-10 and ours.abs() > 1e-3
        assert torch.allclose(grad_ours, grad_theirs, rtol=0, atol=1e-10)


@pytest.mark.parametrize("loss", ["vespo", "luspo", "entropy_mask"])
def test_the_trl_losses_run_end_to_end_and_log_what_they_did(tiny, tmp_path, loss):
    """A few updates of main() with each: VESPO logs vespo/phi_seq_mean (1 where it steps once per
    update: w = 1 on-policy), the high-entropy mask the share of loss tokens it left out (about 1 −
    q, the quantile over the micro-batch's loss tokens)."""
    flags = {"vespo": dict(policy_loss="vespo", advantage_estimator="grpo", num_generations=2,
                           num_ppo_epochs=1, num_mini_batches=1),
             "luspo": dict(importance_sampling_level="sequence", loss_agg="seq_mean_token_sum",
                           advantage_estimator="grpo", num_generations=2),
             "entropy_mask": dict(top_entropy_quantile=0.2)}[loss]
    args = run_args(tiny, tmp_path, total_episodes=24, **flags)
    P.main(args)
    metrics = read_metrics(args.output_dir)
    assert len(metrics) == 3 and all(m["policy/epochs"] > 0 for m in metrics)
    if loss == "vespo":
        assert all(abs(m["vespo/phi_seq_mean"] - 1) < 1e-4 for m in metrics)
    if loss == "entropy_mask":
        assert all(0.7 < m["policy/entropy_masked_frac"] < 0.85 for m in metrics)
    assert ("policy/entropy_masked_frac" in metrics[0]) == (loss == "entropy_mask")


def naive_entropy_masked_clip(new, old, advantages, mask, entropy, all_entropies, q, beta, ref):
    """TRL 1.16's get_high_entropy_mask and loss from their formulas: the threshold is the (1 −
    q)-quantile of every rank's loss-token entropies (float32, linear interpolation, by hand); a
    token's clipped surrogate counts where its entropy is at least it, 0 elsewhere (its count kept
    in the denominator); the KL term everywhere."""
    values = sorted(all_entropies.float().tolist())
    position = (1 - q) * (len(values) - 1)
    low = math.floor(position)
    high = values[min(low + 1, len(values) - 1)]
    threshold = values[low] + (position - low) * (high - values[low])
    total = 0.0
    for i, t in mask.nonzero().tolist():
        ratio = (new[i, t] - old[i, t]).exp()
        surrogate = -torch.min(ratio * advantages[i, t], ratio.clamp(0.8, 1.2) * advantages[i, t])
        keep = float(entropy[i, t]) >= threshold
        total = total + surrogate * keep + trl_kl(new[i, t], old[i, t], ref[i, t], beta)
    return total / mask.sum()


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_the_high_entropy_mask_equals_trls_in_value_and_gradient(beta):
    """--top_entropy_quantile q under clip and token_mean against naive_entropy_masked_clip at 1e-10
    in float64; the share of loss tokens it masked is logged; the entropy bonus is masked too."""
    for seed, q in ((0, 0.2), (1, 0.5), (2, 0.8)):
        new, old, advantages, mask, _, ref = trl_case(seed)
        new = new.detach().clone()
        new[4] = old[4] + 0.1  # within the clip band where it can be
        new.requires_grad_()
        gen = torch.Generator().manual_seed(seed)
        entropy = torch.rand(5, 6, dtype=torch.float64, generator=gen)
        args = P.Args(top_entropy_quantile=q, kl_in="loss", kl_coef=beta, kl_estimator="k3")
        P.check_args(args)
        mb = dict(logprobs=old, advantages=advantages, response_mask=mask, ref_logprobs=ref)
        ours, _, _, tokens = P.ppo_loss(new, entropy, None, mb, beta, args)
        theirs = naive_entropy_masked_clip(new, old, advantages, mask, entropy, entropy[mask], q,
                                           beta, ref)
        (grad_ours,), (grad_theirs,) = (torch.autograd.grad(x, new) for x in (ours, theirs))
        assert abs(ours.item() - theirs.item()) < 1e-10
        assert torch.allclose(grad_ours, grad_theirs, rtol=0, atol=1e-10)
        masked = tokens["entropy_masked"]
        n = int(mask.sum())
        assert abs(masked[mask].float().mean() - (1 - math.ceil(q * n) / n)) <= 1 / n  # ~1 − q out
        assert not (masked & ~mask).any()
        bonus = P.Args(top_entropy_quantile=q, entropy_coef=0.5)
        no_bonus = P.Args(top_entropy_quantile=q)
        P.check_args(bonus), P.check_args(no_bonus)
        with_bonus = P.ppo_loss(new, entropy, None, mb, 0.0, bonus)[0]
        no_bonus = P.ppo_loss(new, entropy, None, mb, 0.0, no_bonus)[0]
        kept = entropy.where(mask & ~masked, 0.0).sum() / mask.sum()
        assert (no_bonus - with_bonus).item() == pytest.approx(0.5 * kept.item(), rel=1e-12)


SWITCHES = ("advantage_estimator", "policy_loss", "kl_in", "kl_estimator", "loss_agg",
            "rollout_correction")


def switch_values(flag):
    """The values of an Args switch's Literal (an Optional one's, None aside)."""
    kinds = typing.get_args(P.Args.__dataclass_fields__[flag].type)
    literal = next((k for k in kinds if typing.get_args(k)), None)
    return typing.get_args(literal) if literal is not None else kinds


def switch_outputs(flag, gen):
    """{value: what the switch's branch makes of one fixed random input}, for every value. The input
    reaches every branch's region: 2 groups of k = 4 rows (a median is not the mean there, as it is
    at k = 2), log-ratios of both signs past ±20 (where an estimator's clamp acts), advantages of
    both signs, ragged lengths."""
    mask = torch.arange(6) < torch.tensor([6, 2, 4, 5, 1, 6, 3, 5])[:, None]
    randn = lambda *shape: torch.randn(*shape, dtype=torch.float64, generator=gen)  # noqa: E731
    old, values, x = (randn(8, 6) for _ in range(3))
    new, kl, scores = old + 0.5 * randn(8, 6), randn(8, 6).abs(), randn(8)
    far = torch.zeros(8, 6, dtype=torch.float64)
    far[::3, ::2], far[1::3, 1::2] = 25.0, -25.0  # log π_ref − log π past ±20
    ref = new + far + 0.3 * randn(8, 6)
    advantages = randn(8, 1).expand(8, 6)
    groups = scores.view(2, 4)
    assert ((groups.median(1).values - groups.mean(1)).abs() > 0.1).all()  # the input has teeth
    assert (ref - new > 20).any() and (ref - new < -20).any()
    assert (advantages > 0).any() and (advantages < 0).any()
    outputs = {}
    for value in switch_values(flag):
        base = dict(num_generations=4, loss_agg="token_mean", cliprange=0.1)
        args = P.Args(**{**base, flag: value})
        if flag in ("advantage_estimator", "kl_in"):
            v = values if P.ESTIMATORS[args.advantage_estimator]["learns_value"] else 0 * values
            phase_4 = P.advantages_and_returns(scores, kl, 0.3, v, mask, mask, args)
            outputs[value] = torch.cat([x.double() for x in phase_4.values()])
        elif flag == "policy_loss":
            outputs[value] = P.policy_loss(new, old, advantages, mask, args)[0]
        elif flag == "kl_estimator":
            outputs[value] = P.kl_estimate(new, ref, value)
        elif flag == "loss_agg":
            outputs[value] = P.aggregate(x, mask, value, 6)
        else:  # "none": main hands the loss no weights
            outputs[value] = torch.ones_like(new) if value == "none" else P.rollout_weights(
                new, old, mask, value, 1.5)
    return outputs


@pytest.mark.parametrize("flag", SWITCHES)
def test_every_value_of_a_switch_has_its_row_and_a_branch_of_its_own(flag):
    """A fork that adds a value to one of the six switches and forgets its branch, or (estimators
    and policy losses) its row of facts, fails here: each estimator and each policy loss has a row
    (ESTIMATORS, POLICY_LOSSES), a value without a branch raises (never runs another's formula), and
    on one fixed random input that reaches every branch's region (switch_outputs) every value's
    output differs from every other value's."""
    if flag in ("advantage_estimator", "policy_loss"):
        table = P.ESTIMATORS if flag == "advantage_estimator" else P.POLICY_LOSSES
        assert set(table) == set(switch_values(flag))
        assert all(row.keys() == next(iter(table.values())).keys() for row in table.values())
    outputs = switch_outputs(flag, torch.Generator().manual_seed(12))
    for a, b in itertools.combinations(outputs, 2):
        assert not torch.allclose(outputs[a], outputs[b]), (
            f"--{flag} {a} and --{flag} {b} give the same output on an input that reaches every "
            f"branch's region (switch_outputs): does the branch of {b} run {a}'s formula (a copied "
            "branch, or a fall-through)?")
    mask, x = torch.ones(2, 3, dtype=torch.bool), torch.zeros(2, 3)
    new = "a fork's new value"  # without its branch
    for unknown in (lambda: P.kl_estimate(x, x, new), lambda: P.aggregate(x, mask, new, 3),
                    lambda: P.rollout_weights(x, x, mask, new, 2.0),
                    lambda: P.rollout_weights(x, x, mask, "token_" + new, 2.0),
                    lambda: P.baselined_scores(x[0], torch.ones(3), 3, new),
                    lambda: P.policy_loss(x, x, x, mask, P.Args(policy_loss=new)),
                    lambda: P.advantages_and_returns(x[:, 0], x, 0.1, x, mask, mask,
                                                     P.Args(kl_in=new))):
        with pytest.raises(ValueError, match="no branch for"):
            unknown()
    for flag in ("advantage_estimator", "policy_loss"):
        with pytest.raises(SystemExit, match=f"--{flag} {new}: no row of facts"):
            P.check_args(P.Args(**{flag: new}))


MATH_HELPERS = {"gae": [], "policy_loss": ["response_mean"], "value_loss": ["masked_mean"],
                "kl_estimate": [], "baselined_scores": [],
                "aggregate": ["masked_mean", "response_mean"]}


def test_the_math_a_fork_pastes_runs_on_its_own():
    """Each math function a fork would copy out (with the helpers its docstring names, in a
    namespace holding only torch, math and F) runs every branch and gives the file's numbers;
    policy_loss reads no field of its args object beyond those its docstring lists."""
    gen = torch.Generator().manual_seed(13)
    mask = torch.arange(5) < torch.tensor([5, 2, 3])[:, None]
    randn = lambda: torch.randn(3, 5, dtype=torch.float64, generator=gen)  # noqa: E731
    old, new, advantages, values, returns = (randn() for _ in range(5))
    pasted = {}
    for name, helpers in MATH_HELPERS.items():
        doc = getattr(P, name).__doc__
        assert all(helper in doc for helper in helpers), name
        namespace = {"torch": torch, "math": math, "F": F}
        for function in helpers + [name]:
            exec(inspect.getsource(getattr(P, function)), namespace)
        pasted[name] = namespace[name]
    doc = P.policy_loss.__doc__
    listed = re.search(r"args: ([^.]*)\.", doc.replace("\n", " "))[1]
    fields = [f.strip() for f in listed.split(",")]
    branches = itertools.product(P.POLICY_LOSSES, ("token", "sequence"), (None, 2.0))
    for loss, level, dual_clip in branches:
        full = P.Args(policy_loss=loss, importance_sampling_level=level, dual_clip=dual_clip,
                      cliprange_high=0.3)
        args = SimpleNamespace(**{f: getattr(full, f) for f in fields})
        mine, theirs = P.policy_loss(new, old, advantages, mask, full), pasted["policy_loss"](
            new, old, advantages, mask, args)
        assert torch.equal(mine[0], theirs[0]), (loss, level, dual_clip)
    lengths = torch.tensor([3, 1, 5, 2])
    for estimator in P.ESTIMATORS:
        scores = torch.randn(4, dtype=torch.float64, generator=gen)
        assert torch.equal(pasted["baselined_scores"](scores, lengths, 2, estimator),
                           P.baselined_scores(scores, lengths, 2, estimator))
    for k in ("k1", "k2", "k3"):
        assert torch.equal(pasted["kl_estimate"](new, old, k), P.kl_estimate(new, old, k))
    for loss_agg in switch_values("loss_agg"):
        assert torch.equal(pasted["aggregate"](new, mask, loss_agg, 5),
                           P.aggregate(new, mask, loss_agg, 5))
    assert torch.equal(pasted["gae"](new, values, mask, 0.9, 0.8)[0],
                       P.gae(new, values, mask, 0.9, 0.8)[0])
    assert torch.equal(pasted["value_loss"](new, values, returns, mask, 0.2)[0],
                       P.value_loss(new, values, returns, mask, 0.2)[0])


def test_group_baselines_closed_forms():
    scores = torch.tensor([1.0, 2.0, 3.0, 6.0, 5.0, 5.0, 5.0, 5.0], dtype=torch.float64)  # 2 groups of k = 4
    g = scores.view(2, 4)
    lengths = torch.tensor([3, 1, 4, 2, 5, 2, 1, 6])
    rloo = P.baselined_scores(scores, lengths, 4, "rloo")
    assert rloo.tolist() == pytest.approx([1 - 11 / 3, 2 - 10 / 3, 3 - 9 / 3, 6 - 6 / 3, 0, 0, 0, 0])
    std = math.sqrt(sum((v - 3) ** 2 for v in (1, 2, 3, 6)) / 3)  # unbiased
    assert P.baselined_scores(scores, lengths, 4, "grpo").tolist() == pytest.approx(
        [(v - 3) / (std + 1e-4) for v in (1, 2, 3, 6)] + [0] * 4)
    for estimator in ("dr_grpo", "reinforce_pp_baseline"):
        centered = P.baselined_scores(scores, lengths, 4, estimator)
        assert centered.tolist() == [-2, -1, 0, 3, 0, 0, 0, 0]
    for estimator in ("gae", "reinforce_pp"):
        assert torch.equal(P.baselined_scores(scores, lengths, 4, estimator), scores)
    assert torch.allclose(rloo * 3 / 4, g.sub(g.mean(1, keepdim=True)).flatten())  # RLOO = k/(k−1) x mean-centred


def test_kl_in_the_loss_has_the_expected_gradient_of_each_estimator():
    """On a categorical π_θ (6 actions), E_{a~π_θ}[∇_θ k(log π_θ(a) − log π_ref(a))], taken exactly over the actions:
    k1 gives 0, k2 ∇KL(π_θ‖π_ref), k3 ∇KL(π_ref‖π_θ) (the docstring of --kl_estimator)."""
    gen = torch.Generator().manual_seed(4)
    theta, log_ref = torch.randn(6, dtype=torch.float64, generator=gen), torch.randn(6, dtype=torch.float64,
                                                                                     generator=gen).log_softmax(0)

    def gradient(f):
        t = theta.clone().requires_grad_()
        f(t.log_softmax(0)).backward()
        return t.grad

    def expected_estimate(estimator):  # the sample weights π_θ(a) are the sampler's: no gradient through them
        return lambda log_pi: (log_pi.exp().detach() * P.kl_estimate(log_pi, log_ref, estimator)).sum()

    forward_kl = gradient(lambda log_pi: (log_pi.exp() * (log_pi - log_ref)).sum())
    reverse_kl = gradient(lambda log_pi: (log_ref.exp() * (log_ref - log_pi)).sum())
    assert gradient(expected_estimate("k1")).abs().max() < 1e-12
    assert torch.allclose(gradient(expected_estimate("k2")), forward_kl)
    assert torch.allclose(gradient(expected_estimate("k3")), reverse_kl)
    assert not torch.allclose(forward_kl, reverse_kl)


def test_the_weighted_kl_in_the_loss_has_the_gradient_of_kl_pi_theta_pi_ref_at_any_theta():
    """--kl_in loss with --use_bias_correction_kl (TRL's): on a 6-action categorical, with θ away
    from θ_old, the exact expectation over π_old's samples of ppo_loss's KL term,
    E_{a~π_old}[ρ·k(a)] with ρ = π_θ/π_old, has the gradient ∇KL(π_θ‖π_ref) for k1, k2 (whose weight
    is sg(ρ)) and k3. With sg(ρ) for k1 or k3 it does not (k1's is then 0 at every θ), nor with ρ
    for k2, nor without the weight (--no-use-bias-correction-kl)."""
    gen = torch.Generator().manual_seed(6)
    randn = lambda: torch.randn(6, dtype=torch.float64, generator=gen)  # noqa: E731
    theta, log_old, log_ref = randn(), randn().log_softmax(0), randn().log_softmax(0)

    def gradient(f):
        t = theta.clone().requires_grad_()
        f(t.log_softmax(0)).backward()
        return t.grad

    def loss_term(estimator, correction=True):  # Σ_a π_old(a)·(ppo_loss's KL term on a alone)
        args = P.Args(kl_in="loss", kl_estimator=estimator, use_bias_correction_kl=correction,
                      loss_agg="token_mean")
        zeros = torch.zeros(1, 6, dtype=torch.float64)

        def on_action(log_pi, a):
            mb = {"response_mask": torch.arange(6)[None] == a, "logprobs": log_old[None],
                  "ref_logprobs": log_ref[None], "advantages": zeros}
            return P.ppo_loss(log_pi[None], zeros, None, mb, 1.0, args)[0]
        return lambda log_pi: sum(log_old[a].exp() * on_action(log_pi, a) for a in range(6))

    def weighted(estimator, weight):  # Σ_a π_old(a)·weight·k(a), by hand
        return lambda log_pi: (log_old.exp() * weight(log_pi)
                               * P.kl_estimate(log_pi, log_ref, estimator)).sum()

    rho = lambda log_pi: (log_pi - log_old).exp()  # noqa: E731
    stopped = lambda log_pi: rho(log_pi).detach()  # noqa: E731
    target = gradient(lambda log_pi: (log_pi.exp() * (log_pi - log_ref)).sum())  # ∇KL(π_θ‖π_ref)
    for estimator in ("k1", "k2", "k3"):
        assert torch.allclose(gradient(loss_term(estimator)), target, atol=1e-12), estimator
    assert gradient(weighted("k1", stopped)).abs().max() < 1e-12  # sg(ρ)·k1: nothing
    assert not torch.allclose(gradient(weighted("k3", stopped)), target, atol=1e-3)
    assert not torch.allclose(gradient(weighted("k2", rho)), target, atol=1e-3)
    assert not torch.allclose(gradient(loss_term("k3", correction=False)), target, atol=1e-3)
    assert (theta.log_softmax(0) - log_old).abs().max() > 0.5  # θ is far from θ_old


def test_adaptive_kl_coefficient():
    # Ziegler et al. 2019: the error is clipped to ±0.2, scaled by batch / horizon
    assert P.adaptive_kl_coef(0.1, 6.0, 5.0, 64, 1000) == pytest.approx(0.1 * (1 + 0.2 * 64 / 1000))
    assert P.adaptive_kl_coef(0.1, 100.0, 5.0, 64, 1000) == pytest.approx(0.1 * (1 + 0.2 * 64 / 1000))
    assert P.adaptive_kl_coef(0.1, 4.5, 5.0, 64, 1000) == pytest.approx(0.1 * (1 - 0.1 * 64 / 1000))
    assert P.adaptive_kl_coef(0.1, 5.0, 5.0, 64, 1000) == 0.1


def test_ppo_loss_adds_the_kl_and_entropy_terms_with_their_gradients():
    """The policy term is L_clip + β·KL − c_H·H, each aggregated as --loss_agg, and its gradient with respect to
    log π_θ and the entropy is that of the formula."""
    gen = torch.Generator().manual_seed(5)
    mask = torch.arange(5) < torch.tensor([5, 2, 3])[:, None]
    mb = {"response_mask": mask, **{k: torch.randn(3, 5, dtype=torch.float64, generator=gen)
                                    for k in ("logprobs", "ref_logprobs", "advantages")}}
    logprobs = (mb["logprobs"] + 0.01 * torch.randn(3, 5, dtype=torch.float64, generator=gen)).requires_grad_()
    entropy = torch.rand(3, 5, dtype=torch.float64, generator=gen).requires_grad_()
    for loss_agg in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
        args = P.Args(kl_in="loss", kl_estimator="k3", entropy_coef=0.3, loss_agg=loss_agg,
                      response_length=5, use_bias_correction_kl=False)
        term, vf_loss, losses, _ = P.ppo_loss(logprobs, entropy, None, mb, 0.2, args)
        agg = lambda x: P.aggregate(x, mask, loss_agg, 5)  # noqa: E731
        pg = agg(P.policy_loss(logprobs, mb["logprobs"], mb["advantages"], None, P.Args())[0])
        kl = agg(P.kl_estimate(logprobs, mb["ref_logprobs"], "k3"))
        assert vf_loss is None and torch.allclose(term, pg + 0.2 * kl - 0.3 * agg(entropy))
        assert torch.allclose(losses["loss/kl_avg"], kl) and torch.allclose(losses["loss/policy_avg"], pg)
        d_logprobs, d_entropy = torch.autograd.grad(term, (logprobs, entropy))
        weights = torch.autograd.grad(agg(entropy), entropy)[0]  # ∂ agg / ∂ x per token
        assert torch.allclose(d_entropy, -0.3 * weights)
        log_ratio = mb["ref_logprobs"] - logprobs.detach()
        ratio = (logprobs.detach() - mb["logprobs"]).exp()
        d_pg = torch.where((ratio - 1).abs() < 0.2, -mb["advantages"] * ratio, 0.0)  # the clip is not active here
        assert torch.allclose(d_logprobs, weights * (d_pg + 0.2 * (1 - log_ratio.exp())))
    reward_kl = P.Args(loss_agg="token_mean")  # the KL in the reward, no entropy bonus
    off = P.ppo_loss(logprobs, entropy, None, mb, 0.2, reward_kl)[0]
    pg = P.policy_loss(logprobs, mb["logprobs"], mb["advantages"], None, P.Args())[0]
    assert torch.allclose(off, P.aggregate(pg, mask, "token_mean", 5))


def test_the_decoupled_loss_against_a_per_token_formula():
    """Decoupled replay (what replay_batch hands ppo_loss), as AReaL: per token w·(the clipped surrogate with
    ρ = π_θ/π_prox) + β·k3 − c_H·H, w = π_prox/μ, or 0 where that exceeds the cap c (the token leaves the policy
    term, not the denominator), then the token mean; KL, entropy and value loss unweighted. Some tokens are masked,
    and some are inside the clip around π_prox but outside it around μ. Fresh tokens (π_prox = μ) give the plain
    loss."""
    gen = torch.Generator().manual_seed(11)
    mask = torch.arange(6) < torch.tensor([6, 3, 4, 5])[:, None]
    rand = lambda scale=1.0: scale * torch.randn(4, 6, dtype=torch.float64, generator=gen)  # noqa: E731
    mu, ref, advantages, values, returns = rand(), rand(), rand(), rand(), rand()
    prox = mu + rand(0.6)  # the sampler μ and the policy at the update's start differ
    new = (prox + rand(0.1)).requires_grad_()
    entropy = torch.rand(4, 6, dtype=torch.float64, generator=gen)
    cap, eps, beta, c_h = 1.5, 0.2, 0.3, 0.05
    mb = {"response_mask": mask, "logprobs": prox, "ref_logprobs": ref, "advantages": advantages, "values": values,
          "returns": returns, "weights": P.rollout_weights(prox, mu, mask, "token_mask", cap)}
    args = P.Args(kl_in="loss", kl_estimator="k3", entropy_coef=c_h, cliprange=eps,
                  response_length=6, loss_agg="token_mean")
    term, vf_loss, *_ = P.ppo_loss(new, entropy, values + 0.1, mb, beta, args)
    expected, n = 0.0, 0
    for i, t in zip(*torch.nonzero(mask, as_tuple=True)):
        w = math.exp(prox[i, t] - mu[i, t])
        w = w if w <= cap else 0.0
        rho = torch.exp(new[i, t] - prox[i, t])
        a = advantages[i, t]
        pg = torch.max(-a * rho, -a * rho.clamp(1 - eps, 1 + eps))
        log_r = ref[i, t] - new[i, t]
        kl = rho * (torch.exp(log_r) - 1 - log_r)  # ρ·k3, ρ around π_prox
        expected, n = expected + w * pg + beta * kl - c_h * entropy[i, t], n + 1
    assert torch.allclose(term, expected / n)
    assert torch.allclose(vf_loss, P.value_loss(values + 0.1, values, returns, mask, 0.2)[0])  # no weight
    assert ((prox - mu).exp()[mask] > cap).any() and ((prox - mu).exp()[mask] < 1).any()  # the cap is at work
    assert (mb["weights"][mask] == 0).any() and (mb["weights"][mask] > 1).any()  # masked, and weights over 1
    inside_prox = ((new - prox).exp() - 1).abs() < eps
    assert (inside_prox & (((new - mu).exp() - 1).abs() > eps) & mask).any()  # the clip's center matters here
    fresh = dict(mb, weights=P.rollout_weights(mu, mu, mask, "token_mask", cap), logprobs=mu)
    plain = dict(mb, logprobs=mu)
    del plain["weights"]
    assert torch.equal(P.ppo_loss(new, entropy, None, fresh, beta, args)[0],
                       P.ppo_loss(new, entropy, None, plain, beta, args)[0])


def test_value_loss_values_and_gradients():
    old = torch.tensor([[0.0, 0.0, 0.0, 1.0]], dtype=torch.float64)
    returns = torch.tensor([[1.0, -1.0, 0.5, 1.0]], dtype=torch.float64)
    mask = torch.ones_like(old, dtype=torch.bool)
    at_old = old.clone().requires_grad_()
    loss, clipfrac = P.value_loss(at_old, old, returns, mask, 0.2)
    loss.backward()
    assert torch.allclose(loss, 0.5 * ((old - returns) ** 2).mean()) and clipfrac == 0
    assert torch.allclose(at_old.grad, (old - returns) / 4)
    # moved past the clip, towards the return: the clipped (larger) loss wins and stops the gradient
    moved = torch.tensor([[0.9, -0.9, 0.1, 1.0]], dtype=torch.float64, requires_grad=True)
    loss, clipfrac = P.value_loss(moved, old, returns, mask, 0.2)
    loss.backward()
    clipped = torch.tensor([[0.2, -0.2, 0.1, 1.0]], dtype=torch.float64)
    assert torch.allclose(loss, 0.5 * torch.max((moved - returns) ** 2, (clipped - returns) ** 2).mean())
    assert moved.grad[0, :2].abs().max() == 0 and moved.grad[0, 2] != 0
    assert torch.isclose(clipfrac, torch.tensor(0.5, dtype=torch.float64))


def test_explained_variance():
    target = torch.randn(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    mask = random_mask((3, 5), 4)
    ev = lambda predicted: P.explained_variance(P.global_mean_var(target - predicted, mask)[1],  # noqa: E731
                                                P.global_mean_var(target, mask)[1])
    assert torch.isclose(ev(target), torch.tensor(1.0, dtype=torch.float64))
    constant = torch.full_like(target, target[mask].mean().item())
    assert torch.isclose(ev(constant), torch.tensor(0.0, dtype=torch.float64))
    assert torch.isclose(ev(0.5 * target), 1 - (0.5 * target[mask]).var() / target[mask].var())


def test_prompt_stream_is_reshuffled_passes_without_repeats():
    n, batch = 10, 4
    stream = torch.cat([P.prompt_indices(n, batch, u, seed=7) for u in range(5)])  # 20 = two passes
    for p in range(2):
        assert sorted(stream[p * n : (p + 1) * n].tolist()) == list(range(n))
    assert stream[:n].tolist() != stream[n:].tolist()
    assert P.prompt_indices(n, batch, 3, seed=7).tolist() == stream[12:16].tolist()
    assert P.prompt_indices(n, n, 1, seed=1).tolist() != P.prompt_indices(n, n, 0, seed=2).tolist()  # seeds differ
    big = P.prompt_indices(3, 7, 0, seed=0).tolist()  # a batch larger than the data: whole passes, then some
    assert sorted(big[:3]) == sorted(big[3:6]) == [0, 1, 2] and len(big) == 7
    for u in range(3):  # under torchrun: 3 ranks split each update's 12 prompts (one pass + 2) into disjoint thirds
        ranks = [P.prompt_indices(n, batch, u, 7, rank, 3) for rank in range(3)]
        assert torch.cat(ranks).tolist() == P.prompt_indices(n, 3 * batch, u, seed=7).tolist()


def test_left_pad():
    ids, mask = P.left_pad([[5, 6], [7], [8, 9, 10]], pad_token_id=0)
    assert ids.tolist() == [[0, 5, 6], [0, 0, 7], [8, 9, 10]]
    assert mask.tolist() == [[False, True, True], [False, False, True], [True, True, True]]


def test_everything_after_the_stop_token_is_masked_out():
    """Whatever sits after the last real token changes no reward, advantage, return or loss."""
    gen = torch.Generator().manual_seed(5)
    mask = torch.arange(6) < torch.tensor([2, 6, 4])[:, None]

    def losses(junk):
        fill = lambda x: torch.where(mask, x, junk)  # noqa: E731
        g = torch.Generator().manual_seed(6)
        logp, ref, values, new_logp, new_values = (fill(torch.randn(3, 6, generator=g)) for _ in range(5))
        kl = torch.where(mask, P.kl_estimate(logp, ref, "k3"), 0.0)
        penalties = torch.where(mask, -0.1 * kl, 0.0)
        rewards = P.per_token_rewards(torch.tensor([1.0, -1.0, 0.5]), penalties, mask)
        advantages, returns = P.gae(rewards, values, mask, 1.0, 0.95)
        advantages = P.masked_whiten(advantages, mask, *P.global_mean_var(advantages, mask))
        per_token, tokens = P.policy_loss(new_logp, logp, advantages, None, P.Args(cliprange_high=0.3, dual_clip=1.5))
        pg = list(P.ratio_stats(tokens, mask).values())
        pg += [P.aggregate(per_token, mask, agg, 6) for agg in ("token_mean", "seq_mean_token_mean",
                                                                  "seq_mean_token_sum_norm")]
        vf = P.value_loss(new_values, values, returns, mask, 0.2)
        return torch.stack([*pg, *vf]), rewards, advantages, returns

    clean, dirty = losses(torch.tensor(0.0)), losses(torch.randn(3, 6, generator=gen) * 100)
    for a, b in zip(clean, dirty):
        assert torch.allclose(a, b) and torch.isfinite(b).all()


# ---------------------------------------------------------------------------------------------------------- tiny models
def loaded(tiny, arch, cls=AutoModelForCausalLM, key=None):
    return P.load_pretrained(cls, tiny[key or arch], "model_name_or_path", P.Args())


def loaded_value(tiny):
    return loaded(tiny, "gpt2", AutoModelForSequenceClassification, "gpt2_rm")


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_captured_logprobs_equal_a_teacher_forced_recomputation(tiny, arch):
    policy = loaded(tiny, arch)
    queries, query_mask = P.left_pad([[5, 6, 7], [8], [9, 10, 11, 12, 13], [14, 15]], pad_token_id=0)
    torch.manual_seed(0)
    responses, logprobs = P.generate(policy, queries, query_mask, 10, 0.7, stop_token_ids=[], pad_token_id=0)
    assert responses.shape == (4, 10)
    query_responses = torch.cat([queries, responses], 1)
    attention_mask = torch.cat([query_mask, torch.ones_like(responses, dtype=torch.bool)], 1)
    recomputed, _ = P.response_logprobs(policy, query_responses, attention_mask, queries.shape[1], 0.7)
    assert torch.allclose(recomputed, logprobs, atol=1e-5)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_extra_left_padding_changes_no_logprob_or_value(tiny, arch):
    policy, value_model = loaded(tiny, arch), loaded(tiny, arch, AutoModelForSequenceClassification, f"{arch}_rm")
    prompts = [[5, 6, 7], [8], [9, 10, 11, 12, 13]]
    ids, mask = P.left_pad([p + [20, 21, 22, 23] for p in prompts], pad_token_id=0)
    more_ids = torch.cat([torch.zeros(3, 4, dtype=torch.long), ids], 1)
    more_mask = torch.cat([torch.zeros(3, 4, dtype=torch.bool), mask], 1)
    with torch.no_grad():
        a = P.response_logprobs(policy, ids, mask, ids.shape[1] - 4, 1.0)[0]
        b = P.response_logprobs(policy, more_ids, more_mask, more_ids.shape[1] - 4, 1.0)[0]
        assert torch.allclose(a, b, atol=1e-5)
        v_a = P.state_values(value_model, ids, mask, ids.shape[1] - 4)
        v_b = P.state_values(value_model, more_ids, more_mask, more_ids.shape[1] - 4)
        assert torch.allclose(v_a, v_b, atol=1e-5)
        if arch == "gpt2":  # the test has teeth: without position_ids the log-probs do move
            no_pos = policy(input_ids=more_ids[:, :-1], attention_mask=more_mask[:, :-1]).logits[:, -4:]
            assert (P.chunked_logprobs(no_pos, more_ids[:, -4:])[0] - a).abs().max() > 1e-3


def test_generation_stops_at_the_stop_token(tiny):
    policy = loaded(tiny, "llama")
    queries, query_mask = P.left_pad([[5, 6], [7, 8, 9]] * 8, pad_token_id=0)
    torch.manual_seed(1)
    free, free_logprobs = P.generate(policy, queries, query_mask, 12, 1.0, stop_token_ids=[], pad_token_id=0)
    stop = int(free[:, 1:-1].flatten().mode().values)  # a token sampled often: some rows stop early, some do not
    torch.manual_seed(1)  # the same draws, so up to its stop token every row is the free sample
    responses, logprobs = P.generate(policy, queries, query_mask, 12, 1.0, stop_token_ids=[stop], pad_token_id=0)
    lengths = P.response_lengths(responses, [stop])
    first_stop = ((free == stop).int().argmax(1) + 1).where((free == stop).any(1), 12)
    assert (lengths < 12).any() and (lengths == first_stop).all()
    for row, n, lp, free_row, free_lp in zip(responses, lengths, logprobs, free, free_logprobs):
        assert (row[n:] == 0).all() and (lp[n:] == 0).all() and (row[: n - 1] != stop).all()
        assert torch.equal(row[:n], free_row[:n]) and torch.allclose(lp[:n], free_lp[:n])


@pytest.mark.parametrize("stop_token_id", [None, [5]])  # EOS the stop id; EOS an action like any other
def test_a_tokenizer_without_a_pad_token_pads_with_eos_and_changes_no_number(tiny, tmp_path, monkeypatch,
                                                                             stop_token_id):
    """The tiny GPT-2 with a tokenizer and config without a pad token (padded with EOS inside the script), against
    the same model with its distinct <pad>: with responses stopping early, the same masks, ids at every real position,
    log-probs, metrics and trained weights; the saved tokenizer and config have no pad token and the base's
    vocabulary size."""
    nopad = tmp_path / "nopad"
    shutil.copytree(tiny["gpt2"], nopad)
    with open(nopad / "config.json") as f:
        stored = json.load(f)
    with open(nopad / "config.json", "w") as f:
        json.dump({**stored, "pad_token_id": None}, f)
    word_tokenizer(WORDS, pad=None).save_pretrained(nopad)
    runs = {}
    for name, path in (("pad", tiny["gpt2"]), ("nopad", str(nopad))):
        calls = spy_on_updates(monkeypatch)
        args = run_args(tiny, tmp_path / name, model_name_or_path=path, stop_token_id=stop_token_id, total_episodes=24)
        P.main(args)
        monkeypatch.undo()
        runs[name] = (calls, read_metrics(args.output_dir), final_weights(args.output_dir), args.output_dir)
    for (a, *_), (b, *_) in zip(runs["pad"][0], runs["nopad"][0], strict=True):
        real = a["attention_mask"]
        assert torch.equal(real, b["attention_mask"]) and torch.equal(a["response_mask"], b["response_mask"])
        assert torch.equal(a["query_responses"][real], b["query_responses"][real])
        assert not torch.equal(a["query_responses"], b["query_responses"])  # padded with 0 and with EOS (1)
        for key in ("logprobs", "ref_logprobs", "values", "advantages", "returns"):
            assert torch.equal(a[key], b[key]), key
    assert any((c["lengths"] < 6).any() for c, *_ in runs["nopad"][0])  # some stopped early
    assert [DETERMINISTIC_KEYS(m) for m in runs["pad"][1]] == [DETERMINISTIC_KEYS(m) for m in runs["nopad"][1]]
    assert all(torch.equal(v, runs["nopad"][2][n][k]) for n in runs["pad"][2] for k, v in runs["pad"][2][n].items())
    policy_dir = os.path.join(runs["nopad"][3], "policy")
    saved = AutoModelForCausalLM.from_pretrained(policy_dir)
    assert AutoTokenizer.from_pretrained(policy_dir).pad_token is None and saved.config.pad_token_id is None
    assert saved.config.vocab_size == saved.get_input_embeddings().num_embeddings == len(WORDS)


def test_a_chat_model_without_a_pad_token_is_saved_as_it_came(tiny, tmp_path):
    """A Llama chat model without a pad token under LoRA: the adapter names the untouched base (no policy_base/
    written), and the adapted policy reloads with the base's vocabulary, no pad token and
    padding_idx None."""
    args = run_args(tiny, tmp_path, model_name_or_path=tiny["chat"], reward_model_path=None, total_episodes=8,
                    reward_fn=[f"{__file__}:chat_words"], dataset=tiny["chat_prompts"], lora_r=4)
    P.main(args)
    listed = ["complete.json", "metrics.jsonl", "policy", "value_model"]
    assert sorted(os.listdir(args.output_dir)) == listed
    policy_dir = os.path.join(args.output_dir, "policy")
    assert P.adapter_base(policy_dir) == tiny["chat"]
    adapted = AutoModelForCausalLM.from_pretrained(policy_dir)  # the base with the adapter on it
    embeddings = adapted.get_input_embeddings()
    assert embeddings.num_embeddings == len(CHAT_WORDS) and adapted.config.pad_token_id is None
    assert embeddings.padding_idx is None
    assert AutoTokenizer.from_pretrained(policy_dir).pad_token is None


@pytest.mark.parametrize("arch,dropout", [("gpt2", dict(resid_pdrop=0.5, embd_pdrop=0.5, attn_pdrop=0.5)),
                                          ("llama", dict(attention_dropout=0.5))])
def test_dropout_is_off_even_in_train_mode(tmp_path, arch, dropout):
    path = str(tmp_path / "dropout")
    AutoModelForCausalLM.from_config(config(arch, len(WORDS), **dropout)).save_pretrained(path)
    model = P.load_pretrained(AutoModelForCausalLM, path, "model_name_or_path", P.Args()).train()
    ids = torch.tensor([[5, 6, 7, 8]])
    assert torch.equal(model(ids).logits, model(ids).logits)


def test_sampling_follows_softmax_of_logits_over_temperature(tiny):
    policy = loaded(tiny, "gpt2")
    queries, query_mask = P.left_pad([[5, 6, 7]] * 20000, pad_token_id=0)
    with torch.no_grad():  # sharpen the tiny model's nearly flat distribution, so that a wrong T shows
        policy.lm_head.weight.mul_(8)
        expected = (policy(queries[:1]).logits[0, -1] / 0.5).softmax(-1)
    torch.manual_seed(0)
    responses, logprobs = P.generate(policy, queries, query_mask, 1, 0.5, stop_token_ids=[], pad_token_id=0)
    frequencies = torch.bincount(responses[:, 0], minlength=len(expected)).float() / len(responses)
    assert (frequencies - expected).abs().max() < 0.015, (frequencies - expected).abs().max()
    assert torch.allclose(logprobs[:, 0], expected.log()[responses[:, 0]], atol=1e-5)


def test_reward_model_with_another_tokenizer_scores_like_unpadded_single_texts(tiny, tmp_path):
    texts = ["w1 w2 w3", "w4", "w5 w6 w7 w8 w9"]
    for key in ("other_rm", "bert"):
        if key == "bert":
            words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"] + [f"w{i}" for i in range(37)]
            backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
            backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
            tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]")
            bert = BertConfig(vocab_size=len(words), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                              intermediate_size=64, num_labels=1)
            model = BertForSequenceClassification(bert).eval()
        else:
            tokenizer = AutoTokenizer.from_pretrained(tiny[key])
            model = loaded(tiny, key, AutoModelForSequenceClassification)
        prompts = SimpleNamespace(texts=texts, messages=[None] * 3)
        batched = P.score_texts(model, tokenizer, prompts, [0, 1, 2], [""] * 3, "cpu")
        single = torch.cat([P.score_texts(model, tokenizer, prompts, [i], [""], "cpu") for i in range(3)])
        assert batched.shape == (3,) and torch.allclose(batched, single, atol=1e-5), key


def test_a_reward_model_with_its_own_tokenizer_reads_chat_prompts_through_its_chat_template(tiny):
    tokenizer = AutoTokenizer.from_pretrained(tiny["other_rm"])
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    model = loaded(tiny, "other_rm", AutoModelForSequenceClassification)
    prompts = SimpleNamespace(texts=["w9 w8", "w1 w2"], messages=[None, [{"role": "user", "content": "w1 w2"}]])
    scores = P.score_texts(model, tokenizer, prompts, [1, 0], ["w3 w4", " w5"], "cpu")
    expected = P.score_texts(model, tokenizer, SimpleNamespace(texts=["user w1 w2 assistant w3 w4 "], messages=[None]),
                             [0], [""], "cpu")
    assert torch.allclose(scores[:1], expected, atol=1e-5)
    plain = P.score_texts(model, tokenizer, SimpleNamespace(texts=["w1 w2"], messages=[None]), [0], ["w3 w4"], "cpu")
    assert not torch.allclose(scores[:1], plain, atol=1e-3)  # the template's words changed the score


def test_chat_messages_use_the_chat_template(tiny):
    tokenizer = AutoTokenizer.from_pretrained(tiny["gpt2"])
    tokenizer.chat_template = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                               "{% if add_generation_prompt %}w9{% endif %}")
    rows = ["w1 w2", [{"role": "user", "content": "w3"}, {"role": "assistant", "content": "w4"}]]
    texts, ids, messages = P.render_prompts(rows, tokenizer, "--dataset")
    assert texts == ["w1 w2", "w3 w9"] and messages[0] is None and messages[1] == rows[1][:1]
    assert ids[1] == tokenizer("w3 w9", add_special_tokens=False)["input_ids"]


def test_trls_prompt_of_messages_rows_are_chat_rows_as_messages_rows_are(tiny, tmp_path):
    """TRL's conversational rows, {"prompt": [messages]}, load as the same rows under `messages` do (a trailing
    assistant turn dropped); a policy tokenizer without a chat template is refused in one line naming both forms."""
    tokenizer = AutoTokenizer.from_pretrained(tiny["chat"])
    rows = [[{"role": "user", "content": f"w{i} w{i + 1}"}] for i in range(3)]
    rows[2] = rows[2] + [{"role": "assistant", "content": "w9"}]
    files = {key: tmp_path / f"{key}.jsonl" for key in ("prompt", "messages")}
    for key, path in files.items():
        path.write_text("".join(json.dumps({key: r, "answer": f"w{i}"}) + "\n" for i, r in enumerate(rows)))
    as_prompt, as_messages = (P.load_prompts(str(path), P.Args(), tokenizer, None) for path in files.values())
    assert vars(as_prompt) == vars(as_messages) and as_prompt.messages == [r[:1] for r in rows]
    assert as_prompt.texts[0] == tokenizer.apply_chat_template(rows[0], tokenize=False, add_generation_prompt=True)
    assert as_prompt.fields == {"answer": ["w0", "w1", "w2"]}
    plain = AutoTokenizer.from_pretrained(tiny["gpt2"])  # no chat template
    for path in files.values():
        with pytest.raises(SystemExit) as exc:
            P.load_prompts(str(path), P.Args(), plain, None)
        head = (f"error: --dataset {str(path)!r}: its chat rows (`messages`, or a `prompt` of "
                "messages) through the policy's chat template: ")
        assert str(exc.value).startswith(head)
        assert "chat_template is not set" in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize("messages", [[], ["hi"], [{"role": "user"}],
                                      [{"role": "user", "content": 3}]])
def test_a_chat_row_not_a_list_of_role_and_content_strings_is_one_line_naming_its_row(
        tiny, tmp_path, messages):
    path = tmp_path / "chat.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "w1 w2"}]})
    path.write_text(f"{good}\n\n{json.dumps({'messages': messages})}\n{good}\n")
    with pytest.raises(SystemExit) as exc:
        P.load_prompts(str(path), P.Args(), AutoTokenizer.from_pretrained(tiny["chat"]), None)
    assert str(exc.value) == (f"error: --dataset {str(path)!r}: row 2 (line 3) is not a text or a "
                              'non-empty list of messages {"role": str, "content": str}')


# ----------------------------------------------------------------------------------------------------------- end to end
def check_run(output_dir, initial_path, metrics, value_init=None):
    assert metrics and all(math.isfinite(v) for m in metrics for v in m.values()), metrics
    for m in metrics:  # every update's rollout sampled from the policy it then trains (π_θ = π_old at first)
        assert abs(m["policy/first_ratio"] - 1) < 1e-5 and abs(m["policy/first_approxkl"]) < 1e-6, m["update"]
    policy = AutoModelForCausalLM.from_pretrained(os.path.join(output_dir, "policy"))
    initial = AutoModelForCausalLM.from_pretrained(initial_path, dtype=torch.float32)  # stored in bf16
    changed = [not torch.equal(a, b) for a, b in zip(policy.state_dict().values(), initial.state_dict().values())]
    assert sum(changed) > len(changed) // 2
    AutoTokenizer.from_pretrained(os.path.join(output_dir, "policy"))
    value_model = AutoModelForSequenceClassification.from_pretrained(os.path.join(output_dir, "value_model"))
    assert value_model.config.num_labels == 1
    start = (AutoModelForSequenceClassification.from_pretrained(value_init, dtype=torch.float32) if value_init
             else initial).state_dict()
    shared = [k for k in value_model.state_dict() if k in start]  # the backbone's weights: the value model trained
    moved = sum(not torch.equal(value_model.state_dict()[k], start[k]) for k in shared)
    assert len(shared) > 10 and moved > len(shared) // 2


def saved_dtypes(folder):
    """The dtypes of a saved model's tensors, and the dtype its config.json names."""
    from safetensors import safe_open
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        kinds = {f.get_slice(k).get_dtype() for k in f.keys()}
    with open(os.path.join(folder, "config.json")) as f:
        return kinds, json.load(f)["dtype"]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_end_to_end_in_process_with_a_reward_model(tiny, tmp_path, capsys, dtype):
    """A policy and reward model stored in bf16, as on the hub, train with fp32 master weights: every metric of every
    update equals that of their fp32 copies (the frozen models are held in --dtype's precision either way);
    --save_dtype writes each in the dtype it names."""
    runs = {}
    for stored in ("bf16", "fp32"):
        suffix = "" if stored == "bf16" else "_fp32"
        args = run_args(tiny, tmp_path / stored, model_name_or_path=tiny["gpt2" + suffix], total_episodes=32,
                        reward_model_path=[tiny["gpt2_rm" + suffix]], stop_token=None, dtype=dtype,
                        save_dtype=stored)
        P.main(args)
        runs[stored] = args.output_dir
        last_line = capsys.readouterr().out.splitlines()[-1]
        assert last_line == f"saved policy and value model ({stored}) to {args.output_dir}"
        for name in ("policy", "value_model"):
            assert saved_dtypes(os.path.join(args.output_dir, name)) == (
                {{"bf16": "BF16", "fp32": "F32"}[stored]}, {"bf16": "bfloat16", "fp32": "float32"}[stored])
    metrics = read_metrics(runs["bf16"])
    assert len(metrics) == 4 and metrics[-1]["episode"] == 32
    assert all(m["val/mean_response_length"] == 6 for m in metrics)
    assert [DETERMINISTIC_KEYS(m) for m in metrics] == [DETERMINISTIC_KEYS(m) for m in read_metrics(runs["fp32"])]
    bf16, fp32 = final_weights(runs["bf16"]), final_weights(runs["fp32"])
    assert all(torch.equal(bf16[n][k], fp32[n][k].to(torch.bfloat16)) for n in fp32 for k in fp32[n])
    check_run(runs["fp32"], tiny["gpt2"], read_metrics(runs["fp32"]), value_init=tiny["gpt2_rm"])


@pytest.fixture(scope="session")
def llama3(tmp_path_factory):
    """A checkpoint shaped as Llama 3's on the hub: a 128,256-token vocabulary (tied, a tiny hidden size) in bf16
    safetensors, a config.json without a dtype field, no pad token, and three stop ids in generation_config.json."""
    root = tmp_path_factory.mktemp("llama3")
    specials = {128000: "<|begin_of_text|>", 128001: "<|end_of_text|>", 128008: "<|eom_id|>", 128009: "<|eot_id|>"}
    words = [specials.get(i, f"w{i}") for i in range(128_256)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=specials[128000], eos_token=specials[128001])
    torch.manual_seed(0)
    llama = LlamaConfig(vocab_size=len(words), hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                        tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001, pad_token_id=None)
    model = AutoModelForCausalLM.from_config(llama)
    model.generation_config.eos_token_id = [128001, 128008, 128009]
    path = save_as_hub(model, root / "policy", tokenizer)
    with open(os.path.join(path, "config.json")) as f:
        stored = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({k: v for k, v in stored.items() if k not in ("dtype", "torch_dtype")}, f)
    return path


def test_a_llama_3_checkpoint_ends_at_each_of_its_stop_ids_and_its_bf16_storage_is_read_off_the_weights(llama3,
                                                                                                      capsys):
    """Every eos_token_id of the generation config's list is a stop id; a config without a dtype field leaves the
    storage dtype to the safetensors (BF16), so --dtype fp16 warns of bf16's range."""
    args = P.Args(model_name_or_path=llama3, dtype="fp16")
    config = AutoConfig.from_pretrained(llama3)
    assert getattr(config, "dtype", None) is None and getattr(config, "torch_dtype", None) is None
    tokenizer = AutoTokenizer.from_pretrained(llama3)
    assert P.resolve_stop_token_ids(args, tokenizer, llama3, config) == [128001, 128008, 128009]
    P.check_configs(args, llama3)
    assert P.stored_dtype(llama3, config) == torch.bfloat16
    assert "stored in bf16, whose range fp16 lacks" in capsys.readouterr().err


def test_a_gathered_state_writes_tied_embeddings_once_and_reloads_tied(tiny, tmp_path):
    """A state gathered over ranks (FSDP2's full state dict, or one moved off a GPU) holds the tied output layer as a
    copy of the embedding, sharing no storage: save_weights writes it once, as the hub does, and from_pretrained ties
    it back, to the same logits."""
    from safetensors import safe_open
    model = loaded(tiny, "chat", key="chat")
    gathered = {k: v.clone() for k, v in model.state_dict().items()}
    assert "lm_head.weight" in gathered
    P.save_weights(model, str(tmp_path / "saved"), gathered, torch.float32)
    with safe_open(str(tmp_path / "saved" / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"))
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(reloaded(ids).logits, model(ids).logits)


def test_the_reward_model_scores_each_response_at_its_last_real_token(tiny, tmp_path, monkeypatch):
    """What main() scores with a reward model that shares the policy's vocabulary: its score head read at the last
    real token of prompt + response, computed here on each sequence alone, without padding."""
    calls = spy_on_updates(monkeypatch)
    P.main(run_args(tiny, tmp_path, stop_token_id=5, local_rollout_forward_batch_size=3, seed=3))
    reward_model = loaded(tiny, "gpt2", AutoModelForSequenceClassification, "gpt2_rm")
    assert min(batch["lengths"].min() for batch, *_ in calls) < 6  # responses of several lengths
    for batch, *_ in calls:
        for ids, mask, n, score in zip(batch["query_responses"], batch["attention_mask"], batch["lengths"],
                                       batch["raw_scores"]):
            sequence = ids[: batch["context_length"] + n][mask[: batch["context_length"] + n]][None]
            with torch.no_grad():
                expected = reward_model.score(reward_model.transformer(sequence).last_hidden_state[0, -1])[0]
            assert torch.isclose(score, expected, atol=1e-5), (score, expected)


def test_end_to_end_cli_with_a_reward_function(tiny, tmp_path):
    out = str(tmp_path / "cli")
    cmd = [sys.executable, SCRIPT, "--model_name_or_path", tiny["llama"], "--reward_fn", f"{__file__}:count_w1",
           "--dataset", tiny["txt"], "--output_dir", out, "--total_episodes", "24", "--per_device_train_batch_size",
           "4", "--gradient_accumulation_steps", "2", "--num_mini_batches", "2", "--response_length", "5",
           "--stop_token_id", "4", "--kl_estimator", "k3", "--whiten_rewards", "--target_kl", "10",
           "--num_sample_generations", "1"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    metrics = read_metrics(out)
    assert len(metrics) == 3 and "'w" in result.stdout  # sample completions were printed
    lines = [line for line in result.stdout.splitlines() if line.startswith("update ")]
    assert len(lines) == 3 and all(re.search(r"\| \d\d:\d\d:\d\d, eta \d\d:\d\d:\d\d$", line) for line in lines)
    assert lines[-1].endswith("eta 00:00:00")
    check_run(out, tiny["llama"], metrics)


def test_reward_model_with_another_tokenizer_end_to_end(tiny, tmp_path):
    args = run_args(tiny, tmp_path, model_name_or_path=tiny["llama"], reward_model_path=[tiny["other_rm"]],
                    local_rollout_forward_batch_size=3)
    P.main(args)
    check_run(args.output_dir, tiny["llama"], read_metrics(args.output_dir))
    # the value model reads the policy's token ids, so it starts from the policy, not from this reward model
    value_model = AutoModelForSequenceClassification.from_pretrained(os.path.join(args.output_dir, "value_model"))
    value_config = value_model.config
    assert value_config.vocab_size == len(WORDS)


def test_several_reward_sources_give_the_weighted_score_and_log_their_spread(tiny, tmp_path, monkeypatch, capsys):
    """Two reward models with different tokenizers and a reward function: each source scores as it does alone (the
    same first rollout: scoring draws no random numbers), the score is Σ w_i·s_i (unset weights: the mean), and the
    metrics hold each source's mean and the reward models' spread, mean over rows of std(s_rm0, s_rm1) = |s0 − s1|/2,
    also on the held-out prompts."""
    calls, scored, real_score = spy_on_updates(monkeypatch), [], P.score
    monkeypatch.setattr(P, "score", lambda *a, **kw: scored.append(real_score(*a, **kw)) or scored[-1])
    sources = dict(reward_model_path=[tiny["gpt2_rm"], tiny["other_rm"]], reward_fn=[f"{__file__}:num_words"])
    rms = sources["reward_model_path"]
    runs = {"all": dict(**sources, reward_weights=[0.5, 0.3, -0.2]), "rms": dict(reward_model_path=rms,
                                                                                 eval_dataset=tiny["txt"]),
            "rm0": dict(reward_model_path=rms[:1]), "rm1": dict(reward_model_path=rms[1:]),
            "fn0": dict(reward_model_path=None, reward_fn=sources["reward_fn"])}
    batches, metrics, last_scored = {}, {}, {}
    for name, flags in runs.items():
        args = run_args(tiny, tmp_path / name, total_episodes=8, stop_token_id=5, seed=3, **flags)
        P.main(args)
        batches[name], metrics[name], last_scored[name] = calls[-1][0], read_metrics(args.output_dir)[0], scored[-1]
    assert all(torch.equal(b["query_responses"], batches["all"]["query_responses"]) for b in batches.values())
    alone = torch.stack([batches[name]["raw_scores"] for name in ("rm0", "rm1", "fn0")], 1)  # (B, 3)
    assert torch.allclose(batches["all"]["source_scores"], alone, atol=1e-6)
    assert not torch.allclose(alone[:, 0], alone[:, 1], atol=1e-3) and alone[:, 2].abs().sum() > 0
    assert torch.allclose(batches["all"]["raw_scores"], alone @ torch.tensor([0.5, 0.3, -0.2]), atol=1e-6)
    assert torch.allclose(batches["rms"]["raw_scores"], alone[:, :2].mean(1), atol=1e-6)
    m = metrics["all"]
    for j, name in enumerate(["gpt2_rm", "other_rm", "num_words"]):  # folders', the function's
        assert m[f"objective/raw_scores/{name}"] == pytest.approx(alone[:, j].mean().item(), abs=1e-6)
    spread = ((alone[:, 0] - alone[:, 1]).abs() / 2).mean().item()
    assert m["objective/rm_spread"] == pytest.approx(spread, abs=1e-6) == metrics["rms"]["objective/rm_spread"]
    assert "objective/rm_spread" not in metrics["rm0"]
    assert "objective/raw_scores/gpt2_rm" not in metrics["rm0"]
    out = capsys.readouterr().out
    assert f"rm_spread {spread:.3f}" in out
    held_out = last_scored["rms"]["source_scores"]  # the evaluation after the last update: the .txt file's 3 prompts
    assert len(held_out) == 3 and metrics["rms"]["eval/rm_spread"] == pytest.approx(
        ((held_out[:, 0] - held_out[:, 1]).abs() / 2).mean().item(), abs=1e-6)
    assert f"rm_spread {metrics['rms']['eval/rm_spread']:.3f}  (held-out" in out


def test_a_trl_style_reward_function_gets_the_values_of_each_row(tiny, tmp_path, monkeypatch):
    """A reward function written for TRL (prompts, completions, completion_ids, answer, trainer_state, **kwargs) under
    GRPO with k = 4: each completion comes with its own row's answer and other fields (None where the row lacks one),
    the 4 responses to a prompt with that row's values 4 times, its token ids up to the stop id, the updates done; the
    held-out evaluation passes its own file's fields."""
    monkeypatch.setenv("REWARD_LOG", str(tmp_path / "log"))
    calls = spy_on_updates(monkeypatch)
    args = run_args(tiny, tmp_path, reward_model_path=None, reward_fn=[f"{__file__}:answer_matches"],
                    dataset=tiny["answers"], eval_dataset=tiny["answers_eval"], total_episodes=24, num_generations=4,
                    advantage_estimator="grpo", stop_token_id=5, num_sample_generations=3)
    P.main(args)
    tokenizer = AutoTokenizer.from_pretrained(tiny["gpt2"])
    rows = {r["prompt"]: r for path in (tiny["answers"], tiny["answers_eval"]) for r in read_lines(path)}
    logged = read_lines(tmp_path / "log.0")
    training = [c for c in logged if c["prompts"][0] in {r["prompt"] for r in read_lines(tiny["answers"])}]
    assert len(logged) == 3 + 3 and len(training) == 3  # 3 updates, each followed by an evaluation
    for call in logged:
        assert call["answer"] == [rows[p]["answer"] for p in call["prompts"]]
        assert call["fields"] == {"note": [rows[p].get("note") for p in call["prompts"]]}  # None where absent
        for completion, ids in zip(call["completions"], call["completion_ids"]):
            assert tokenizer.decode(ids, skip_special_tokens=True) == completion
            assert 5 not in ids[:-1] and (ids[-1] == 5 or len(ids) == 6)  # up to and including the stop id
    for update, (call, (batch, *_)) in enumerate(zip(training, calls)):
        assert call["state"] == {"global_step": update, "max_steps": 3, "epoch": update * 2 / 40}  # 2 prompts each
        assert all(call["prompts"][i] == call["prompts"][i - i % 4] for i in range(8))  # a group: one row, 4 times
        responses = batch["query_responses"][:, batch["context_length"]:]
        assert call["completion_ids"] == [r[:n] for r, n in zip(responses.tolist(), batch["lengths"].tolist())]
        assert batch["raw_scores"].tolist() == answer_matches(call["prompts"], call["completions"], [], call["answer"],
                                                              SimpleNamespace())
    evaluations = [c for c in logged if c not in training]
    assert [c["state"]["global_step"] for c in evaluations] == [1, 2, 3]
    assert all(c["prompts"] == [r["prompt"] for r in read_lines(tiny["answers_eval"])] for c in evaluations)


def test_chat_rows_reach_a_reward_function_as_messages(tiny, tmp_path, monkeypatch):
    """Chat rows: a TRL-style function (the shape of TRL's accuracy_reward) gets each row's messages without a
    trailing assistant turn and [{"role": "assistant", "content": text}], with the row's `solution`."""
    monkeypatch.setenv("REWARD_LOG", str(tmp_path / "log"))
    args = run_args(tiny, tmp_path, model_name_or_path=tiny["chat"], reward_model_path=None,
                    reward_fn=[f"{__file__}:accuracy_reward"], dataset=tiny["chat_solutions"], total_episodes=16)
    P.main(args)
    rows = read_lines(tiny["chat_solutions"])
    messages = [r["messages"][:1] for r in rows]  # the last row's assistant turn dropped
    calls = read_lines(tmp_path / "log.0")
    assert len(calls) == 2
    for call in calls:
        assert all(p in messages for p in call["prompts"]) and [messages[7]] != [rows[7]["messages"]]
        assert call["solution"] == [rows[messages.index(p)]["solution"] for p in call["prompts"]]
        assert all(c == [{"role": "assistant", "content": c[0]["content"]}] for c in call["completions"])


def test_a_none_score_leaves_its_source_out_and_async_functions_run(tiny, tmp_path, monkeypatch):
    """A None from a reward function leaves that source out of the row's weighted sum (TRL's meaning); its logged
    mean is over the rows it scored. An async def function is run to completion."""
    calls = spy_on_updates(monkeypatch)
    args = run_args(tiny, tmp_path, reward_model_path=None, total_episodes=8, reward_weights=[0.5, 2.0],
                    reward_fn=[f"{__file__}:none_for_first", f"{__file__}:async_count_w1"])
    P.main(args)
    batch = calls[0][0]
    counts = torch.tensor(count_w1(None, batch["completions"]))
    assert torch.allclose(batch["raw_scores"], torch.cat([2 * counts[:1], 0.5 + 2 * counts[1:]]))
    m = read_metrics(args.output_dir)[0]
    assert batch["source_scores"][0, 0].isnan() and m["objective/raw_scores/none_for_first"] == 1
    args = run_args(tiny, tmp_path / "twice", total_episodes=8,
                    reward_fn=[f"{__file__}:num_words"] * 2)
    P.main(args)  # a suffix (the position among the sources) only where two names clash
    names = {k for k in read_metrics(args.output_dir)[0] if k.startswith("objective/raw_scores/")}
    assert names == {f"objective/raw_scores/{n}" for n in ("gpt2_rm", "num_words_1", "num_words_2")}


def test_rows_no_source_scores_leave_their_group_and_the_loss_and_the_run_goes_on(
        tiny, tmp_path, monkeypatch, capsys):
    """GRPO k = 4 with a function that returns None for every response to some prompts (whole
    groups) and for half the responses to others (part of a group): the run goes to its end; those
    rows are out of the loss and out of their group's baseline and std (the rest of the group is
    baselined alone); one warning line per update names their --dataset rows; the metrics are
    means over the scored rows; a held-out None is null in samples.jsonl."""
    calls = spy_on_updates(monkeypatch)
    args = run_args(tiny, tmp_path, reward_model_path=None, dataset=tiny["answers"],
                    reward_fn=[f"{__file__}:none_where_ungradable"], advantage_estimator="grpo",
                    num_generations=4, total_episodes=80, eval_dataset=tiny["answers_eval"],
                    num_sample_generations=2)
    P.main(args)
    metrics, warned = read_metrics(args.output_dir), capsys.readouterr().err.splitlines()
    assert len(metrics) == 10 and all(math.isfinite(m["objective/scores"]) for m in metrics)
    whole = part = 0
    for update, ((batch, *_), m) in enumerate(zip(calls, metrics)):
        scored, loss_mask, scores = batch["scored"], batch["loss_mask"], batch["scores"]
        assert not loss_mask[~scored].any() and m["objective/scores"] == pytest.approx(
            scores[scored].mean().item())
        for g in range(len(scores) // 4):
            group = slice(4 * g, 4 * g + 4)
            n = scored[group].sum().item()
            whole, part = whole + (n == 0), part + (0 < n < 4)
            if n == 2:  # the scored half is baselined alone
                rows = torch.arange(4 * g, 4 * g + 4)[scored[group]]
                s = scores[rows]
                last = batch["lengths"][rows] - 1
                baselined = batch["rewards"][rows, last] - batch["penalties"][rows, last]
                assert torch.allclose(baselined, (s - s.mean()) / (s.std() + 1e-4), atol=1e-5)
                assert loss_mask[rows].any(1).all()
        lines = [line for line in warned if line.startswith(f"warning: update {update + 1}: ")]
        assert len(lines) == (not scored.all())
        if lines:
            assert "--dataset row " in lines[0] and "(line " in lines[0]
    assert whole and part  # both kinds met
    samples = read_lines(os.path.join(args.output_dir, "samples.jsonl"))
    assert [s["score"] is None for s in samples[:3]] == [False, True, False]  # w30, w31, w32


def test_a_reward_function_gets_the_columns_it_names_and_a_reward_model_covers_none_from_every_function(tiny):
    """A function that names a dataset column (no **kwargs) gets that column's values of its rows by keyword; where a
    reward model scores the rows, None from every function is no error (the reward model's score stands)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny["gpt2"])
    prompts = P.load_prompts(tiny["answers"], P.Args(), tokenizer, None)
    seen = []

    def grade(completions, answer):
        seen.append(answer)
        return [float(c == a) for c, a in zip(completions, answer)]

    rows, completions = [0, 3, 5], ["w0", "w2", "w5"]  # answers w0, w3, w5
    fields = {"dataset": list(prompts.fields)}
    models = SimpleNamespace(reward_fns=[(grade, "grade", P.reward_call(grade, "grade", fields))], reward_models=[])
    scores = P.reward_function_scores(models, prompts, rows, completions, [[4]] * 3, None)
    assert seen == [["w0", "w3", "w5"]] and scores[:, 0].tolist() == [1.0, 0.0, 1.0]
    models = SimpleNamespace(reward_fns=[(none_for_all, "none_for_all", None)], reward_models=[])
    assert P.reward_function_scores(models, prompts, rows, completions, [[4]] * 3, None).isnan().all()


def readme_section(section):
    """The text of one `## ` section of README.md (its `### ` subsections included)."""
    text = open(os.path.join(HERE, "README.md")).read()
    return text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]


def readme_bash_blocks(section):
    """The ```bash blocks of one `## ` section of README.md."""
    return re.findall(r"```bash\n(.*?)```", readme_section(section), re.S)


def test_the_readmes_replay_commands_parse_and_pass_the_flag_checks():
    """The five commands of the README's replay comparison, as written: tyro parses them and check_args passes."""
    blocks = [b for b in readme_bash_blocks("What was measured") if "--replay_rounds" in b]
    block = blocks[0].replace("\\\n", " ")
    commands = [line.split("#")[0].split("ppo_rlhf.py", 1)[1].split() for line in block.splitlines()
                if "ppo_rlhf.py" in line]
    parsed = [tyro.cli(P.Args, args=argv) for argv in commands]
    assert [(a.replay_rounds, a.replay_correction, a.per_device_train_batch_size) for a in parsed] == [
        (0, None, 128), (5, "naive", 128), (5, "decoupled", 128), (5, "decoupled", 32), (0, None, 32)]
    assert all(P.check_args(a).num_updates in (400, 1600) for a in parsed)


def test_the_readme_reads_in_one_sitting_and_names_no_line_of_the_code():
    """At most 400 lines and 40 KB; it names functions, never line numbers of ppo_rlhf.py (a
    hand-kept map of line ranges goes stale with every commit)."""
    text = open(os.path.join(HERE, "README.md"), "rb").read()
    assert len(text.splitlines()) <= 400 and len(text) <= 40_000
    pattern = r"\blines? \d+|ppo_rlhf\.py[:#]L?\d+|#L\d+"
    assert re.findall(pattern, text.decode(), re.I) == []


def test_every_section_of_what_was_measured_says_where_its_figures_come_from():
    """Each `### ` subsection: a commit, a date, a machine and a thread count."""
    subsections = readme_section("What was measured").split("\n### ")[1:]
    assert len(subsections) >= 5
    for sub in subsections:
        assert re.search(r"\b(?=[0-9]*[a-f])[0-9a-f]{7,40}\b", sub), sub[:60]  # a commit
        assert re.search(r"\b20\d\d-\d\d-\d\d\b", sub), sub[:60]  # a date
        assert re.search(r"AMD EPYC|Intel Xeon|this machine", sub, re.I), sub[:60]
        assert re.search(r"OMP_NUM_THREADS|thread", sub), sub[:60]


def readme_sample_columns(line):
    """A start or update line without what differs from run to run or with the run's length: the
    update count and the output folder, and from the first `|` on (seconds, memory, clock); and
    the sign of a zero (update 1's KL is 0 up to the last bits, whose sign differs across CPUs)."""
    line = re.sub(r"^(update [01]/|ppo_rlhf: )\d+", r"\1N", line.split("|")[0])
    return re.sub(r"-(0\.0+ )", r"\1", re.sub(r"output \S+;", "output X;", line))


def test_the_readmes_sample_output_is_what_a_seed_1_run_prints(tmp_path, capsys):
    """The README's first lines of the default run equal a seed-1 run's: the start line, the
    evaluation before training (its line and samples) and update 1's metrics, as printed (`kl
    -0.000` as `kl 0.000`). One update suffices: the learning rate of update 1 is the initial one
    for any number of updates, and the evaluations have their own random stream."""
    readme = open(os.path.join(HERE, "README.md")).read().splitlines()
    start = next(i for i, line in enumerate(readme) if line.startswith("ppo_rlhf: 400 updates"))
    end = next(i for i, line in enumerate(readme) if line.startswith("update 1/400 "))
    shown = readme[start : end + 1]
    assert shown[1] == "flags: (the defaults)" and shown[2] == "update 0/400  before training"
    P.main(P.Args(output_dir=str(tmp_path / "run"), total_episodes=128))
    printed = capsys.readouterr().out.splitlines()[: len(shown)]
    assert printed[1] == "flags: --total_episodes 128"  # the one flag given
    assert [readme_sample_columns(x) for x in shown[:1] + shown[2:]] == [
        readme_sample_columns(x) for x in printed[:1] + printed[2:]]


def help_flags(capsys):
    """Every flag `--help` lists (tyro spells them with `-`)."""
    capsys.readouterr()
    with pytest.raises(SystemExit):
        tyro.cli(P.Args, args=["--help"])
    return set(re.findall(r"--[a-z][a-z0-9-]*", capsys.readouterr().out))


def readme_family_rows():
    """[(the flags of its first cell, the row)] for each row of the README's PPO family table."""
    lines = readme_section("The PPO family").splitlines()
    rows = [line for line in lines if line.startswith("| `--")]
    return [(re.findall(r"--[a-z_]+", row.split(" | ")[0]), row) for row in rows]


def test_every_flag_the_readme_runs_ppo_rlhf_with_and_every_family_flag_exists(capsys):
    """A flag on a README line that runs ppo_rlhf.py (continuation lines joined; torchrun's and
    pip's flags come before it), and every flag of the family table, is one `--help` lists."""
    text = open(os.path.join(HERE, "README.md")).read().replace("\\\n", " ")
    flags = set()
    for line in text.splitlines():
        for rest in re.findall(r"(?<![\w/])ppo_rlhf\.py\b([^`#|;&]*)", line):
            flags.update(re.findall(r"(?<!\S)--[a-zA-Z][\w-]*", rest))
    assert {"--replay_rounds", "--reward_fn", "--distributed"} <= flags  # the commands were read
    family = {flag for flags, _ in readme_family_rows() for flag in flags}
    known = help_flags(capsys)
    unknown = {f for f in flags | family if f.replace("_", "-") not in known}
    assert unknown == set()


def test_every_algorithmic_switch_is_in_the_family_table_or_the_real_models_section():
    """Every Args field not in RUN_ONLY_FIELDS (but --seed, which picks random streams and no
    formula) is a flag of the family table or of the real-models section. Each value of a family
    switch is an entry of its own in its rows: a word of the flag cell, or `value` in the formula
    cell (a word elsewhere, another column's or another row's, does not count); a real-models
    switch's value is named in that section."""
    rows = readme_family_rows()
    real = readme_section("Running on real models and at scale")
    for field in set(P.Args.__dataclass_fields__) - P.RUN_ONLY_FIELDS - {"seed"}:
        cells = [row.split(" | ") for flags, row in rows if f"--{field}" in flags]
        assert cells or re.search(rf"`--{field}\b", real), field
        for value in [v for v in switch_values(field) if isinstance(v, str)]:  # a Literal's
            own = rf"(?<![\w-]){re.escape(value)}(?![\w-])"
            named = any(re.search(own, c[0]) or f"`{value}`" in c[1] for c in cells) if cells else (
                re.search(own, real))
            assert named, f"--{field} {value}: no entry of its own in its row of the family table"


def test_the_readmes_own_model_example_runs_and_its_function_sees_each_rows_answer(tiny, tmp_path):
    """The README's example of one's own model, reward and data, as written (its files by its
    heredocs, its command), with the tiny chat model in place of the hub one and small sizes
    appended (the last value of a flag wins); a spy around its reward function records what it was
    given: each chat prompt with its own row's answer."""
    block = readme_bash_blocks("Your model, your reward, your data")[0]
    assert len(block.splitlines()) <= 15
    setup, command = block.split("python ppo_rlhf.py ", 1)
    subprocess.run(["bash", "-c", setup], cwd=tmp_path, check=True)
    with open(tmp_path / "my_reward.py", "a") as f:
        f.write("\n\nimport json\n_accuracy = accuracy\n\n\ndef accuracy(completions, answer, **kwargs):\n"
                "    with open('seen.jsonl', 'a') as f:\n"
                "        f.write(json.dumps({'prompts': kwargs['prompts'], 'answer': answer}) + '\\n')\n"
                "    return _accuracy(completions, answer, **kwargs)\n")
    flags = command.replace("\\\n", " ").split() + [
        "--model_name_or_path", tiny["chat"], "--dtype", "fp32", "--response_length", "6",
        "--per_device_train_batch_size", "8", "--total_episodes", "16",
        "--output_dir", str(tmp_path / "run")]
    result = subprocess.run([sys.executable, SCRIPT, *flags], cwd=tmp_path, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_lines(tmp_path / "rows.jsonl")
    seen = read_lines(tmp_path / "seen.jsonl")
    assert len(seen) == 2 and all(len(call["prompts"]) == 8 for call in seen)
    for call in seen:
        for prompt, answer in zip(call["prompts"], call["answer"]):
            assert answer == next(r["answer"] for r in rows if r["messages"] == prompt)
    assert len(read_metrics(tmp_path / "run")) == 2


def test_a_reward_module_is_imported_from_the_current_folder(tiny, tmp_path, monkeypatch):
    """--reward_fn module:function finds a module in the current folder, as `python -m` would (sys.path[0] is the
    script's folder)."""
    (tmp_path / "my_rewards_here.py").write_text("def length(completions, **kwargs):\n"
                                                 "    return [float(len(c.split())) for c in completions]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    calls = spy_on_updates(monkeypatch)
    P.main(run_args(tiny, tmp_path, reward_model_path=None, reward_fn=["my_rewards_here:length"], total_episodes=8))
    batch = calls[0][0]
    assert batch["raw_scores"].tolist() == [float(len(c.split())) for c in batch["completions"]]


def test_printed_samples_are_of_distinct_prompts(tiny, tmp_path, capsys):
    """With k responses per prompt the three printed training samples are of three prompts, not one prompt k times."""
    P.main(run_args(tiny, tmp_path, reward_model_path=None, reward_fn=[f"{__file__}:num_words"], total_episodes=8,
                    num_generations=4, advantage_estimator="grpo", num_sample_generations=1, eval_dataset=None))
    prompts = [line.split(" -> ")[0] for line in capsys.readouterr().out.splitlines() if line.startswith("    '")]
    assert len(prompts) == 2 and len(set(prompts)) == 2  # 8 responses: 2 prompts x 4


def test_the_built_in_reward_reads_the_token_ids():
    """1 for the sum then EOS; the partial credit for the sum then anything else, <pad> and <unk> included (the
    decoded text drops them, and the text-based reward once scored them 1); 0 otherwise."""
    ids = lambda *words: [P.ADDITION_WORDS.index(w) for w in words]  # noqa: E731
    completions = [ids("7", "<eos>"), ids("7", "<pad>"), ids("7", "<unk>"), ids("7", "3"), ids("6", "<eos>"),
                   ids("<eos>"), ids("=", "7")]
    partial = P.ADDITION_PARTIAL_CREDIT
    assert 0 < partial < 1
    assert P.addition_reward(completions, ["7"] * 7) == [1.0, partial, partial, partial, 0.0, 0.0, 0.0]
    longer = [ids("7", "3", "<eos>"), ids("7", "<pad>", "<eos>"), ids("7", "<eos>"), ids("3", "7", "<eos>")]
    assert P.addition_reward(longer, ["7"] * 4) == [partial, partial, 1.0, 0.0]  # at --response_length 3 or more


@pytest.mark.parametrize("format,replay", [(None, False), (1, False), (3, False), (4, True),
                                           (4, False)])
def test_a_checkpoint_of_another_format_is_refused_in_one_line(tmp_path, format, replay):
    """state.pt carries CHECKPOINT_FORMAT; one without it (or of another) was written by another
    version. Format 3 (replay buffers inside state.pt) and 4 with a replay buffer (phase 4's inputs,
    not its output) are refused on resume, but still exported; 4 without replay resumes (5 changed
    nothing else)."""
    replay_flags = dict(replay_rounds=1, replay_correction="naive") if replay else {}
    args = P.Args(output_dir=str(tmp_path / "run"), total_episodes=256, save_every=1,
                  num_sample_generations=0, eval_on_start=False, **replay_flags)
    P.main(args)
    path = os.path.join(args.output_dir, "checkpoint-000001")
    state = torch.load(os.path.join(path, "state.pt"), weights_only=True)
    assert state["format"] == P.CHECKPOINT_FORMAT == 5
    state["format"] = format
    torch.save({k: v for k, v in state.items() if v is not None}, os.path.join(path, "state.pt"))
    if format == 4 and not replay:
        assert P.main(dataclasses.replace(args, resume=path))["update"] == 2
        return
    with pytest.raises(SystemExit, match=f"another version of ppo_rlhf.py \\(checkpoint format {format}") as exc:
        P.main(dataclasses.replace(args, resume=path))
    assert "\n" not in str(exc.value) and len(read_metrics(args.output_dir)) == 2
    if format in (3, 4):
        how = "export it (--export_checkpoint --resume FOLDER) and start a new run"
        assert str(exc.value).endswith(f"; {how} from the exported policy")
        exported = str(tmp_path / "exported")
        P.main(dataclasses.replace(args, resume=path, export_checkpoint=True, output_dir=exported))
        with open(os.path.join(exported, "complete.json")) as f:
            assert json.load(f)["updates"] == 1
        weights, policy = checkpoint_state(path)["model"], final_weights(exported)["policy"]
        assert len(policy) > 10
        assert all(torch.equal(v, weights[f"policy.{k}"]) for k, v in policy.items())


@pytest.mark.parametrize("dtype,gradient_checkpointing", [("bf16", False), ("fp16", False), ("fp32", True)])
def test_end_to_end_mixed_precision_and_checkpointing(tiny, tmp_path, monkeypatch, dtype, gradient_checkpointing):
    args = run_args(tiny, tmp_path, dtype=dtype, gradient_checkpointing=gradient_checkpointing, missing_eos_penalty=1.0)
    block_calls, real = [], P.ppo_epochs

    def counting(model, optimizer, scaler, batch, *rest):  # the first block's MLP forwards in the PPO epochs
        if dtype != "fp32":  # log π_old is the training forward's under autocast, bit for bit (not the sampler's)
            ids = batch["query_responses"][:, : batch["context_length"] + batch["lengths"].max()]
            with torch.no_grad(), torch.autocast("cpu", dtype={"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]):
                logprobs = P.response_logprobs(model.policy, ids, batch["attention_mask"][:, : ids.shape[1]],
                                               batch["context_length"], 1.0)[0]
            mask = batch["response_mask"][:, : logprobs.shape[1]]
            assert torch.equal(batch["logprobs"][:, : logprobs.shape[1]][mask], logprobs[mask])
        hook = model.policy.transformer.h[0].mlp.register_forward_pre_hook(lambda *_: block_calls.append(1))
        try:
            return real(model, optimizer, scaler, batch, *rest)
        finally:
            hook.remove()

    monkeypatch.setattr(P, "ppo_epochs", counting)
    P.main(args)
    # 2 updates x 2 epochs x 2 minibatches forwards; gradient checkpointing runs each block again in backward
    assert len(block_calls) == 8 * (2 if gradient_checkpointing else 1)
    metrics = read_metrics(args.output_dir)
    check_run(args.output_dir, tiny["gpt2"], metrics, value_init=tiny["gpt2_rm"])
    policy = AutoModelForCausalLM.from_pretrained(os.path.join(args.output_dir, "policy"))
    assert next(policy.parameters()).dtype == torch.float32  # fp32 master weights


def test_low_precision_on_a_cpu_without_its_units_gets_one_note_at_the_start(tmp_path, monkeypatch,
                                                                              capsys):
    """bf16 autocast on a CPU whose flags lack avx512_bf16 and amx_bf16 (fp16: avx512_fp16,
    amx_fp16) is slower than fp32: one note on stdout; none with the units, under fp32, or where
    /proc/cpuinfo cannot be read."""
    cpuinfo = tmp_path / "cpuinfo"
    monkeypatch.setattr(P, "CPUINFO", str(cpuinfo))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the run's device is the CPU
    cases = [("fpu sse2 avx512f", "bf16", True), ("fpu avx512_bf16", "bf16", False),
             ("fpu amx_bf16", "bf16", False), ("fpu avx512_bf16", "fp16", True),
             ("fpu amx_fp16", "fp16", False), ("fpu", "fp32", False), (None, "bf16", False)]
    for flags, dtype, noted in cases:
        if flags:
            cpu = f"processor\t: 0\nflags\t\t: {flags}\n\n"
            cpuinfo.write_text(cpu + cpu.replace(": 0", ": 1"))
        else:  # unreadable
            cpuinfo.unlink()
        P.start_processes(P.Args(dtype=dtype))
        note = (f"note: --dtype {dtype} runs slower than fp32 on this CPU (no avx512_{dtype} or "
                f"amx_{dtype} in {cpuinfo}); choose it to match a GPU run's numbers\n")
        assert capsys.readouterr().out == (note if noted else ""), (flags, dtype)


def test_an_fp16_checkpoint_trains_under_fp16_and_a_bf16_one_gets_a_warning(tiny, tmp_path, capsys):
    """fp16-stored policy and reward model under --dtype fp16: fp32 master weights, so GradScaler unscales fp32
    gradients and the run ends (with fp16 weights it stopped at "Attempting to unscale FP16 gradients"). A bf16-stored
    one under --dtype fp16 gets one warning line at the start: bf16's range is not fp16's."""
    fp16 = {key: save_as_hub(loaded(tiny, "gpt2", cls, key), tmp_path / key, AutoTokenizer.from_pretrained(tiny[key]),
                             torch.float16) for key, cls in (("gpt2", AutoModelForCausalLM),
                                                             ("gpt2_rm", AutoModelForSequenceClassification))}
    args = run_args(tiny, tmp_path / "fp16", model_name_or_path=fp16["gpt2"], reward_model_path=[fp16["gpt2_rm"]],
                    dtype="fp16")
    P.main(args)
    metrics = read_metrics(args.output_dir)
    assert len(metrics) == 2 and metrics[-1]["policy/epochs"] > 0 and capsys.readouterr().err == ""
    check_run(args.output_dir, fp16["gpt2"], metrics, value_init=fp16["gpt2_rm"])
    P.main(run_args(tiny, tmp_path / "bf16", dtype="fp16", total_episodes=8))
    warnings = capsys.readouterr().err.splitlines()
    assert len(warnings) == 1 and warnings[0].startswith("warning: ") and "stored in bf16" in warnings[0]
    assert tiny["gpt2"] in warnings[0] and tiny["gpt2_rm"] in warnings[0]


@pytest.mark.parametrize("dtype,lora", [("bf16", False), ("fp16", True), ("fp32", True)])
def test_trained_weights_and_their_optimizer_state_are_fp32_and_frozen_ones_in_the_dtype(tiny, tmp_path, monkeypatch,
                                                                                           dtype, lora):
    """From bf16-stored checkpoints: the weights that train (all of the policy and value model; with LoRA the
    adapters and the value head) and AdamW's state are fp32; the reward model (with LoRA the base of the policy and
    value model) in --dtype's precision; the reference in the policy's, fp32 (with LoRA it is the policy)."""
    frozen_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    seen, real_load, real_epochs = {}, P.load_models, P.ppo_epochs
    monkeypatch.setattr(P, "load_models", lambda *a: seen.setdefault("models", real_load(*a)))

    def epochs(model, optimizer, *rest):
        result = real_epochs(model, optimizer, *rest)
        seen["trained"] = {n: p.dtype for n, p in model.named_parameters() if p.requires_grad}
        seen["frozen"] = {n: p.dtype for n, p in model.named_parameters() if not p.requires_grad}
        seen["state"] = {t.dtype for state in optimizer.state.values() for t in state.values() if t.numel() > 1}
        return result

    monkeypatch.setattr(P, "ppo_epochs", epochs)
    P.main(run_args(tiny, tmp_path, dtype=dtype, lora_r=4 if lora else 0, total_episodes=8))
    models = seen["models"][0]
    assert set(seen["trained"].values()) == {torch.float32} and seen["state"] == {torch.float32}
    assert len(seen["trained"]) > 10 and (len(seen["frozen"]) > 10) == lora
    if lora:
        assert all("lora_" in n or "modules_to_save" in n for n in seen["trained"])
        assert set(seen["frozen"].values()) == {frozen_dtype}
    else:
        assert {p.dtype for p in models.ref_policy.parameters()} == {torch.float32}
    assert {p.dtype for p in models.reward_models[0][0].parameters()} == {frozen_dtype}


@pytest.mark.parametrize("arch,lora", [("llama", False), ("gpt2", False), ("llama", True)])
def test_the_kl_is_0_where_the_policy_is_the_reference_under_bf16(tiny, tmp_path, monkeypatch, arch, lora):
    """Update 1 under --dtype bf16, bf16-stored checkpoints: the policy (fp32 master weights under autocast) is its
    reference, so log π_old = log π_ref on every token and the KL is 0 per response, as in fp32. A bf16 copy of the
    reference runs its norms and residual stream in bf16 and gave a floor (~1e-4 per response here); with LoRA the
    reference is the same module (adapters start at 0)."""
    seen, real_score = [], P.score
    monkeypatch.setattr(P, "score", lambda *a, **k: seen.append(real_score(*a, **k)) or seen[-1])
    args = run_args(tiny, tmp_path, model_name_or_path=tiny[arch], reward_model_path=[tiny[f"{arch}_rm"]],
                    dtype="bf16", total_episodes=8, response_length=8, lora_r=4 if lora else 0)
    P.main(args)
    scored = seen[0]
    assert scored["ref_logprobs"].abs().sum() > 1  # real tokens, not all padding
    assert (scored["logprobs"] - scored["ref_logprobs"]).abs().sum(1).max() <= 1e-6
    assert abs(read_metrics(args.output_dir)[0]["objective/kl"]) <= 1e-6


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_samplers_log_probs_are_kept_beside_the_recompute_and_their_mismatch_is_logged(tiny, tmp_path,
                                                                                           monkeypatch, dtype):
    """Under --dtype bf16 score() recomputes log π_old with the training forward (the first ratio is 1) and keeps the
    sampler's μ beside it: rollout/mismatch_kl is the k3 KL(μ‖π_old) per token, rollout/mismatch_outside_frac the
    share of tokens with w = π_old/μ outside [0.9, 1.1]. Under fp32 μ is π_old (no recompute, no metric). With
    --rollout_correction token_truncate (bf16) the update weighs each token's policy loss by min(w, C)."""
    sampled, scored, real_rollout, real_score = [], [], P.rollout, P.score
    calls = spy_on_updates(monkeypatch)

    def rollout(*a, **k):
        sampled.append(real_rollout(*a, **k))
        sampled[-1]["mu"] = sampled[-1]["logprobs"].clone()  # score() hands back μ and π_old: compare with this
        return sampled[-1]

    monkeypatch.setattr(P, "rollout", rollout)
    monkeypatch.setattr(P, "score", lambda *a, **k: scored.append(real_score(*a, **k)) or scored[-1])
    args = run_args(tiny, tmp_path, model_name_or_path=tiny["llama"], reward_model_path=[tiny["llama_rm"]],
                    dtype=dtype, total_episodes=8, response_length=8, temperature=0.7,
                    **(dict(rollout_correction="token_truncate", rollout_correction_cap=1.0) if dtype == "bf16" else {}))
    P.main(args)
    metrics = read_metrics(args.output_dir)[0]
    mu, mask = sampled[0]["mu"], sampled[0]["response_mask"]
    assert torch.equal(scored[0]["sampler_logprobs"], mu) and mu[mask].lt(0).all()
    old = scored[0]["logprobs"]
    if dtype == "fp32":
        assert torch.equal(old, mu) and not any(k.startswith("rollout/") for k in metrics)
        return
    w = (old - mu).exp()[mask].double()
    # float32's w − 1 − log w cancels near w = 1: ~1e-7 absolute per token (this CPU: 7.3e-9 against 9.0e-9)
    assert metrics["rollout/mismatch_kl"] == pytest.approx((w - 1 - w.log()).mean().item(), rel=1e-5, abs=1e-7)
    assert metrics["rollout/mismatch_outside_frac"] == pytest.approx(((w - 1).abs() > 0.1).double().mean().item())
    assert (old - mu)[mask].abs().max() < 0.5  # the same policy, in bf16 at another batch shape
    trained = calls[0][0]
    assert torch.equal(trained["weights"], P.rollout_weights(old, mu, mask, "token_truncate", 1.0))
    above = ((old - mu).exp() > 1) & mask
    assert above.any() and (trained["weights"][above] == 1).all() and (trained["weights"][mask] < 1).any()


def test_loss_agg_unset_is_per_response_for_gspo_and_sapo_and_length_weighting_is_warned(capsys):
    """--loss_agg unset is resolved by check_args: seq_mean_token_mean (as veRL) for sequence-level
    ratios and SAPO, whose one ratio or gate per response token_mean would weight by its length (8:1
    for lengths 8 and 1), else token_mean; an explicit length-weighting choice under those is
    honoured, with one warning line."""
    value_free = dict(advantage_estimator="grpo", num_generations=2)
    cases = [(dict(), None, "token_mean"), (dict(policy_loss="cispo"), None, "token_mean"),
             (dict(importance_sampling_level="sequence", **value_free), None,
              "seq_mean_token_mean"),
             (dict(policy_loss="sapo"), None, "seq_mean_token_mean"),
             (dict(policy_loss="sapo"), "token_mean", "token_mean"),
             (dict(importance_sampling_level="sequence", **value_free), "seq_mean_token_sum_norm",
              "seq_mean_token_sum_norm"),
             (dict(), "seq_mean_token_sum_norm", "seq_mean_token_sum_norm")]
    for flags, given, resolved in cases:
        args = P.Args(loss_agg=given, **flags)
        P.check_args(args)
        assert args.loss_agg == resolved, (flags, given)
        warned = capsys.readouterr().err
        per_response = flags.get("policy_loss") == "sapo" or "importance_sampling_level" in flags
        warning = (f"warning: --loss_agg {given} weights each response by its length; GSPO and SAPO"
                   " average per response (seq_mean_token_mean)\n")
        assert warned == (warning if given and per_response else "")


def test_the_kl_estimator_defaults_to_k1_in_the_reward_and_k3_in_the_loss():
    """k1 in the loss without the importance weight has an expected gradient −∇KL(π_old‖π_θ) on
    π_old's samples, no pull toward π_ref: refused; ρ·k1 (--use_bias_correction_kl, the default) is
    accepted; unset, the estimator is k1 in the reward (TRL's PPO) and k3 in the loss (GRPO)."""
    for kl_in, expected in (("reward", "k1"), ("loss", "k3")):
        args = P.Args(kl_in=kl_in)
        P.check_args(args)
        assert args.kl_estimator == expected
    refused = r"--kl_estimator k1, --kl_in loss and --no-use-bias-correction-kl pull nothing toward"
    with pytest.raises(SystemExit, match=refused):
        P.check_args(P.Args(kl_in="loss", kl_estimator="k1", use_bias_correction_kl=False))
    P.check_args(P.Args(kl_in="reward", kl_estimator="k1"))
    P.check_args(P.Args(kl_in="loss", kl_estimator="k1"))


def test_a_chat_model_stops_at_its_end_of_turn_and_a_resume_keeps_the_stop_ids(tiny, tmp_path, capsys):
    """A chat model whose tokenizer has no pad token and whose turn ends in <|im_end|> (id 3), listed beside EOS (id 0)
    in its generation_config.json: a response ends at the first of either, and counts as having a stop id (no EOS
    penalty, not truncated). The checkpoint keeps the resolved ids: a resume where the model's generation_config says
    otherwise stops in one line, and resumes once --stop_token_id gives the same ids."""
    model = str(tmp_path / "chat")
    shutil.copytree(tiny["chat"], model)
    calls = []
    with pytest.MonkeyPatch.context() as monkeypatch:
        calls = spy_on_updates(monkeypatch)
        args = run_args(tiny, tmp_path, model_name_or_path=model, reward_model_path=None,
                        reward_fn=[f"{__file__}:chat_words"], dataset=tiny["chat_prompts"], total_episodes=48,
                        per_device_train_batch_size=16, missing_eos_penalty=1.0, save_every=1, seed=2)
        P.main(args)
    assert "stop ids [0, 3]" in capsys.readouterr().out.splitlines()[0]
    ends = []
    for batch, *_ in calls:
        responses = batch["query_responses"][:, batch["context_length"]:].tolist()
        for row, n, truncated in zip(responses, batch["lengths"].tolist(), batch["truncated"].tolist()):
            stops = [t in (0, 3) for t in row[:n]]
            assert not any(stops[:-1]) and truncated == (not stops[-1]) and (n == 6 or stops[-1])
            ends.append(row[n - 1] if stops[-1] else None)
        assert torch.equal(batch["scores"], batch["raw_scores"] - batch["truncated"].float())  # the EOS penalty
    assert ends.count(3) > 0 and ends.count(None) > 0  # some responses end at <|im_end|>, some are cut off
    with open(os.path.join(model, "generation_config.json")) as f:
        generation_config = json.load(f)
    with open(os.path.join(model, "generation_config.json"), "w") as f:
        json.dump({**generation_config, "eos_token_id": 0}, f)  # as if the model's stop ids had changed
    with pytest.raises(SystemExit, match=r"stop ids \[0, 3\], this run at \[0\]: give --stop_token_id 0 3") as exc:
        P.main(dataclasses.replace(args, resume=os.path.join(args.output_dir, "checkpoint-000002")))
    assert "\n" not in str(exc.value)
    P.main(dataclasses.replace(args, resume=os.path.join(args.output_dir, "checkpoint-000002"), stop_token_id=[0, 3]))
    assert [m["update"] for m in read_metrics(args.output_dir)] == [1, 2, 3]


def test_the_output_layer_is_used_only_where_the_logits_are_that_layer(tiny, monkeypatch):
    """A logit transform rules the fused output layer out: one announced by the config (Gemma-2's soft cap of 30, near
    identity on a fresh model's small logits), or one no key announces (found by a probe with large logits)."""
    from transformers import Gemma2Config
    for cap in (2.0, 30.0):
        config = Gemma2Config(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=8, final_logit_softcapping=cap)
        assert P.output_layer(AutoModelForCausalLM.from_config(config)) is None, cap
    policy = loaded(tiny, "llama")
    assert P.output_layer(policy) is policy.lm_head
    policy.config.logit_scale = 0.5  # a key that announces a transform rules it out, whatever the forward does
    assert P.output_layer(policy) is None
    policy.config.logit_scale = None
    real = policy.forward

    def capped(*a, **kw):  # a soft cap no config key announces
        out = real(*a, **kw)
        out.logits = torch.tanh(out.logits / 30) * 30
        return out

    monkeypatch.setattr(policy, "forward", capped)
    assert P.output_layer(policy) is None


@pytest.fixture(scope="session")
def big_vocab(tmp_path_factory):
    """A policy with Qwen2's 151,936-token vocabulary (tied embeddings, a tiny hidden size) stored in bf16, a tokenizer
    with no pad token, and 24 prompts. (A Qwen2 config would make AutoTokenizer rebuild this word-level tokenizer as
    Qwen2's BPE one.)"""
    root = tmp_path_factory.mktemp("big_vocab")
    words = ["<eos>", "<unk>"] + [f"w{i}" for i in range(151_936 - 2)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(words), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                         tie_word_embeddings=True, eos_token_id=0, bos_token_id=None, pad_token_id=None)
    path = save_as_hub(AutoModelForCausalLM.from_config(config), root / "policy", tokenizer)
    with open(root / "prompts.txt", "w") as f:
        f.writelines(f"w{3 * i} w{3 * i + 1} w{3 * i + 2}\n" for i in range(24))
    return path, str(root / "prompts.txt")


def test_a_library_failure_is_one_line_and_a_bug_in_the_file_keeps_its_traceback(tmp_path):
    """flag_errors turns into one line only what its block calls (a library's or the user's code,
    file and line kept); agreed() a fail(). An exception raised in a function of ppo_rlhf.py (a bug:
    here a typo in render_prompts, met inside check_inputs) propagates with its traceback."""
    with pytest.raises(SystemExit, match=r"^error: --x: JSONDecodeError: .* \(decoder\.py:\d+, "):
        with P.flag_errors("--x"):
            json.loads("{")
    with pytest.raises(SystemExit, match=r"^error: --x: KeyError: 'k' \(test_ppo_rlhf\.py:\d+, "):
        with P.flag_errors("--x"):
            [{}["k"] for _ in range(1)]  # the user's code (here this file's) raised
    with pytest.raises(TypeError):  # raised in a function of ppo_rlhf.py below the block: a bug
        with P.flag_errors("--x"):
            P.check_scores(None, 1, "--reward_fn f")
    assert P.agreed(lambda x: x + 1, 1) == 2
    with pytest.raises(SystemExit, match="^error: --x is wrong$"):
        P.agreed(P.fail, "--x is wrong")
    with pytest.raises(KeyError):
        P.agreed(lambda: {}["base_model_name_or_path"])
    source = open(SCRIPT).read()
    typo = 'ids = [tokenizer(t, add_special_tokens=m is None)["input_ids"]'
    assert source.count(typo) == 1
    fork = tmp_path / "fork" / "ppo_rlhf.py"
    fork.parent.mkdir()
    fork.write_text(source.replace(typo, typo.replace("input_ids", "input_id")))
    run = subprocess.run([sys.executable, str(fork), "--output_dir", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 1 and "Traceback (most recent call last)" in run.stderr, run.stderr
    assert f'File "{fork}", line' in run.stderr and "in render_prompts" in run.stderr
    assert run.stderr.strip().splitlines()[-1] == "KeyError: 'input_id'"
    assert "error: --dataset" not in run.stderr and not os.path.exists(tmp_path / "run")


def test_the_share_of_ratios_outside_the_clip_is_of_the_clip_in_use():
    """With clip-higher, a ratio is outside the clip below 1 − ε or above 1 + ε_high (not 1 + ε)."""
    ratios = torch.tensor([[0.7, 0.9, 1.1, 1.25, 1.35]])
    mb = {"logprobs": torch.zeros(1, 5), "response_mask": torch.ones(1, 5, dtype=torch.bool)}
    for cliprange_high, expected in ((None, 3 / 5), (0.3, 2 / 5)):
        stats = defaultdict(list)
        tokens = P.policy_loss(ratios.log(), mb["logprobs"], torch.ones(1, 5), None, P.Args(cliprange_high=cliprange_high))[1]
        P.update_stats(stats, mb, torch.zeros(1, 5), {}, tokens)
        assert stats["policy/ratio_outside_clip_avg"][0].item() == pytest.approx(expected)


def test_steps_gradscaler_skips_are_not_counted(tiny, tmp_path):
    """fp16 with a loss scale of 2^40: every scaled gradient overflows, GradScaler skips every step (lowering its
    scale), the weights stay, and none of the four steps counts (policy/epochs is 0, not 1)."""
    batch = fixed_rollout(tiny, tmp_path, 8)
    model = P.PolicyAndValue(loaded(tiny, "gpt2"), loaded_value(tiny))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    args = P.Args(per_device_train_batch_size=8, num_ppo_epochs=2, num_mini_batches=2, dtype="fp16")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    trained = P.ppo_epochs(model, torch.optim.AdamW(model.parameters(), lr=1e-3), scaler, batch, args,
                           P.check_args(args), P.Runtime(low_dtype=torch.float16))
    assert trained.optimizer_steps == 0 and trained.stop_reason is None and scaler.get_scale() == 2.0**36
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_non_finite_metric_is_written_as_null(tiny, tmp_path):
    """One response of one token per update: the returns have no variance, so explained variance is 0/0. It is
    written as null (strict JSON), not NaN."""
    args = run_args(tiny, tmp_path, total_episodes=2, per_device_train_batch_size=1, num_mini_batches=1,
                    response_length=1, stop_token=None)
    P.main(args)
    with open(os.path.join(args.output_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in metrics.jsonl")) for line in f]
    assert len(lines) == 2 and all(m["val/explained_variance"] is None for m in lines)
    assert P.json_line({"a": float("-inf"), "b": 1.5, "c": 2}) == '{"a": null, "b": 1.5, "c": 2}\n'


def test_a_text_too_long_for_a_reward_models_context_is_one_line(tiny):
    tokenizer = AutoTokenizer.from_pretrained(tiny["other_rm"])
    model = loaded(tiny, "other_rm", AutoModelForSequenceClassification)
    prompts = SimpleNamespace(texts=["w1 " * 30], messages=[None])
    with pytest.raises(SystemExit, match="--response_length") as exc:
        P.score_texts(model, tokenizer, prompts, [0], [" w2 w3 w4"], "cpu")
    assert "\n" not in str(exc.value) and "context of 32" in str(exc.value)


def test_the_learning_rate_follows_transformers_cosine_schedule_with_warmup(tiny, tmp_path):
    """--lr_scheduler_type cosine --warmup_ratio 0.5 over 4 updates: ceil(0.5·4) = 2 updates warm up from 0,
    then ½(1 + cos(π·(u − 2)/2)): the learning rate of updates 1-4 is 0, ½, 1, ½ of --learning_rate."""
    P.main(run_args(tiny, tmp_path, total_episodes=32, lr_scheduler_type="cosine", warmup_ratio=0.5))
    assert [m["lr"] / 1e-3 for m in read_metrics(tmp_path / "run")] == pytest.approx([0.0, 0.5, 1.0, 0.5])


@pytest.mark.parametrize("kl_estimator,whiten_rewards,missing_eos_penalty,lr_scheduler_type,target_kl",
                         [("k1", False, None, "linear", None), ("k3", True, 0.7, "constant", 1e-9)])
def test_the_loop_wires_its_phases_as_the_formulas_say(tiny, tmp_path, monkeypatch, kl_estimator, whiten_rewards,
                                                       missing_eos_penalty, lr_scheduler_type, target_kl):
    """What main() hands to the PPO update, checked phase by phase against naive per-sample references: 1. log π_old
    is the policy's own (teacher-forced at T) and responses end at the stop token; 2. log π_ref is the reference's,
    V the value model's, the score the reward function's minus the EOS penalty; 3. r_t = −β·KL_t + score on the last
    token (whitened if asked); 4. GAE, then whitened advantages; 5. the update: log-probs from the hidden states in
    chunks, the learning rate's schedule, the target_kl stop; 6. the logged metrics are those of this batch."""
    monkeypatch.setattr(P, "logprobs_chunk_rows", lambda vocab_size: 4)  # the chunked output layer, as at scale
    calls = spy_on_updates(monkeypatch)
    args = run_args(tiny, tmp_path, reward_model_path=None, reward_fn=[f"{__file__}:count_w1"], total_episodes=24,
                    stop_token_id=5, temperature=0.7, kl_coef=0.1, gamma=0.9, lam=0.8, kl_estimator=kl_estimator,
                    whiten_rewards=whiten_rewards, missing_eos_penalty=missing_eos_penalty,
                    lr_scheduler_type=lr_scheduler_type,
                    target_kl=target_kl)
    P.main(args)
    metrics, ref = read_metrics(args.output_dir), loaded(tiny, "gpt2")
    tokenizer = AutoTokenizer.from_pretrained(tiny["gpt2"])
    assert len(calls) == len(metrics) == 3
    for (batch, logprobs, values, model), m in zip(calls, metrics):
        linear = lr_scheduler_type == "linear"  # (N − u)/N over the N = 3 updates
        assert model.fused_head and m["lr"] == pytest.approx(1e-3 * ((3 - (m["update"] - 1)) / 3 if linear else 1))
        # target_kl: the first step is at ρ = 1 (approx KL 0), the second minibatch's approx KL exceeds 1e-9: stop
        assert m["policy/epochs"] == (1.0 if target_kl else 2.0)
        mask, start, lengths = batch["response_mask"], batch["context_length"], batch["lengths"].tolist()
        responses = batch["query_responses"][:, start:]
        assert torch.allclose(batch["logprobs"][mask], logprobs[mask], atol=1e-5)
        assert (batch["logprobs"][~mask] == 0).all()
        for row, n in zip(responses.tolist(), lengths):
            assert 5 not in row[: n - 1] and (n == responses.shape[1] or row[n - 1] == 5)
        with torch.no_grad():
            ref_logprobs = P.response_logprobs(ref, batch["query_responses"], batch["attention_mask"], start, 0.7)[0]
        assert torch.allclose(batch["ref_logprobs"][mask], ref_logprobs[mask], atol=1e-5)
        assert torch.allclose(batch["values"][mask], values[mask], atol=1e-5) and (batch["values"][~mask] == 0).all()
        completions = [tokenizer.decode(r[:n], skip_special_tokens=True) for r, n in zip(responses.tolist(), lengths)]
        has_eos = [5 in r[:n] for r, n in zip(responses.tolist(), lengths)]  # the stop id, here not EOS
        scores = [c - (missing_eos_penalty or 0) * (not e) for c, e in zip(count_w1(None, completions), has_eos)]
        assert torch.allclose(batch["scores"], torch.tensor(scores))
        rewards, kls = torch.zeros(mask.shape, dtype=torch.float64), []
        for b, n in enumerate(lengths):
            for t in range(n):
                log_ratio = batch["ref_logprobs"][b, t].item() - batch["logprobs"][b, t].item()
                kl = -log_ratio if kl_estimator == "k1" else math.exp(log_ratio) - 1 - log_ratio
                rewards[b, t] = -0.1 * kl + (scores[b] if t == n - 1 else 0.0)
                kls.append((b, kl))
        real = rewards[mask]
        if whiten_rewards:
            rewards[mask] = (real - real.mean()) / (real.var() + 1e-8).sqrt() + real.mean()
        advantages = gae_naive(rewards, batch["values"].double(), mask, 0.9, 0.8)
        returns = advantages + batch["values"].double()
        real = advantages[mask]
        expected = (real - real.mean()) / (real.var() + 1e-8).sqrt()
        assert torch.allclose(batch["advantages"][mask].double(), expected, atol=1e-5)
        assert (batch["advantages"][~mask] == 0).all()
        assert torch.allclose(batch["returns"][mask].double(), returns[mask], atol=1e-5)
        kl_per_sequence = [sum(k for b2, k in kls if b2 == b) for b in range(len(lengths))]
        assert m["objective/kl"] == pytest.approx(sum(kl_per_sequence) / len(lengths), abs=1e-5)
        assert m["objective/scores"] == pytest.approx(sum(scores) / len(scores), abs=1e-6)
        assert m["val/mean_response_length"] == pytest.approx(sum(lengths) / len(lengths))
        assert m["val/num_eos_tokens"] == sum(has_eos) and abs(m["policy/first_ratio"] - 1) < 1e-5
    assert min(c[0]["lengths"].min() for c in calls) < 6  # some responses stop early
    assert max(abs(k) for _, k in kls) > 1e-3  # by the last update the policy has moved away from the reference


FAMILY = {  # estimator, k, where the KL goes, β, adaptive KL target
    "rloo, KL in the reward": ("rloo", 4, "reward", 0.1, None),
    "rloo, KL in the reward, adaptive": ("rloo", 2, "reward", 0.1, 0.01),  # the adapted β reaches the next rewards
    "grpo, KL in the loss, adaptive": ("grpo", 2, "loss", 0.1, 0.01),
    "dr_grpo, no KL": ("dr_grpo", 4, "reward", 0.0, None),
    "reinforce_pp": ("reinforce_pp", 1, "reward", 0.1, None),
    "reinforce_pp_baseline": ("reinforce_pp_baseline", 2, "reward", 0.1, None),
    "grpo, SAPO, equal groups filtered, off-policy mask": ("grpo", 2, "reward", 0.1, None, dict(
        policy_loss="sapo", filter_zero_std_groups=True, off_policy_mask_threshold=0.0)),
    "dr_grpo, GSPO": ("dr_grpo", 4, "loss", 0.1, None, dict(importance_sampling_level="sequence", cliprange=3e-4,
                                                            cliprange_high=4e-4)),
}


def trl_is_std_zero(scores, k):
    """TRL 1.16's is_std_zero, from its formulas: each group's nanstd (Bessel-corrected over its
    non-NaN rows; NaN where fewer than 2), then isclose to 0."""
    groups = scores.view(-1, k).double()
    n = (~groups.isnan()).sum(1)
    var = ((groups - groups.nanmean(1, keepdim=True)) ** 2).nanmean(1) * n / (n - 1)
    std = torch.where(n > 1, var, math.nan).sqrt()
    return torch.isclose(std, torch.zeros_like(std))


def test_equal_score_groups_are_groups_of_equal_scores_not_of_float_std_zero(tiny, tmp_path,
                                                                              monkeypatch):
    """--filter_zero_std_groups and objective/frac_reward_zero_std share one predicate, "the scored
    rows' scores all equal" (TRL's is_std_zero; exact: float32's std of eight 0.1 is 8e-9, not 0,
    when a rank holds one group), over the scored rows (NaN: unscored), 2 or more. GRPO k = 8, one
    group per update, a reward of 0.1 for every response: every group leaves the loss (no optimizer
    step) and the share is 1. With --length_penalty the filter reads the shaped scores (0.1 −
    λ·length), which differ where the lengths do, not the raw ones. GRPO k = 4 with None for some
    rows: the groups TRL's is_std_zero finds."""
    assert torch.full((1, 8), 0.1).std(1).item() > 0 and torch.full((1, 16), 0.2).std(1).item() > 0
    assert P.equal_score_groups(torch.full((8,), 0.1), 8).tolist() == [True]
    assert P.equal_score_groups(torch.full((16,), 0.2), 16).tolist() == [True]
    several = torch.tensor([0.1] * 8 + [0.2] * 8 + [0.1, 0.2] * 4 + [0.2] * 7 + [0.2000001])
    assert P.equal_score_groups(several, 8).tolist() == [True, True, False, False]
    nan = math.nan
    with_none = torch.tensor([1, 1, nan, 1, 1, 2, nan, 1, 1, nan, nan, nan, nan, nan, nan, nan,
                              0.5, nan, 0.5, nan, 0, 0, 0, 0])  # [1, 1, None, 1]: no signal
    assert P.equal_score_groups(with_none, 4).tolist() == [True, False, False, False, True, True]
    assert P.equal_score_groups(with_none, 4).tolist() == trl_is_std_zero(with_none, 4).tolist()
    calls = spy_on_updates(monkeypatch)
    for name, penalty, fn, k in (("equal", 0.0, "a_tenth", 8), ("shaped", 0.01, "a_tenth", 8),
                                 ("none", 0.0, "a_tenth_or_none", 4)):
        args = run_args(tiny, tmp_path / name, reward_model_path=None,
                        reward_fn=[f"{__file__}:{fn}"], num_generations=k,
                        advantage_estimator="grpo", filter_zero_std_groups=True, stop_token_id=5,
                        length_penalty=penalty, total_episodes=16)
        P.main(args)
        metrics, batches = read_metrics(args.output_dir), [c[0] for c in calls[-2:]]
        for batch, m in zip(batches, metrics):
            if fn == "a_tenth_or_none":
                scores = batch["raw_scores"].where(batch["scored"], math.nan)
                trl = trl_is_std_zero(scores, 4)
                assert m["objective/frac_reward_zero_std"] == trl.float().mean().item()
                kept = batch["loss_mask"].any(1).view(-1, 4).any(1)
                n = batch["scored"].view(-1, 4).sum(1)
                assert (kept == (~trl & (n >= 2))).all() and (trl & (n < 4)).any()  # one with None
                continue
            assert (batch["raw_scores"] == batch["raw_scores"][0]).all()  # raw: one equal group
            lengths = batch["lengths"]
            equal = bool((lengths == lengths[0]).all()) if penalty else True
            assert m["objective/frac_reward_zero_std"] == float(equal)
            assert batch["loss_mask"].any().item() == (not equal)
            assert m["policy/epochs"] == (0.0 if equal else 2.0)
        if penalty:
            assert not all((b["lengths"] == b["lengths"][0]).all() for b in batches)  # one is kept


@pytest.mark.parametrize("case", list(FAMILY))
def test_the_value_free_estimators_wire_their_advantages(tiny, tmp_path, monkeypatch, case):
    """What main() hands the PPO update under each value-free estimator, against a naive per-sample
    loop: groups of k rows share a prompt; s'_i = s_i − the group's baseline; r_t = −β·KL_t (KL in
    the reward) + s'_i on the last token; A_t = Σ_{t'≥t} γ^(t'−t)·r_t', whitened over the batch for
    reinforce_pp*. No value model is loaded, trained or saved; β 0 loads no reference; the adaptive
    controller moves β by its formula. objective/rlhf_reward is score − β·Σ_t KL_t wherever the KL
    goes, objective/non_score_reward the penalty r_t took (0: the KL in the loss)."""
    estimator, k, kl_in, kl_coef, target, *flags = FAMILY[case]
    calls = spy_on_updates(monkeypatch)
    args = run_args(tiny, tmp_path, reward_model_path=None, reward_fn=[f"{__file__}:count_w1"], total_episodes=24,
                    stop_token_id=5, gamma=0.9, num_generations=k, advantage_estimator=estimator, kl_in=kl_in,
                    kl_coef=kl_coef, adaptive_kl_target=target, adaptive_kl_horizon=100, **(flags or [{}])[0])
    P.main(args)
    metrics = read_metrics(args.output_dir)
    assert len(calls) == len(metrics) == 3 and not os.path.exists(os.path.join(args.output_dir, "value_model"))
    assert ("objective/kl" in metrics[0]) == (kl_coef > 0) and "val/explained_variance" not in metrics[0]
    assert ("loss/kl_avg" in metrics[0]) == (kl_in == "loss") and "loss/value_avg" not in metrics[0]
    filtered = 0  # rows of equal-score groups left out of the loss
    for (batch, _, values, model), m in zip(calls, metrics):
        assert values is None and not any(n.startswith("value_model") for n, _ in model.named_parameters())
        assert m["objective/kl_coef"] == pytest.approx(kl_coef if target is None else batch["kl_coef"])
        penalty = batch["kl_coef"] * batch["kl"].sum(1)  # β·Σ_t KL_t per response
        objective = (batch["scores"] - penalty).mean().item()
        assert m["objective/rlhf_reward"] == pytest.approx(objective, abs=1e-6)
        applied = -penalty.mean().item() if kl_in == "reward" else 0.0  # in the loss: none in r_t
        assert m["objective/non_score_reward"] == pytest.approx(applied, abs=1e-6)
        mask, lengths = batch["response_mask"], batch["lengths"].tolist()
        queries = batch["query_responses"][:, : batch["context_length"]]
        assert all(torch.equal(queries[i], queries[i - i % k]) for i in range(len(queries)))  # k rows, one prompt
        if k > 1:
            groups = batch["scores"].view(-1, k).tolist()
            assert m["objective/frac_reward_zero_std"] == pytest.approx(
                sum(len(set(g)) == 1 for g in groups) / len(groups))
            equal = torch.tensor([len(set(g)) == 1 for g in groups]).repeat_interleave(k)
            filtered += equal.sum().item() if args.filter_zero_std_groups else 0
            assert torch.equal(batch["loss_mask"], mask & ~equal[:, None] if args.filter_zero_std_groups else mask)
        assert ("policy/off_policy_masked_frac" in m) == (args.off_policy_mask_threshold is not None)
        scores, baselined = batch["scores"].tolist(), []
        for i, s in enumerate(scores):
            group = scores[i - i % k : i - i % k + k]
            mean, others = sum(group) / k, (sum(group) - s) / max(k - 1, 1)
            std = (sum((g - mean) ** 2 for g in group) / max(k - 1, 1)) ** 0.5
            baselined.append({"rloo": s - others, "grpo": (s - mean) / (std + 1e-4), "dr_grpo": s - mean,
                              "reinforce_pp": s, "reinforce_pp_baseline": s - mean}[estimator])
        advantages = torch.zeros(mask.shape, dtype=torch.float64)
        for b, n in enumerate(lengths):
            to_go = 0.0
            for t in reversed(range(n)):
                kl = batch["logprobs"][b, t].item() - batch["ref_logprobs"][b, t].item()  # k1
                reward = -batch["kl_coef"] * kl * (kl_in == "reward") + (baselined[b] if t == n - 1 else 0.0)
                assert batch["rewards"][b, t].item() == pytest.approx(reward, abs=1e-6)
                advantages[b, t] = to_go = reward + 0.9 * to_go
        if estimator.startswith("reinforce_pp"):
            real = advantages[mask]
            advantages[mask] = (real - real.mean()) / (real.var() + 1e-8).sqrt()
        assert torch.allclose(batch["advantages"].double(), advantages, atol=1e-5)
        if kl_coef == 0:  # no reference: every KL estimate is 0
            assert (batch["kl"] == 0).all()
    assert (filtered > 0) == args.filter_zero_std_groups  # some groups were equal
    if target is not None:  # β ← β·(1 + clip(KL/target − 1, ±0.2)·batch/horizon), from the logged KL
        for before, after in zip(metrics, metrics[1:]):
            assert after["objective/kl_coef"] == pytest.approx(
                P.adaptive_kl_coef(before["objective/kl_coef"], before["objective/kl"], target, 8, 100))
        assert metrics[-1]["objective/kl_coef"] != kl_coef


TRAINING_KEYS = lambda m: {k: v for k, v in DETERMINISTIC_KEYS(m).items() if not k.startswith("eval/")}  # noqa: E731


def test_evaluation_leaves_training_bit_identical(tiny, tmp_path):
    """Evaluation at T = 0.7 (its own random stream) 3 times over the run: every training key of every update and the
    final weights are those of a run without it; samples.jsonl holds each evaluation's prompts."""
    common = dict(reward_model_path=None, reward_fn=[f"{__file__}:count_w1"], total_episodes=32,
                  num_sample_generations=2, eval_temperature=0.7)
    with_eval = run_args(tiny, tmp_path / "a", eval_dataset=tiny["txt"], **common)
    without = run_args(tiny, tmp_path / "b", eval_dataset=None, **common)
    P.main(with_eval), P.main(without)
    a, b = read_metrics(with_eval.output_dir), read_metrics(without.output_dir)
    assert [TRAINING_KEYS(m) for m in a] == [TRAINING_KEYS(m) for m in b] == [DETERMINISTIC_KEYS(m) for m in b]
    assert [m["update"] for m in a if "eval/score" in m] == [1, 3, 4]  # every 2nd update from the first, and the last
    samples = read_lines(os.path.join(with_eval.output_dir, "samples.jsonl"))
    n = len([line for line in open(tiny["txt"]) if line.strip()])
    assert n > 1 and [x["update"] for x in samples] == [u for u in (1, 3, 4) for _ in range(n)]  # every prompt
    assert not os.path.exists(os.path.join(without.output_dir, "samples.jsonl"))
    wa, wb = final_weights(with_eval.output_dir), final_weights(without.output_dir)
    assert all(torch.equal(wa[n][k], wb[n][k]) for n in wa for k in wa[n])


def test_evaluation_metrics_on_a_fixed_model(tiny, tmp_path, monkeypatch, capsys):
    """learning rate 0 keeps the policy at its start; the reference is another model. Greedy
    answers by a naive loop (a whole forward per token, argmax) and their count_w1 scores give
    eval/score and eval/response_length; samples.jsonl holds every prompt's answer. The evaluation
    runs no forward but the sampler's (no value, no reference, no log-prob recompute), and neither
    metrics.jsonl nor the eval line carries a KL: a greedy response gives no estimate of one."""
    forwards, real_evaluate = [], P.evaluate
    for name in ("state_values", "response_logprobs"):
        monkeypatch.setattr(P, name, lambda *a, real=getattr(P, name), name=name: forwards.append(name) or real(*a))

    def evaluate(*a):
        start = len(forwards)
        result = real_evaluate(*a)
        assert forwards[start:] == []  # generation alone
        return result

    monkeypatch.setattr(P, "evaluate", evaluate)
    reference = loaded(tiny, "gpt2")
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(9)) * 0.05)
    reference.save_pretrained(str(tmp_path / "ref"))
    AutoTokenizer.from_pretrained(tiny["gpt2"]).save_pretrained(str(tmp_path / "ref"))
    args = run_args(tiny, tmp_path, reward_model_path=None, reward_fn=[f"{__file__}:count_w1"],
                    learning_rate=0.0, ref_model_path=str(tmp_path / "ref"), total_episodes=8,
                    eval_dataset=tiny["txt"], stop_token_id=8, temperature=0.8)
    P.main(args)
    m = read_metrics(args.output_dir)[-1]
    assert {"state_values", "response_logprobs"} <= set(forwards)  # the training's scoring made them
    assert not [k for line in read_metrics(args.output_dir) for k in line if "kl" in k[:8]]
    out = capsys.readouterr().out.splitlines()
    eval_lines = [line for line in out if line.startswith("  eval ")]
    assert eval_lines and not [line for line in eval_lines if " kl " in line]
    assert m["objective/kl"] > 1e-3  # the training's KL, to another model, is there
    policy, tokenizer = loaded(tiny, "gpt2"), AutoTokenizer.from_pretrained(tiny["gpt2"])
    prompts = [line.strip() for line in open(tiny["txt"]) if line.strip()]
    lengths, answers = [], []
    for prompt in prompts:
        ids = tokenizer(prompt)["input_ids"]
        for _ in range(6):
            with torch.no_grad():
                ids.append(policy(torch.tensor([ids])).logits[0, -1].argmax().item())
            if ids[-1] == 8:  # the second answer ends at 1 token: padding after it
                break
        n = len(ids) - len(tokenizer(prompt)["input_ids"])
        answers.append(tokenizer.decode(ids[-n:], skip_special_tokens=True))
        lengths.append(n)
    scores = count_w1(prompts, answers)
    assert m["eval/score"] == pytest.approx(sum(scores) / len(scores), abs=1e-6)
    assert m["eval/response_length"] == pytest.approx(sum(lengths) / len(lengths))
    samples = read_lines(os.path.join(args.output_dir, "samples.jsonl"))
    assert [(x["prompt"], x["completion"], x["score"]) for x in samples] == list(zip(prompts, answers, scores))


def test_score_shaping_closed_forms():
    scores, lengths = torch.tensor([2.0, -6.0, 0.5, 1.0]), torch.tensor([1.0, 4.0, 6.0, 8.0])
    args = P.Args(response_length=10, score_scaling="running_std", score_clip=1.5, length_penalty=0.1,
                  overlong_buffer=4, overlong_penalty=0.5)
    # / 2, clip to ±1.5, − 0.1·len, − 0.5·(len − 6)/4 beyond 10 − 4 = 6 tokens (of --response_length, not the longest)
    expected = [1.0 - 0.1, -1.5 - 0.4, 0.25 - 0.6, 0.5 - 0.8 - 0.5 * 2 / 4]
    assert P.shaped_scores(scores, lengths, 2.0, args).tolist() == pytest.approx(expected)
    assert torch.equal(P.shaped_scores(scores, lengths, 2.0, P.Args()), scores)  # every term off by default
    # the running moments of batches merged one by one are those of all the values together
    gen = torch.Generator().manual_seed(10)
    batches = [torch.randn(n, generator=gen, dtype=torch.float64) * 3 + 1 for n in (5, 8, 3)]
    moments, seen = (0, 0.0, 0.0), []
    for b in batches:
        seen.append(b)
        moments, std = P.running_moments(moments, b.mean().item(), b.var().item(), len(b))
        everything = torch.cat(seen)
        assert std == pytest.approx(everything.std().item()) and moments[1] == pytest.approx(everything.mean())
    assert P.running_moments((0, 0.0, 0.0), 4.0, 0.0, 1)[1] == 1.0  # one value: no spread yet, no scaling


def test_the_loop_shapes_the_scores_as_its_flags_say(tiny, tmp_path, monkeypatch):
    """The score main() hands to the update: raw − EOS penalty, / the std of every raw score so far (all updates),
    clipped, − λ·length, − the overlong penalty; raw and shaped means logged."""
    calls = spy_on_updates(monkeypatch)
    args = run_args(tiny, tmp_path, reward_model_path=None, reward_fn=[f"{__file__}:count_w1"], total_episodes=24,
                    stop_token_id=5, missing_eos_penalty=0.3, score_scaling="running_std", score_clip=2.0,
                    length_penalty=0.05, overlong_buffer=2, overlong_penalty=0.4)
    P.main(args)
    seen = []
    for (batch, *_), m in zip(calls, read_metrics(args.output_dir)):
        raw, lengths = batch["raw_scores"].double(), batch["lengths"].double()
        assert m["objective/raw_scores"] == pytest.approx(raw.mean().item(), abs=1e-6)
        penalised = raw - 0.3 * batch["truncated"].double()  # no stop id
        seen.append(penalised)
        std = torch.cat(seen).std() if torch.cat(seen).std() > 0 else 1.0
        expected = (penalised / std).clamp(-2, 2) - 0.05 * lengths - 0.4 * (lengths - 4).clamp(min=0) / 2
        assert torch.allclose(batch["scores"].double(), expected, atol=1e-5)
        assert m["objective/scores"] == pytest.approx(expected.mean().item(), abs=1e-5)
    assert any((c[0]["lengths"] > 4).any() for c in calls) and torch.cat(seen).std() > 0  # the terms had work


def test_builtin_task_learns(tmp_path, capfd):
    """It trains on 80 sums and evaluates on the 20 others, after the last update (num_sample_generations 0)."""
    args = P.Args(output_dir=str(tmp_path / "builtin"), total_episodes=128 * 150,
                  num_sample_generations=0, eval_on_start=False)
    P.main(args)
    metrics = read_metrics(args.output_dir)
    success = [m["objective/success_rate"] for m in metrics]
    first, last = sum(success[:10]) / 10, sum(success[-10:]) / 10
    assert first < 0.1 and last > first + 0.15, (first, last)
    assert "80 prompts" in capfd.readouterr().out.splitlines()[0] and "eval/success_rate" in metrics[-1]
    _, trained, evaluated = P.build_addition_task(str(tmp_path / "task"), 1)
    trained, evaluated = ({json.loads(line)["prompt"] for line in open(f)} for f in (trained, evaluated))
    assert {x["prompt"] for x in read_lines(os.path.join(args.output_dir, "samples.jsonl"))} == evaluated
    assert len(evaluated) == 20 and len(trained) == 80 and trained.isdisjoint(evaluated)


def readme_python_blocks(section):
    """The ```python snippets of one `## ` section of README.md."""
    return re.findall(r"```python\n(.*?)```", readme_section(section), re.S)


@pytest.fixture(scope="module")
def builtin_run(tmp_path_factory):
    """A short run of the built-in task (2 updates, evaluated twice), as the README's snippets find one."""
    output_dir = str(tmp_path_factory.mktemp("builtin") / "run")
    P.main(P.Args(output_dir=output_dir, total_episodes=256, num_sample_generations=1))
    return output_dir


def test_the_readmes_snippet_using_the_trained_policy_runs(builtin_run, tmp_path):
    """It prints the policy's greedy answer to 3 + 4 (what P.generate answers greedily)."""
    snippet = readme_python_blocks("Using a trained policy")[0]
    assert "runs/ppo_rlhf__1__1764570000/policy" in snippet
    result = subprocess.run([sys.executable, "-c", snippet.replace("runs/ppo_rlhf__1__1764570000", builtin_run)],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(builtin_run, "policy"))
    policy = AutoModelForCausalLM.from_pretrained(os.path.join(builtin_run, "policy"))
    ids, mask = P.left_pad([tokenizer("3 + 4 =")["input_ids"]], tokenizer.pad_token_id)
    with torch.no_grad():
        answer = P.generate(policy, ids, mask, 2, 0.0, [tokenizer.eos_token_id], tokenizer.pad_token_id)[0][0]
    assert result.stdout == tokenizer.decode(answer, skip_special_tokens=True) + "\n"


def test_the_readmes_snippet_generating_with_a_trained_chat_model_runs(tiny, tmp_path):
    """On a chat policy trained by the script (from a tokenizer without a pad token, <|im_end|> a stop id beside EOS
    in generation_config.json) it prints the greedy answer's new tokens up to <|im_end|>, as P.generate answers. The
    chat model first learns to answer the snippet's question `w7 <|im_end|> w8`: only a stop at <|im_end|> ends it."""
    snippet = readme_python_blocks("Using a trained policy")[1]
    messages = [{"role": "user", "content": "What is 12 times 12?"}]
    assert "runs/ppo_rlhf__1__1764570000/policy" in snippet and json.dumps(messages) in snippet
    tokenizer = AutoTokenizer.from_pretrained(tiny["chat"])
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer(text + "w7 <|im_end|> w8", add_special_tokens=False)["input_ids"]])
    model = AutoModelForCausalLM.from_pretrained(tiny["chat"], dtype=torch.float32)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(30):
        F.cross_entropy(model(ids).logits[0, -4:-1], ids[0, -3:]).backward()
        optimizer.step()
        optimizer.zero_grad()
    args = run_args(tiny, tmp_path, model_name_or_path=save_as_hub(model, tmp_path / "chat", tokenizer),
                    reward_model_path=None, reward_fn=[f"{__file__}:chat_words"], dataset=tiny["chat_prompts"])
    P.main(args)
    folder = os.path.join(args.output_dir, "policy")
    result = subprocess.run([sys.executable, "-c", snippet.replace("runs/ppo_rlhf__1__1764570000/policy", folder)],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    policy = AutoModelForCausalLM.from_pretrained(folder)
    query, mask = P.left_pad([ids[0, :-3].tolist()], 0)
    with torch.no_grad():
        answer = P.generate(policy, query, mask, 256, 0.0, policy.generation_config.eos_token_id, 0)[0][0]
    assert answer.tolist() == tokenizer.convert_tokens_to_ids(["w7", "<|im_end|>"])  # stopped at the end of turn
    assert result.stdout == tokenizer.decode(answer, skip_special_tokens=True) + "\n" == "w7\n"


def test_the_readmes_snippet_plotting_the_metrics_runs(builtin_run, tmp_path):
    pytest.importorskip("matplotlib")  # an optional package
    snippet = readme_python_blocks("Metrics")[0]
    snippet = snippet.replace("runs/ppo_rlhf__1__1764570000", builtin_run)
    result = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120, env={**os.environ, "MPLBACKEND": "Agg"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "metrics.png").stat().st_size > 10_000


def test_a_built_in_run_removes_its_temp_folder_at_exit(tmp_path):
    """The built-in task's model lives in a temp folder of the process, there while it runs,
    removed at exit."""
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp"), "OMP_NUM_THREADS": "1"}
    os.makedirs(tmp_path / "tmp")
    command = [sys.executable, SCRIPT, "--output_dir", tmp_path / "a", "--total_episodes", "128"]
    run = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not os.listdir(tmp_path / "tmp") and time.time() < deadline:  # made before models load
        time.sleep(0.05)
    left = os.listdir(tmp_path / "tmp")
    assert left and left[0].startswith(f"ppo_rlhf_builtin_{run.pid}_")
    assert run.wait(timeout=120) == 0
    assert os.listdir(tmp_path / "tmp") == []


def test_the_built_in_task_without_evaluation_trains_on_all_100_sums(tmp_path, capfd):
    P.main(P.Args(output_dir=str(tmp_path / "run"), total_episodes=128, eval_dataset=None))
    assert "100 prompts" in capfd.readouterr().out.splitlines()[0]
    assert not any(k.startswith("eval/") for k in read_metrics(tmp_path / "run")[0])


def test_tracking_sends_the_metrics_to_wandb(tiny, tmp_path, monkeypatch):
    calls = []
    fake = type(sys)("wandb")
    fake.init = lambda **kw: calls.append(("init", kw))
    fake.log = lambda metrics, step: calls.append(("log", step, metrics))
    fake.finish = lambda: calls.append(("finish",))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    args = run_args(tiny, tmp_path, track=True)
    P.main(args)
    logged = [c for c in calls if c[0] == "log"]
    assert calls[0][0] == "init" and calls[-1] == ("finish",) and [c[1] for c in logged] == [1, 2]
    assert logged[-1][2] == read_metrics(args.output_dir)[-1]


# ------------------------------------------------------------------------------------------------------------ bad input
OUT_OF_RANGE = {"per_device_train_batch_size": 0, "gradient_accumulation_steps": 0, "num_mini_batches": 0,
                "num_ppo_epochs": 0, "response_length": 0, "local_rollout_forward_batch_size": 0, "total_episodes": 0,
                "temperature": 0.0, "cliprange": -0.1, "cliprange_value": 0.0, "max_grad_norm": float("inf"),
                "dist_timeout_s": 0, "learning_rate": -1.0, "kl_coef": float("nan"), "vf_coef": -0.1, "save_every": -1,
                "save_total_limit": -1, "num_sample_generations": -1, "gamma": 1.5, "lam": -0.01, "target_kl": 0.0,
                "stop_token_id": [-1], "missing_eos_penalty": float("nan"), "num_generations": 0,
                "adaptive_kl_horizon": 0, "adaptive_kl_target": 0.0, "cliprange_high": -0.1, "dual_clip": 1.0,
                "entropy_coef": float("inf"), "lora_r": -1, "lora_alpha": 0.0, "eval_temperature": -0.5,
                "score_clip": 0.0, "overlong_buffer": -1, "length_penalty": float("nan"),
                "overlong_penalty": float("inf"), "health_window": -1, "replay_rounds": -1,
                "replay_weight_cap": 0.5, "max_prompt_length": 0,
                "warmup_ratio": 1.5, "cispo_max": 0.0, "sapo_temperature_pos": -1.0, "sapo_temperature_neg": 0.0,
                "rollout_correction_cap": float("nan"), "off_policy_mask_threshold": float("inf"),
                "reward_weights": [float("nan")], "vespo_k_pos": 0.0, "vespo_lambda_pos": -1.0,
                "vespo_k_neg": float("nan"), "vespo_lambda_neg": 0.0, "top_entropy_quantile": 0.0}


def file_case(case, tiny, tmp_path):
    """A bad input that needs files (made here) or more than one flag: -> (flags, the flag the error must name)."""
    jsonl = tmp_path / "prompts.jsonl"
    if case == "csv prompts":
        (tmp_path / "prompts.csv").write_text("w1 w2\n")
        return dict(dataset=str(tmp_path / "prompts.csv")), "--dataset"
    if case in ("bad jsonl", "chat prompts, no chat template", "empty prompts", "bad jsonl after a blank line"):
        chat = '{"messages": [{"role": "user", "content": "w1"}]}\n'
        jsonl.write_text({"bad jsonl": '{"prompt": "w1"}\n{"text": "w2"}\n', "empty prompts": "\n  \n",
                          "chat prompts, no chat template": chat,
                          "bad jsonl after a blank line": '{"prompt": "w1"}\n\n{"text": "w2"}\n'}[case])
        return dict(dataset=str(jsonl)), "--dataset"
    if case == "reward model with 2 labels":
        config("gpt2", len(WORDS), num_labels=2, architectures=["GPT2ForSequenceClassification"]).save_pretrained(
            str(tmp_path / "rm2"))
        return dict(reward_model_path=[str(tmp_path / "rm2")]), "--reward_model_path"
    if case == "a tokenizer past the model's vocabulary":  # no embedding is grown for its extra id
        shutil.copytree(tiny["gpt2"], tmp_path / "grown")
        word_tokenizer(WORDS + ["w99"]).save_pretrained(str(tmp_path / "grown"))
        jsonl.write_text('{"prompt": "w1 w99"}\n')
        return dict(model_name_or_path=str(tmp_path / "grown"), dataset=str(jsonl)), "--model_name_or_path"
    if case == "output_dir is a file":
        (tmp_path / "run").write_text("notes")
        return {}, "--output_dir"
    if case == "a run is in output_dir":
        os.makedirs(tmp_path / "run")
        (tmp_path / "run" / "metrics.jsonl").write_text('{"update": 1}\n')
        return {}, "--output_dir"
    if case == "a field named like a reward function's argument":
        jsonl.write_text('{"prompt": "w1 w2", "prompts": "w3"}\n')
        return dict(dataset=str(jsonl), reward_model_path=None, reward_fn=[f"{__file__}:answer_matches"]), "--dataset"
    if case == "a corrupt adapter config":
        os.makedirs(tmp_path / "adapter")
        (tmp_path / "adapter" / "adapter_config.json").write_text('{"base_model_name_or_path": ')
        return dict(model_name_or_path=str(tmp_path / "adapter")), "--model_name_or_path"
    if case in ("a reward model with a shorter context", "a reward model with its own tokenizer and a shorter context"):
        path, own = tmp_path / "short_rm", "own" in case  # prompts of up to 6 words + 6 tokens > 8 positions
        words = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in reversed(range(37))] if own else WORDS
        config("llama", len(words), num_labels=1, max_position_embeddings=8,
               architectures=["LlamaForSequenceClassification"]).save_pretrained(str(path))
        word_tokenizer(words).save_pretrained(str(path))
        return dict(reward_model_path=[str(path)]), "--reward_model_path"
    return {
        "missing policy": (dict(model_name_or_path="/no/such/model"), "--model_name_or_path"),
        "missing reference": (dict(ref_model_path=str(tmp_path / "nothing")), "--ref_model_path"),
        "missing value model": (dict(value_model_path=str(tmp_path / "nothing")), "--value_model_path"),
        "missing reward model": (dict(reward_model_path=[str(tmp_path / "nothing")]), "--reward_model_path"),
        "a causal LM as reward model": (dict(reward_model_path=[tiny["gpt2"]]), "--reward_model_path"),
        "missing prompts": (dict(dataset="/no/such/prompts.txt"), "--dataset"),
        "a prompt too long": (dict(response_length=30), "--response_length"),
        "a response as long as the context": (dict(response_length=32), "--response_length"),
        "a prompt length and response past the context": (dict(max_prompt_length=27), "--max_prompt_length"),
        "a hub eval dataset on the training split": (dict(dataset="someone/prompts", eval_dataset="someone/prompts",
                                                          dataset_test_split="train"), "--dataset_test_split"),
        "own prompts, no reward": (dict(reward_model_path=None), "--reward_fn"),
        "reward_fn without a colon": (dict(reward_model_path=None, reward_fn=["count_w1"]), "--reward_fn"),
        "missing reward module": (dict(reward_model_path=None, reward_fn=["no_such_module:f"]), "--reward_fn"),
        "missing reward function": (dict(reward_model_path=None, reward_fn=[f"{__file__}:no_such"]), "--reward_fn"),
        "missing checkpoint": (dict(resume=str(tmp_path / "checkpoint-000001")), "--resume"),
        "minibatches do not divide": (dict(per_device_train_batch_size=6, num_mini_batches=4), "--num_mini_batches"),
        "micro-batches do not divide": (dict(per_device_train_batch_size=6, gradient_accumulation_steps=2,
                                             num_mini_batches=4), "--gradient_accumulation_steps"),
        "fp16 with fsdp": (dict(dtype="fp16", distributed="fsdp"), "--dtype"),
        "tracking without wandb": (dict(track=True), "--track"),
        "groups do not divide the batch": (dict(num_generations=3), "--num_generations"),
        **{f"{estimator} with one response per prompt": (dict(advantage_estimator=estimator), "--num_generations")
           for estimator in ("rloo", "grpo", "dr_grpo", "reinforce_pp_baseline")},  # a baseline of itself: A = 0
        "a value model without GAE": (dict(value_model_path=tiny["gpt2_rm"], advantage_estimator="reinforce_pp"),
                                      "--value_model_path"),
        "a reference model without KL": (dict(ref_model_path=tiny["gpt2"], kl_coef=0.0), "--ref_model_path"),
        "an adaptive KL of zero": (dict(adaptive_kl_target=1.0, kl_coef=0.0), "--kl_coef"),
        "LoRA without peft": (dict(lora_r=4), "--lora_r"),
        "missing eval prompts": (dict(eval_dataset="/no/such/eval.txt"), "--eval_dataset"),
        "an overlong buffer past the response": (dict(overlong_buffer=7), "--overlong_buffer"),
        "a reference model with LoRA": (dict(lora_r=4, ref_model_path=tiny["gpt2"]), "--ref_model_path"),
        "LoRA target modules without LoRA": (dict(lora_target_modules=["c_attn"]),
                                             "--lora_target_modules"),
        "exporting no checkpoint": (dict(export_checkpoint=True, resume="auto"), "--export_checkpoint"),
        "weights not matching the sources": (dict(reward_fn=[f"{__file__}:count_w1"], reward_weights=[1.0]),
                                             "--reward_weights"),
        "a path where a list goes": (dict(reward_model_path=tiny["gpt2_rm"]), "--reward_model_path"),
        "no stop id, truncated completions masked": (dict(stop_token=None, mask_truncated_completions=True),
                                                     "--mask_truncated_completions"),
        "no stop id, a missing-EOS penalty": (dict(stop_token=None, missing_eos_penalty=1.0), "--missing_eos_penalty"),
        "a stop id outside the vocabulary": (dict(stop_token_id=[5, 999]), "--stop_token_id"),
        "an empty list of stop ids": (dict(stop_token_id=[]), "--stop_token_id"),
        "a reward function of one parameter": (dict(reward_model_path=None, reward_fn=[f"{__file__}:one_param"]),
                                               "--reward_fn"),
        "no reward source for one's own prompts": (dict(reward_model_path=None), "--reward_fn"),
        "a reward function whose arguments all have defaults": (
            dict(reward_model_path=None, reward_fn=[f"{__file__}:only_defaults"]), "--reward_fn"),
        "a reward function of two unnamed parameters": (
            dict(reward_model_path=None, reward_fn=[f"{__file__}:two_params"]), "--reward_fn"),
        "a reward function needing a field the rows lack": (
            dict(reward_model_path=None, reward_fn=[f"{__file__}:needs_answer"]), "--dataset"),
        "a reward function needing a field the held-out rows lack": (
            dict(reward_model_path=None, reward_fn=[f"{__file__}:needs_answer"], dataset=tiny["answers"],
                 eval_dataset=tiny["txt"]), "--eval_dataset"),
        "a reward function asking for TRL's log_metric": (
            dict(reward_model_path=None, reward_fn=[f"{__file__}:wants_log_metric"]), "--reward_fn"),
        "the built-in task without a stop id": (dict(model_name_or_path="builtin", dataset="builtin",
                                                     reward_model_path=None, stop_token=None), "--stop_token"),
        "replay without a correction": (dict(replay_rounds=2), "--replay_correction"),
        "a replay correction without replay": (dict(replay_correction="naive"), "--replay_rounds"),
        "a weight cap without decoupled replay": (dict(replay_rounds=1, replay_correction="naive",
                                                       replay_weight_cap=3.0), "--replay_weight_cap"),
        "warmup with a constant schedule": (dict(lr_scheduler_type="constant", warmup_ratio=0.1), "--warmup_ratio"),
        "a dual clip with cispo": (dict(policy_loss="cispo", dual_clip=3.0), "--dual_clip"),
        "a dual clip with sapo": (dict(policy_loss="sapo", dual_clip=3.0), "--dual_clip"),
        "sequence-level ratios with GAE": (dict(importance_sampling_level="sequence"), "--importance_sampling_level"),
        **{f"sequence-level ratios with {what}": (dict(importance_sampling_level="sequence",
                                                      advantage_estimator="reinforce_pp", **flags),
                                                 "--importance_sampling_level")
           for what, flags in (("cispo", dict(policy_loss="cispo")), ("a dual clip", dict(dual_clip=3.0)))},
        "an off-policy mask with GAE": (dict(off_policy_mask_threshold=0.1), "--off_policy_mask_threshold"),
        "zero-std filtering without groups": (dict(filter_zero_std_groups=True, advantage_estimator="reinforce_pp"),
                                              "--filter_zero_std_groups"),
        "a rollout correction in fp32": (dict(rollout_correction="token_truncate"), "--rollout_correction"),
        "a sequence rollout correction with vespo": (dict(policy_loss="vespo", dtype="bf16",
                                                          rollout_correction="sequence_mask"),
                                                     "--rollout_correction"),
        **{f"clip-higher with {loss}": (dict(policy_loss=loss, cliprange_high=0.28),
                                        "--cliprange_high")
           for loss in ("cispo", "sapo", "vespo")},
        "a rollout correction with replay": (dict(rollout_correction="token_mask", dtype="bf16", replay_rounds=1,
                                                  replay_correction="decoupled"), "--rollout_correction"),
    }[case]


FILE_CASES = ["missing policy", "missing reference", "missing value model", "missing reward model",
              "a causal LM as reward model", "reward model with 2 labels", "missing prompts", "csv prompts",
              "bad jsonl", "empty prompts", "chat prompts, no chat template", "a prompt too long",
              "own prompts, no reward", "reward_fn without a colon", "missing reward module", "missing reward function",
              "output_dir is a file", "a run is in output_dir", "missing checkpoint", "minibatches do not divide",
              "micro-batches do not divide", "fp16 with fsdp", "tracking without wandb",
              "groups do not divide the batch", "rloo with one response per prompt",
              "grpo with one response per prompt", "dr_grpo with one response per prompt",
              "reinforce_pp_baseline with one response per prompt",
              "a value model without GAE", "a reference model without KL", "an adaptive KL of zero",
              "LoRA without peft", "a reference model with LoRA",
              "LoRA target modules without LoRA", "missing eval prompts",
              "an overlong buffer past the response", "weights not matching the sources",
              "a path where a list goes", "no stop id, truncated completions masked",
              "no stop id, a missing-EOS penalty", "a stop id outside the vocabulary", "an empty list of stop ids",
              "a corrupt adapter config", "a reward model with a shorter context",
              "a reward model with its own tokenizer and a shorter context", "a reward function of one parameter",
              "a reward function whose arguments all have defaults",
              "a reward function of two unnamed parameters", "no reward source for one's own prompts",
              "a reward function needing a field the rows lack",
              "a reward function needing a field the held-out rows lack",
              "a reward function asking for TRL's log_metric", "a field named like a reward function's argument",
              "the built-in task without a stop id", "replay without a correction",
              "a replay correction without replay", "a weight cap without decoupled replay",
              "bad jsonl after a blank line", "a response as long as the context",
              "a prompt length and response past the context", "a hub eval dataset on the training split",
              "a tokenizer past the model's vocabulary", "warmup with a constant schedule",
              "a dual clip with cispo", "a dual clip with sapo", "sequence-level ratios with GAE",
              "sequence-level ratios with cispo", "sequence-level ratios with a dual clip",
              "an off-policy mask with GAE", "zero-std filtering without groups", "a rollout correction in fp32",
              "a rollout correction with replay", "exporting no checkpoint",
              "a sequence rollout correction with vespo", "clip-higher with cispo",
              "clip-higher with sapo", "clip-higher with vespo"]


MUST_SAY = {"a tokenizer past the model's vocabulary": "gives prompt ids past the model's vocabulary of 40",
            "a causal LM as reward model": "is a GPT2LMHeadModel checkpoint, which has no reward head",
            "reward model with 2 labels": "with 2 labels", "missing policy": "no such folder",
            "output_dir is a file": "is a file", "missing reward function": "has no function 'no_such'",
            "LoRA without peft": "pip install peft", "a path where a list goes": "takes a list",
            "weights not matching the sources": "one weight per reward source (2: ",
            "no stop id, truncated completions masked": "needs a stop id",
            "a stop id outside the vocabulary": "[999]: not in the policy's vocabulary [0, 40)",
            "a corrupt adapter config": "adapter_config.json cannot be read",
            "a reward model with a shorter context": "more than its context of 8",
            "a reward model with its own tokenizer and a shorter context": "more than its context of 8",
            "a reward function of one parameter": "takes (x): give it (prompts, completions), or keywords",
            "a reward function of two unnamed parameters": "takes (p, c): give it (prompts, completions), or keywords",
            "no reward source for one's own prompts": "no reward for these prompts: give --reward_model_path or",
            "a reward function whose arguments all have defaults":
                "takes (x=None), none of its arguments",
            "a reward function needing a field the rows lack": "needs 'answer', which the rows of --dataset do not",
            "a reward function asking for TRL's log_metric": "asks for ['log_metric']",
            "a field named like a reward function's argument": "field named 'prompts'",
            "bad jsonl after a blank line": "line 3: expected a JSON object",
            "a prompt too long": "longer than --max_prompt_length 2 (context 32 minus --response_length 30)",
            "a response as long as the context": "--max_prompt_length 1 + --response_length 32 is 33 tokens, more "
                                                 "than its context of 32",
            "a prompt length and response past the context": "27 + --response_length 6 is 33 tokens, more than its "
                                                             "context of 32",
            "a hub eval dataset on the training split": "is --dataset with the same split ('train')"}


def test_the_bad_input_table_covers_every_ranged_flag():
    ranged = {f for allowed, (_, flags) in P.FLAG_RANGES.items() if allowed != "any integer"
              for f in flags.split()}
    assert set(OUT_OF_RANGE) == ranged


def numbers_in(kind):
    """The int and float types in a field's type, Optional and list ones too (bool: none)."""
    found = {kind} & {int, float}
    return found.union(*[numbers_in(k) for k in typing.get_args(kind) if isinstance(k, type)
                         or typing.get_args(k)])


def test_every_number_flag_has_a_range_row():
    """Every int or float field of Args (Optional ones, lists of them too) has a row in FLAG_RANGES,
    which check_args reads, or sits in an explicit any-value row: a fork's new numeric flag with
    none would never be range-checked (a negative ratio trains silently)."""
    ranged = {f for _, flags in P.FLAG_RANGES.values() for f in flags.split()}
    numeric = [f.name for f in dataclasses.fields(P.Args) if numbers_in(f.type)]
    assert {"seed", "learning_rate", "reward_weights", "stop_token_id"} <= set(numeric)
    for name in numeric:
        assert name in ranged, f"--{name} is a number with no FLAG_RANGES row: give it its range"


@pytest.mark.parametrize("case", [f"--{flag}" for flag in OUT_OF_RANGE] + FILE_CASES)
def test_bad_input_fails_in_one_line_before_any_model_loads_and_writes_nothing(tiny, tmp_path, monkeypatch, case):
    if case.startswith("--"):
        overrides, flag = {case[2:]: OUT_OF_RANGE[case[2:]]}, case
    else:
        overrides, flag = file_case(case, tiny, tmp_path)
    if case == "fp16 with fsdp":
        monkeypatch.setenv("RANK", "0")  # as under torchrun; the check comes before the process group would start
    if case in ("tracking without wandb", "LoRA without peft"):
        monkeypatch.setitem(sys.modules, "wandb" if case.startswith("tracking") else "peft", None)
    args = run_args(tiny, tmp_path, **overrides)
    before = sorted(os.listdir(tmp_path))

    def no_models(*_):
        raise AssertionError("a model was loaded before the bad input was found")

    monkeypatch.setattr(P, "load_models", no_models)
    with pytest.raises(SystemExit) as exc:
        P.main(args)
    message = str(exc.value)
    assert message.startswith("error: ") and flag in message and "\n" not in message, message
    assert MUST_SAY.get(case, "") in message  # what is wrong, not only where
    assert sorted(os.listdir(tmp_path)) == before  # no output folder made, none touched
    if case == "a run is in output_dir":
        assert os.listdir(args.output_dir) == ["metrics.jsonl"]


RUNTIME_CASES = {  # found only once the models run: still one line, and no metrics or model written
    "a reward function returning the wrong count": (
        dict(reward_model_path=None, reward_fn=[f"{__file__}:wrong_count"]), "--reward_fn"),
    "a reward function returning NaN": (
        dict(reward_model_path=None, reward_fn=[f"{__file__}:nan_score"]), "--reward_fn"),
    "LoRA on layers the model lacks": (dict(lora_r=4, lora_target_modules=["no_such_layer"]), "--lora_target_modules"),
    "a reward function that raises": (dict(reward_model_path=None, reward_fn=[f"{__file__}:raises"]),
                                      "--reward_fn"),
    "a reward function scoring no completion": (dict(reward_model_path=None, reward_fn=[f"{__file__}:none_for_all"]),
                                                "--reward_fn"),
    "a reward function returning strings": (dict(reward_model_path=None, reward_fn=[f"{__file__}:string_scores"]),
                                            "--reward_fn"),
    "a reward function whose generator raises": (
        dict(reward_model_path=None, reward_fn=[f"{__file__}:a_generator_that_raises"]),
        "--reward_fn"),
}
RUNTIME_MUST_SAY = {"a reward function returning strings": "returned a str ('1.0') for completion 0: a score is",
                    "a reward function that raises":
                        "failed: ValueError: the grader is down (test_ppo_rlhf.py:",
                    "a reward function scoring no completion": "no source scored any response of",
                    "a reward function returning NaN":
                        "returned a float (nan) for completion 0: a score is a finite",
                    "a reward function whose generator raises":
                        "failed: ValueError: the grader went down (test_ppo_rlhf.py:",
                    "a reward function returning the wrong count": "returned 7 scores for 8 completions"}


@pytest.mark.parametrize("case", list(RUNTIME_CASES))
def test_bad_input_found_while_running_gets_a_one_line_error_and_writes_nothing(tiny, tmp_path, case):
    overrides, flag = RUNTIME_CASES[case]
    args = run_args(tiny, tmp_path, **overrides)
    with pytest.raises(SystemExit) as exc:
        P.main(args)
    message = str(exc.value)
    assert message.startswith("error: ") and flag in message and "\n" not in message, message
    assert RUNTIME_MUST_SAY.get(case, "") in message, message
    assert not os.path.exists(os.path.join(args.output_dir, "metrics.jsonl"))
    assert not os.path.exists(os.path.join(args.output_dir, "policy"))


def forked(tmp_path, edits):
    """ppo_rlhf.py with each of edits {old: new} made once, saved and imported as a throwaway fork."""
    source = open(SCRIPT).read()
    for old, new in edits.items():
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    (tmp_path / "fork_ppo_rlhf.py").write_text(source)
    spec = importlib.util.spec_from_file_location("fork_ppo_rlhf", tmp_path / "fork_ppo_rlhf.py")
    fork = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fork)
    return fork


def fork_with_no_branch(tmp_path):
    """A throwaway fork that adds an --advantage_estimator value and its row, but not its branch."""
    edits = {'"reinforce_pp_baseline"] = "gae"': '"reinforce_pp_baseline", "forgotten"] = "gae"',
             '"reinforce_pp_baseline": dict(grouped=True, whitened=True, learns_value=False)}':
             '"reinforce_pp_baseline": dict(grouped=True, whitened=True, learns_value=False),\n'
             '              "forgotten": dict(grouped=True, whitened=False, learns_value=False)}'}
    return forked(tmp_path, edits)


def test_a_run_that_fails_before_its_first_update_line_leaves_no_folder(tiny, tmp_path):
    """A run that fails at update 1, before any line of metrics.jsonl (a reward returning None for
    every row; a fork's estimator with no branch: a ValueError with its traceback), removes the
    run folder it made; one it did not make (an empty one given) stays, saying why it stopped."""
    args = run_args(tiny, tmp_path, reward_model_path=None, reward_fn=[f"{__file__}:none_for_all"])
    with pytest.raises(SystemExit, match="no source scored any response of update 1"):
        P.main(args)
    assert not os.path.exists(args.output_dir)
    fork = fork_with_no_branch(tmp_path)
    args = run_args(tiny, tmp_path / "fork", advantage_estimator="forgotten", num_generations=2)
    with pytest.raises(ValueError, match="no branch for --advantage_estimator forgotten"):
        fork.main(args)
    assert not os.path.exists(args.output_dir)
    os.makedirs(tmp_path / "given")
    with pytest.raises(ValueError):
        fork.main(dataclasses.replace(args, output_dir=str(tmp_path / "given")))
    assert os.listdir(tmp_path / "given") == ["stopped.txt"]
    why = (tmp_path / "given" / "stopped.txt").read_text()
    assert why.startswith("error: ValueError: baselined_scores: no branch for ")


def test_the_learning_rate_in_use_and_where_it_came_from(tiny, tmp_path, capsys):
    """Without --learning_rate one's own model trains at 1e-6 (TRL's default), the built-in toy at
    1e-3; a given one always wins; the start line says which and why. A checkpoint written before
    this default (format 4, its config's rate 1e-3 on one's own model) resumes and exports without
    the flag, at its stored rate."""
    for name, flags, lr, why in (("own", dict(learning_rate=None), 1e-6, "a real model's default"),
                                 ("given", dict(learning_rate=5e-4), 5e-4, "--learning_rate")):
        args = run_args(tiny, tmp_path / name, total_episodes=8, **flags)
        P.main(args)
        assert read_metrics(args.output_dir)[0]["lr"] == lr
        start, flags = capsys.readouterr().out.splitlines()[:2]
        assert f", lr {lr:g} ({why}" in start and ("--learning_rate" in flags) == (name == "given")
    builtin = P.Args(total_episodes=128, num_sample_generations=0, eval_on_start=False,
                     output_dir=str(tmp_path / "builtin"))
    P.main(builtin)
    assert read_metrics(builtin.output_dir)[0]["lr"] == 1e-3
    assert ", lr 0.001 (the built-in task's), " in capsys.readouterr().out
    old = run_args(tiny, tmp_path / "old", learning_rate=1e-3, save_every=1, total_episodes=16)
    P.main(old)
    path = os.path.join(old.output_dir, "checkpoint-000001")
    state = torch.load(os.path.join(path, "state.pt"), weights_only=True)
    assert state["config"]["learning_rate"] == 1e-3
    torch.save({**state, "format": 4}, os.path.join(path, "state.pt"))  # as written before
    unset = dataclasses.replace(old, learning_rate=None, resume=path,
                                output_dir=str(tmp_path / "resumed"))
    assert P.main(unset)["lr"] == 1e-3 / 2  # linear schedule: update 2 of 2
    assert ", lr 0.001 (the checkpoint's), " in capsys.readouterr().out
    export = dataclasses.replace(unset, learning_rate=None, export_checkpoint=True,
                                 output_dir=str(tmp_path / "exported"))
    P.main(export)
    assert os.path.isfile(os.path.join(export.output_dir, "complete.json"))


def test_the_held_out_evaluation_before_training_is_update_0(tmp_path, capsys):
    """With held-out prompts (the built-in task's), one evaluation before the first update: update
    0 in metrics.jsonl (its eval/ metrics alone) and samples.jsonl, an eval line after 'update 0';
    every training number the same as with --no-eval-on-start; none on a resume."""
    args = P.Args(total_episodes=384, num_sample_generations=1, save_every=1,
                  output_dir=str(tmp_path / "on"))
    P.main(args)
    out = capsys.readouterr().out.splitlines()
    assert out[2] == "update 0/3  before training" and out[3].startswith("  eval success ")
    metrics = read_metrics(args.output_dir)
    assert set(metrics[0]) == {"update", "episode", "eval/score", "eval/response_length",
                               "eval/success_rate"} and metrics[0]["update"] == 0
    samples = read_lines(os.path.join(args.output_dir, "samples.jsonl"))
    assert [s["update"] for s in samples] == [0] * 20 + [1] * 20 + [3] * 20  # and after 1, 3
    off = dataclasses.replace(args, eval_on_start=False, output_dir=str(tmp_path / "off"))
    P.main(off)
    assert [DETERMINISTIC_KEYS(m) for m in read_metrics(off.output_dir)] == [
        DETERMINISTIC_KEYS(m) for m in metrics[1:]]
    os.remove(os.path.join(args.output_dir, "complete.json"))
    P.main(dataclasses.replace(args, resume=os.path.join(args.output_dir, "checkpoint-000002")))
    assert [m["update"] for m in read_metrics(args.output_dir)] == [0, 1, 2, 3]
    flags = subprocess.run([sys.executable, SCRIPT, "--help"], capture_output=True,
                           text=True).stdout
    assert "--no-eval-on-start" in flags


def test_bad_input_on_the_command_line_has_no_traceback(tmp_path):
    result = subprocess.run([sys.executable, SCRIPT, "--model_name_or_path", "/no/such/model", "--output_dir",
                             str(tmp_path / "o")], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: --model_name_or_path")


def test_the_context_checks_cover_the_held_out_prompts_and_let_an_exact_fit_through(tiny, tmp_path):
    """Prompt + --response_length must fit the policy's context (32) and a reward model's (16, its own config), for
    the held-out prompts as for the training ones; one that fills a context exactly fits."""
    torch.manual_seed(0)
    short_rm = AutoModelForSequenceClassification.from_config(config("gpt2", len(WORDS), n_positions=16, num_labels=1))
    short_rm = save_as_hub(short_rm, tmp_path / "short_rm", word_tokenizer(WORDS))

    def check(eval_words, reward):
        (tmp_path / "eval.txt").write_text(" ".join(["w1"] * eval_words) + "\n")
        args = run_args(tiny, tmp_path, eval_dataset=str(tmp_path / "eval.txt"), **reward)
        P.check_args(args)
        return P.check_inputs(args, args.model_name_or_path, args.dataset, args.eval_dataset, args.output_dir)

    with_rm = dict(reward_model_path=[short_rm])
    without_rm = dict(reward_model_path=None, reward_fn=[f"{__file__}:count_w1"])
    assert len(check(10, with_rm).eval_prompts.ids[0]) == 10  # 10 + 6 = the reward model's 16
    with pytest.raises(SystemExit, match="--reward_model_path .*context of 16"):
        check(11, with_rm)
    assert len(check(26, without_rm).eval_prompts.ids[0]) == 26  # 26 + 6 = the policy's 32
    with pytest.raises(SystemExit, match="--eval_dataset .* has 27 tokens"):
        check(27, without_rm)


def test_the_default_run_is_quiet_and_learns_the_held_out_sums(tmp_path):
    """The default run, whole: the first lines are the start line (it names the value model's new
    head), the evaluation before training and the first update; stderr stays empty (no progress
    bar, no load report, no health hint: the run is healthy), the training success climbs and the
    held-out success is printed after the last update."""
    out = str(tmp_path / "run")
    result = subprocess.run([sys.executable, SCRIPT, "--output_dir", out], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("ppo_rlhf: 400 updates") and lines[0].endswith("value model from the policy with a "
                                                                             "new score head")
    assert lines[1] == "flags: (the defaults)" and lines[2] == "update 0/400  before training"
    assert lines[7].startswith("update 1/400 ")
    before, *metrics = read_metrics(out)
    assert before["update"] == 0 and before["eval/success_rate"] == 0
    assert max(m["objective/success_rate"] for m in metrics[:10]) < 0.1 < 0.8 < metrics[-1]["objective/success_rate"]
    held_out = [line for line in lines if line.startswith("  eval success ")]
    assert len(held_out) == 12 and f"{metrics[-1]['eval/success_rate']:4.0%}" in held_out[-1]
    assert metrics[-1]["eval/success_rate"] > metrics[0]["eval/success_rate"]


def hint_window(kl, scores, truncated, outside=0.1):
    """The metrics health_hints reads, update by update."""
    return [{"objective/kl": k, "objective/scores": s, "val/truncated_frac": t,
             "policy/ratio_outside_clip_avg": outside} for k, s, t in zip(kl, scores, truncated)]


def test_health_hints_fire_on_their_bad_cases_and_only_there():
    """Each hint on a constructed window just past its threshold, and silent just short of it."""
    args, hints = P.Args(health_window=4, response_length=6), P.health_hints
    healthy = hint_window([1, 1.1, 1.2, 1.3], [0.1, 0.2, 0.3, 0.4], [0.5, 0.9, 1.0, 0.2])
    assert hints(healthy, args, True) == {}
    ratio = hints(hint_window([1] * 4, [0.1] * 4, [0.5] * 4, outside=0.6), args, True)  # most ratios out of the clip
    assert list(ratio) == ["ratio"] and "60% of the importance ratios" in ratio["ratio"] and "--learning_rate" in ratio[
        "ratio"]
    assert hints(hint_window([1] * 4, [0.1] * 4, [0.5] * 4, outside=0.5), args, True) == {}  # half is not most
    for kind in ("cispo", "sapo"):  # no clip band: no ratio hint
        assert hints(hint_window([1] * 4, [0.1] * 4, [0.5] * 4, outside=0.9), P.Args(policy_loss=kind), True) == {}
    stale = [dict(m, **{"replay/outside_clip_fresh": 0.1}) for m in hint_window([1] * 4, [0.1] * 4, [0.5] * 4,
                                                                               outside=0.9)]
    assert hints(stale, args, True) == {}  # replay: fresh tokens only (replayed ones start far from π_old)
    drift = hint_window([1, 1, 2, 2], [0.5, 0.6, 0.6, 0.5], [0.5] * 4)  # KL doubles, the score stays
    kl = hints(drift, args, True)
    assert list(kl) == ["kl"] and "rose from 1.00 to 2.00" in kl["kl"] and "--kl_coef" in kl["kl"]
    assert hints(drift[1:], args, True) == {}  # a window not yet full
    assert hints(hint_window([1, 1, 2, 2], [0.5, 0.5, 0.6, 0.6], [0.5] * 4), args, True) == {}  # the score rose
    assert hints(hint_window([1, 1, 1.4, 1.4], [0.5] * 4, [0.5] * 4), args, True) == {}  # up by only 40%
    assert hints(hint_window([0.01, 0.01, 0.09, 0.09], [0.5] * 4, [0.5] * 4), args, True) == {}  # by under 0.1
    assert hints([{k: v for k, v in m.items() if k != "objective/kl"} for m in drift], args, True) == {}  # no π_ref
    cut = hint_window([1, 1.1, 1.2, 1.3], [0.1, 0.2, 0.3, 0.4], [0.9, 1.0, 0.9, 1.0])
    length = hints(cut, args, True)
    assert list(length) == ["length"] and "95% of the responses" in length["length"] and "--response_length 6" in \
        length["length"]
    assert hints(cut, args, False) == {}  # no stop token: every response has response_length tokens
    assert hints(hint_window([1, 1.1, 1.2, 1.3], [0.1, 0.2, 0.3, 0.4], [0.9, 1.0, 0.89, 1.0]), args, True) == {}


def test_a_run_that_moves_too_far_gets_hints_at_most_once_per_window(tiny, tmp_path, capsys):
    """A learning rate 100 times too high (and a length reward that keeps the stop token away): the ratio and the
    length hints are printed on stderr, each at most once per --health_window updates, and the run goes on."""
    args = run_args(tiny, tmp_path, reward_model_path=None, reward_fn=[f"{__file__}:num_words"], total_episodes=96,
                    stop_token_id=5, learning_rate=0.1, health_window=3)
    P.main(args)
    assert len(read_metrics(args.output_dir)) == 12
    lines = capsys.readouterr().err.splitlines()
    assert lines and all(line.startswith("hint: update ") for line in lines)
    for flag in ("--learning_rate", "--response_length"):
        updates = [int(line.split()[2][:-1]) for line in lines if flag in line]
        assert updates and all(b - a >= 3 for a, b in zip(updates, updates[1:])), (flag, updates)
    args = run_args(tiny, tmp_path / "quiet", reward_model_path=None, reward_fn=[f"{__file__}:num_words"],
                    total_episodes=96, stop_token_id=5, learning_rate=0.1, health_window=0)
    P.main(args)
    assert capsys.readouterr().err == ""  # --health_window 0: no hints
    args = run_args(tiny, tmp_path / "no_stop", reward_model_path=None, reward_fn=[f"{__file__}:num_words"],
                    total_episodes=96, stop_token=None, learning_rate=0.1, health_window=3)
    P.main(args)
    captured = capsys.readouterr()
    hints = captured.err
    assert "--learning_rate" in hints and "--response_length" not in hints  # no stop token: every response is full
    note = ("note: no stop id (--stop_token, --stop_token_id, the tokenizer, generation_config): "
            "every response runs to --response_length 6\n")
    assert captured.out.count(note) == 1  # said once, at the start


def test_a_stopped_and_resumed_run_prints_the_hints_the_unbroken_run_prints(tiny, tmp_path, capsys,
                                                                          monkeypatch):
    """The hints' window and quiet periods are rebuilt from metrics.jsonl on a resume: a run stopped
    after update 5 (a signal) and resumed prints, over both parts, the hints the unbroken run
    prints, at the same updates (here the ratio and length hints, a window of 3)."""
    flags = dict(reward_model_path=None, reward_fn=[f"{__file__}:num_words"], total_episodes=96,
                 stop_token_id=5, learning_rate=0.1, health_window=3, save_every=0)
    P.main(run_args(tiny, tmp_path / "unbroken", **flags))
    unbroken = [line for line in capsys.readouterr().err.splitlines() if line.startswith("hint:")]
    monkeypatch.setattr(P, "STOP_SIGNALS", [])
    real = P.checkpoint

    def stop_after_5(output_dir, update, *a, **kw):
        if update == 5:  # as if a SIGTERM came during update 5
            P.STOP_SIGNALS.append((signal.SIGTERM, time.monotonic()))
        return real(output_dir, update, *a, **kw)
    monkeypatch.setattr(P, "checkpoint", stop_after_5)
    P.main(run_args(tiny, tmp_path, **flags))
    first = capsys.readouterr().err.splitlines()
    P.STOP_SIGNALS.clear()
    P.main(run_args(tiny, tmp_path, resume="auto", **flags))
    resumed = first + capsys.readouterr().err.splitlines()
    assert len(read_metrics(tmp_path / "run")) == 12
    assert [line for line in resumed if line.startswith("hint:")] == unbroken
    assert len({line.split(":")[1] for line in unbroken}) >= 3 and any(
        int(line.split()[2][:-1]) > 5 for line in unbroken)  # some hint after the stop


@pytest.mark.parametrize("health_window", [1, 50])
def test_a_hint_is_printed_the_first_time_it_fires_whatever_the_window(tiny, tmp_path, capsys, health_window):
    """A run of 4 updates that moves too far from its first update: the ratio hint (which reads the last update only)
    is printed at its first firing, with a window of 1 (the KL and length hints need two updates or more: none, and
    no crash) and with a window longer than the run; after that at most once per window."""
    args = run_args(tiny, tmp_path, reward_model_path=None, reward_fn=[f"{__file__}:num_words"], total_episodes=32,
                    stop_token_id=5, learning_rate=0.1, health_window=health_window)
    P.main(args)
    lines = capsys.readouterr().err.splitlines()
    fired = [m["update"] for m in read_metrics(args.output_dir) if m["policy/ratio_outside_clip_avg"] > 0.5]
    printed = [int(line.split()[2][:-1]) for line in lines if "--learning_rate" in line]
    assert fired and printed[0] == fired[0] and len(lines) == len(printed)
    assert printed == (fired if health_window == 1 else fired[:1])


def test_gspo_at_its_papers_clip_gets_no_ratio_hint(tiny, tmp_path, capsys):
    """The ratio hint's 50% suits token-level PPO's ε: GSPO at its paper's ε = 3e-4, ε_high = 4e-4
    has most s_i outside the band in its normal regime, so the hint (which would say to lower the
    learning rate) stays silent under --importance_sampling_level sequence, as under cispo and
    sapo."""
    args = run_args(tiny, tmp_path, reward_model_path=None, reward_fn=[f"{__file__}:count_w1"],
                    num_generations=2, advantage_estimator="grpo", cliprange=3e-4,
                    cliprange_high=4e-4, importance_sampling_level="sequence", health_window=1,
                    total_episodes=24)
    P.main(args)
    outside = [m["policy/ratio_outside_clip_avg"] for m in read_metrics(args.output_dir)]
    assert max(outside) > 0.5, outside
    assert "hint:" not in capsys.readouterr().err


LOSS_COLUMNS = {"clip": dict(), "cispo": dict(policy_loss="cispo"),
                "sapo": dict(policy_loss="sapo"), "vespo": dict(policy_loss="vespo"),
                "gspo": dict(importance_sampling_level="sequence", cliprange=3e-4,
                             filter_zero_std_groups=True, off_policy_mask_threshold=0.1)}


@pytest.mark.parametrize("loss", LOSS_COLUMNS)
def test_the_start_names_the_flags_and_the_update_line_each_losss_columns(tiny, tmp_path, capsys,
                                                                         loss):
    """A second start line lists the algorithmic flags given other values than their defaults, as a
    command that reproduces the run (parsed back: the same algorithmic fields); the update line has
    a column for each metric the run has: the clipped share as clipfrac whatever the loss (what it
    clips or caps; SAPO: 0), the off-policy mask's share where it is on, the zero-std share."""
    flags = LOSS_COLUMNS[loss]
    args = run_args(tiny, tmp_path, reward_model_path=None, reward_fn=[f"{__file__}:count_w1"],
                    advantage_estimator="grpo", num_generations=2, total_episodes=8, **flags)
    P.main(args)
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("flags: --model_name_or_path ")
    parsed = tyro.cli(P.Args, args=shlex.split(out[1].removeprefix("flags: ")))
    P.check_args(parsed)
    algorithmic = lambda a: {k: v for k, v in dataclasses.asdict(a).items()  # noqa: E731
                             if k not in P.RUN_ONLY_FIELDS}
    assert algorithmic(parsed) == algorithmic(args)
    update = next(line for line in out if line.startswith("update 1/1 "))
    assert "  clipfrac " in update and " capped " not in update and " seq " not in update
    assert ("  masked " in update) == (loss == "gspo")  # the off-policy mask's share, where on
    assert "  zero_std " in update  # the groups of no signal (k = 2), filtered or not


def test_the_flags_line_is_the_flags_as_given_at_any_world_size(monkeypatch):
    """The flags line is built by check_args, before any model loads, from the flags as given
    against Args' defaults: no size check runs on the defaults, so 512 processes with valid sizes
    (a batch of 65,536) get it; a default that resolves (--kl_estimator) is not listed."""
    monkeypatch.setenv("WORLD_SIZE", "512")
    args = P.Args(total_episodes=131072, kl_in="loss", seed=3)
    sizes = P.check_args(args)
    assert sizes.batch_size == 65536 and args.kl_estimator == "k3"
    assert sizes.flags == "--seed 3 --total_episodes 131072 --kl_in loss"
    with pytest.raises(SystemExit, match="--total_episodes 51200 is less than one rollout batch"):
        P.check_args(P.Args())  # the defaults alone would not do at this size


def test_an_existing_run_is_never_overwritten(tiny, tmp_path):
    args = run_args(tiny, tmp_path, total_episodes=8, per_device_train_batch_size=8)
    P.main(args)
    before = open(os.path.join(args.output_dir, "metrics.jsonl")).read()
    with pytest.raises(SystemExit, match="--output_dir"):
        P.main(args)
    assert open(os.path.join(args.output_dir, "metrics.jsonl")).read() == before


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])  # fp16: GradScaler would skip such steps silently, forever
def test_non_finite_losses_skip_updates_then_abort(tiny, tmp_path, capsys, dtype):
    args = run_args(tiny, tmp_path, reward_model_path=None, reward_fn=[f"{__file__}:huge_score"], total_episodes=64,
                    dtype=dtype)
    with pytest.raises(SystemExit, match="non-finite") as exc, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        P.main(args)
    assert "\n" not in str(exc.value) and not [w for w in caught if "lr_scheduler" in str(w.message)]
    assert capsys.readouterr().err.count("warning: update") == 3
    assert len(read_metrics(args.output_dir)) == 2  # the two skipped updates before the abort were still logged


def test_hub_dataset_without_the_datasets_package(tiny, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(SystemExit, match="pip install datasets"):
        P.main(run_args(tiny, tmp_path, dataset="someone/prompts"))


class HubSplit(list):
    column_names = ["prompt"]


def test_a_hub_eval_dataset_reads_dataset_test_split(tiny, tmp_path, monkeypatch):
    """--dataset_train_split for --dataset, --dataset_test_split (default test) for --eval_dataset, even of the same
    hub dataset: datasets.load_dataset is asked for those splits and each set of prompts is its split's."""
    asked = []

    def load_dataset(path, split):
        asked.append((path, split))
        return HubSplit([{"prompt": f"w{i} w{i + 1}", "split": split} for i in range(3 if split == "train" else 2)])

    monkeypatch.setitem(sys.modules, "datasets", SimpleNamespace(load_dataset=load_dataset))
    for test_split in ("test", "validation"):
        args = run_args(tiny, tmp_path, dataset="someone/prompts", eval_dataset="someone/prompts",
                        **({"dataset_test_split": test_split} if test_split != "test" else {}))
        P.check_args(args)
        inputs = P.check_inputs(args, tiny["gpt2"], args.dataset, args.eval_dataset, args.output_dir)
        assert asked[-2:] == [("someone/prompts", "train"), ("someone/prompts", test_split)]
        assert inputs.prompts.fields["split"] == ["train"] * 3
        assert inputs.eval_prompts.fields["split"] == [test_split] * 2
    args = run_args(tiny, tmp_path, eval_dataset="someone/prompts")  # a local --dataset beside it: no file to compare
    inputs = P.check_inputs(args, tiny["gpt2"], args.dataset, args.eval_dataset, args.output_dir)
    assert asked[-1] == ("someone/prompts", "test") and len(inputs.eval_prompts.ids) == 2


def test_the_same_local_file_for_training_and_evaluation_gets_a_warning_on_rank_0(tiny, tmp_path, monkeypatch, capsys):
    args = run_args(tiny, tmp_path, dataset=tiny["txt"], eval_dataset=tiny["txt"])
    for rank, warned in (("1", False), ("0", True)):
        monkeypatch.setenv("RANK", rank)
        P.check_inputs(args, tiny["gpt2"], args.dataset, args.eval_dataset, args.output_dir)
        err = capsys.readouterr().err
        assert err == (f"warning: --eval_dataset {tiny['txt']!r} is the --dataset file: it evaluates on training "
                       "prompts\n" if warned else "")


def test_eval_dataset_auto_is_the_built_in_held_out_sums_or_none_says_so_and_resumes(tiny, tmp_path, capsys):
    """The default --eval_dataset auto: the built-in task's 20 held-out sums for it (80 train), none for one's own
    prompts; the start line says which."""
    assert P.Args().eval_dataset == "auto"
    P.main(run_args(tiny, tmp_path / "own", reward_model_path=None, reward_fn=[f"{__file__}:count_w1"],
                    total_episodes=8, num_ppo_epochs=1))
    assert "40 prompts, no eval (--eval_dataset auto: none for one's own --dataset), " in capsys.readouterr().out
    args = P.Args(output_dir=str(tmp_path / "builtin"), total_episodes=16, per_device_train_batch_size=8,
                  num_ppo_epochs=1, num_sample_generations=0, save_every=1, eval_on_start=False)
    P.main(args)
    start = capsys.readouterr().out.splitlines()[0]
    assert "80 prompts, eval 20 prompts (--eval_dataset auto: the built-in task's held-out sums), " in start
    P.main(dataclasses.replace(args, resume=os.path.join(args.output_dir, "checkpoint-000001")))
    assert [m["update"] for m in read_metrics(args.output_dir)] == [1, 2]
    assert ["eval/score" in m for m in read_metrics(args.output_dir)] == [False, True]  # after the last update


def test_over_long_prompts_are_an_error_naming_their_row_and_line_counted_from_1(tiny, tmp_path):
    """Blank lines are skipped, so the row (of the prompts) and the line (of the file) differ; both count from 1."""
    path = tmp_path / "prompts.txt"
    path.write_text("w1 w2\n\n\nw3 w4 w5 w6\nw7\n\nw1 w2 w3 w4 w5\n")
    tokenizer = AutoTokenizer.from_pretrained(tiny["gpt2"])
    with pytest.raises(SystemExit) as exc:
        P.load_prompts(str(path), run_args(tiny, tmp_path, max_prompt_length=3), tokenizer, 32)
    assert str(exc.value) == (f"error: --dataset {str(path)!r}: row 2 (line 4) has 4 tokens, the first of 2 longer "
                              "than --max_prompt_length 3; shorten them or pass --overlong_prompts "
                              "filter|truncate_left")
    with pytest.raises(SystemExit, match=r"row 2 \(line 4\) has 4 tokens, the first of 2 longer than "
                                         r"--max_prompt_length 3 \(context 9 minus --response_length 6\)"):
        P.load_prompts(str(path), run_args(tiny, tmp_path), tokenizer, 9)  # the default: the context's room


@pytest.mark.parametrize("mode", ["filter", "truncate_left"])
def test_over_long_prompts_are_filtered_or_truncated_for_every_reader(tiny, tmp_path, monkeypatch, capsys, mode):
    """--max_prompt_length 4: filter leaves the longer rows out (with their fields), truncate_left keeps their last 4
    token ids; the policy's queries and the reward function's prompts are the kept rows' tokens and their text, the
    start line counts them."""
    monkeypatch.setenv("REWARD_LOG", str(tmp_path / "log"))
    calls = spy_on_updates(monkeypatch)
    args = run_args(tiny, tmp_path, reward_model_path=None, reward_fn=[f"{__file__}:answer_matches"],
                    dataset=tiny["answers"], max_prompt_length=4, overlong_prompts=mode, total_episodes=16)
    P.main(args)
    rows = read_lines(tiny["answers"])
    over = [r for r in rows if len(r["prompt"].split()) > 4]
    assert 0 < len(over) < len(rows)
    counted = f"{len(rows) - len(over)} prompts ({len(over)} over-long filtered)" if mode == "filter" else \
        f"{len(rows)} prompts ({len(over)} over-long truncated)"
    assert f"), {counted}, no eval " in capsys.readouterr().out.splitlines()[0]
    kept = defaultdict(list)  # {prompt as trained on: the fields of its rows} (two rows have the same prompt)
    for r in rows if mode == "truncate_left" else [r for r in rows if r not in over]:
        kept[" ".join(r["prompt"].split()[-4:])].append((r["answer"], r.get("note")))
    tokenizer = AutoTokenizer.from_pretrained(tiny["gpt2"])
    logged = read_lines(tmp_path / "log.0")
    for call, (batch, *_) in zip(logged, calls):
        assert all(f in kept[p] for f, p in zip(zip(call["answer"], call["fields"]["note"]), call["prompts"]))
        queries = batch["query_responses"][:, :batch["context_length"]]
        mask = batch["attention_mask"][:, :batch["context_length"]]
        assert [tokenizer.decode(q[m]) for q, m in zip(queries, mask)] == call["prompts"]  # the policy reads the same
    assert len(logged) == len(calls) == 2 and max(len(p.split()) for c in logged for p in c["prompts"]) <= 4
    if mode == "truncate_left":  # some truncated ones were trained on
        assert {p for c in logged for p in c["prompts"]} & {" ".join(r["prompt"].split()[-4:]) for r in over}


def test_truncate_left_keeps_the_last_ids_of_every_row_and_reward_models_check_the_truncated_text(
        tiny, tmp_path):
    """--overlong_prompts truncate_left keeps a prompt's last ids: a chat row's as TRL truncates
    it, its chat template's ids from the left (its messages kept whole for the reward functions);
    a reward model reads the text of the ids kept."""
    chat_tokenizer = AutoTokenizer.from_pretrained(tiny["chat"])
    path = tmp_path / "mixed.jsonl"
    plain, short = "w1 w2 w3 w4 w5 w6 w7 w8", {"messages": [{"role": "user", "content": "w1"}]}
    rows = [{"prompt": plain}, {"messages": [{"role": "user", "content": plain}]}, short]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = run_args(tiny, tmp_path, max_prompt_length=6, overlong_prompts="truncate_left")
    prompts = P.load_prompts(str(path), args, chat_tokenizer, 32)
    assert prompts.ids[0] == chat_tokenizer(plain)["input_ids"][-6:] and prompts.texts[0] == "w3 w4 w5 w6 w7 w8"
    templated = chat_tokenizer.apply_chat_template(rows[1]["messages"], tokenize=False,
                                                   add_generation_prompt=True)
    whole = chat_tokenizer(templated, add_special_tokens=False)["input_ids"]
    assert len(whole) > 6 and prompts.ids[1] == whole[-6:]  # the template's last 6 ids
    assert prompts.texts[1] == chat_tokenizer.decode(whole[-6:])
    assert prompts.messages == [None, rows[1]["messages"], short["messages"]]
    assert (prompts.filtered, prompts.truncated) == (0, 2) and P.described(prompts) == (
        "3 prompts (2 over-long truncated)")
    overrides, _ = file_case("a reward model with its own tokenizer and a shorter context", tiny, tmp_path)
    args = run_args(tiny, tmp_path, **overrides)
    with pytest.raises(SystemExit, match="more than its context of 8"):  # prompts of up to 6 words, 6 response tokens
        P.check_inputs(args, tiny["gpt2"], args.dataset, None, args.output_dir)
    args = dataclasses.replace(args, max_prompt_length=2, overlong_prompts="truncate_left")  # 2 + 6 fit its 8
    P.check_inputs(args, tiny["gpt2"], args.dataset, None, args.output_dir)
    with pytest.raises(SystemExit, match="all 3 prompts are longer than --max_prompt_length 1, and --overlong_prompts "
                                         "filter leaves none"):
        P.load_prompts(str(path), P.Args(max_prompt_length=1, overlong_prompts="filter"), chat_tokenizer, 32)


def string_scores(completions, **kwargs):
    return ["1.0"] * len(completions)


def a_generator_that_raises(completions, **kwargs):  # the user's error, met as its scores are read
    yield 1.0
    raise ValueError("the grader went down")


def test_reward_function_scores_are_real_numbers_or_none():
    import numpy as np
    given = [1.0, 2, True, np.float32(0.5), np.int64(3), torch.tensor(0.25), torch.tensor(4), None]
    assert P.check_scores(given, 8, "--reward_fn f").tolist()[:7] == [1.0, 2.0, 1.0, 0.5, 3.0, 0.25, 4.0]
    for bad, named in (("1.0", "a str ('1.0')"), ("correct", "a str ('correct')"), (torch.ones(1), "a Tensor"),
                       ([1.0], "a list ([1.0])"), (b"1", "a bytes")):
        with pytest.raises(SystemExit) as exc:
            P.check_scores([0.0, bad], 2, "--reward_fn f")
        assert str(exc.value).startswith(f"error: --reward_fn f returned {named}") and "for completion 1: a score" in \
            str(exc.value)


# ----------------------------------------------------------------------------------------------- checkpoints and resume
def DETERMINISTIC_KEYS(m):
    return {k: v for k, v in m.items() if not k.startswith(("time/", "memory/")) and k != "eps"}


def test_a_reward_function_that_fails_at_update_3_leaves_a_checkpoint_of_update_2(tiny, tmp_path,
                                                                                   monkeypatch):
    """A failure after update 1 (here a reward function raising at update 3, with --save_every 0)
    first writes a checkpoint of the updates done, then stops with one line that says how to go
    on; that command, the grader back, finishes the run as an unbroken one would (bit-identical
    metrics and weights)."""
    flags = dict(reward_model_path=None, reward_fn=[f"{__file__}:down_at_update_3"],
                 total_episodes=32)
    out = str(tmp_path / "run")
    monkeypatch.setenv("GRADER_DOWN", "1")
    with pytest.raises(SystemExit) as failure:
        P.main(run_args(tiny, tmp_path, **flags))
    line = str(failure.value)
    assert "\n" not in line
    assert line.startswith(f"error: --reward_fn {__file__}:down_at_update_3 failed: ")
    assert line.endswith(f"; saved {out}/checkpoint-000002; continue with the same "
                         f"flags plus: --output_dir {out} --resume auto")
    assert P.list_checkpoints(out) == [f"{out}/checkpoint-000002"] and len(read_metrics(out)) == 2
    with open(os.path.join(out, "stopped.txt")) as f:  # the run folder says why, and how to go on
        assert f.read() == line + "\n"
    monkeypatch.delenv("GRADER_DOWN")
    P.main(run_args(tiny, tmp_path, resume="auto", **flags))
    assert "complete.json" in os.listdir(out) and "stopped.txt" not in os.listdir(out)
    P.main(run_args(tiny, tmp_path / "unbroken", **flags))
    resumed, unbroken = read_metrics(out), read_metrics(str(tmp_path / "unbroken" / "run"))
    assert [DETERMINISTIC_KEYS(m) for m in resumed] == [DETERMINISTIC_KEYS(m) for m in unbroken]
    assert len(resumed) == 4
    weights, straight = final_weights(out), final_weights(str(tmp_path / "unbroken" / "run"))
    assert all(torch.equal(v, straight["policy"][k]) for k, v in weights["policy"].items())


def cli_run(tiny, output_dir, *extra, cwd=None, stream=subprocess.PIPE, **popen):
    """The script on the tiny GPT-2 for 12 updates, a checkpoint after each; output_dir None: the default folder;
    stream: where stdout and stderr go (a pipe each, or one file descriptor for both);
    popen: Popen's own arguments."""
    cmd = [sys.executable, SCRIPT, "--model_name_or_path", tiny["gpt2"], "--reward_fn", f"{__file__}:count_w1",
           "--dataset", tiny["prompts"], *(["--output_dir", output_dir] if output_dir else []), "--total_episodes",
           "96", "--per_device_train_batch_size", "8", "--num_mini_batches", "2", "--num_ppo_epochs", "2",
           "--response_length", "6", "--learning_rate", "1e-3", "--num_sample_generations", "0", "--save_every", "1",
           "--eval_dataset", tiny["txt"], "--no-eval-on-start", *extra]
    return subprocess.Popen(cmd, stdout=stream, stderr=stream, text=True, cwd=cwd, **popen,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"})


def final_weights(output_dir):
    """The saved models' weights (of an adapter folder: the adapter's), by folder."""
    from safetensors.torch import load_file
    files = {name: [os.path.join(output_dir, name, f) for f in ("model.safetensors", "adapter_model.safetensors")]
             for name in ("policy", "value_model")}
    return {name: load_file(next(f for f in paths if os.path.exists(f))) for name, paths in files.items()
            if os.path.exists(os.path.join(output_dir, name))}


@pytest.fixture(scope="module")
def straight(tiny, tmp_path_factory):
    """flags -> the output folder of cli_run(flags) left to finish: what a stopped and resumed run must reproduce
    (made once per set of flags)."""
    runs = {}

    def run(*flags):
        if flags not in runs:
            runs[flags] = str(tmp_path_factory.mktemp("straight") / "run")
            assert cli_run(tiny, runs[flags], *flags).wait(timeout=300) == 0
        return runs[flags]
    return run


VALUE_FREE = ("--advantage_estimator", "grpo", "--num_generations", "2", "--kl_in", "loss", "--adaptive_kl_target",
              "0.5", "--adaptive_kl_horizon", "50", "--num_sample_generations", "12", "--eval_temperature", "1")
# no value model; β changes every update, and is checkpointed; held-out evaluation after every update (samples.jsonl)


LORA = ("--lora_r", "4", "--learning_rate", "1e-2",  # the checkpoint holds the adapters and the value head only
        "--score_scaling", "running_std")  # and the running moments of the scores


REPLAY = ("--replay_rounds", "2", "--replay_correction", "decoupled")  # the checkpoint holds the last 2 batches


@pytest.mark.parametrize("sig,flags", [(signal.SIGKILL, ()), (signal.SIGTERM, ()), (signal.SIGKILL, VALUE_FREE),
                                       (signal.SIGKILL, LORA), (signal.SIGKILL, (*REPLAY, "--dtype", "bf16"))],
                         ids=["kill", "term", "value_free", "lora", "replay"])
def test_a_killed_run_resumes_bit_identically(tiny, tmp_path, sig, flags, straight):
    killed = str(tmp_path / "killed")
    process = cli_run(tiny, killed, *flags)
    deadline = time.time() + 300
    while not os.path.exists(os.path.join(killed, "checkpoint-000002")) and time.time() < deadline:
        time.sleep(0.01)
    process.send_signal(sig)
    out, err = process.communicate(timeout=300)
    if sig == signal.SIGTERM:
        assert process.returncode == 0 and "--resume auto" in out, err
    else:
        assert process.returncode == -signal.SIGKILL
    interrupted_at = len(read_metrics(killed))
    assert 2 <= interrupted_at < 12 and not os.path.exists(os.path.join(killed, "policy"))
    resumed = cli_run(tiny, killed, *flags, "--resume", "auto")
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0 and "resumed from" in out, err
    a, b = read_metrics(straight(*flags)), read_metrics(killed)
    assert len({m["objective/kl_coef"] for m in a}) == (12 if flags == VALUE_FREE else 1)
    assert [m["update"] for m in b] == list(range(1, 13))  # one line per update: no duplicate, no gap
    assert [DETERMINISTIC_KEYS(m) for m in a] == [DETERMINISTIC_KEYS(m) for m in b]
    if flags[:4] == REPLAY:  # ages 1 and 2 from update 3 on: a third of the tokens each (bf16 autocast)
        assert a[1]["replay/kl_age1"] > 0 and a[1]["replay/kl_age2"] is None and a[2]["replay/kl_age2"] > 0
        assert 0.8 < a[-1]["replay/mean_age"] < 1.2 and 0.55 < a[-1]["replay/share"] < 0.8
    samples = [read_lines(os.path.join(run, "samples.jsonl")) for run in (straight(*flags), killed)]
    n = len([line for line in open(tiny["txt"]) if line.strip()])
    assert samples[0] == samples[1] and len(samples[0]) == n * (12 if flags == VALUE_FREE else 1)
    wa, wb = final_weights(straight(*flags)), final_weights(killed)
    assert list(wa) == (["policy"] if flags == VALUE_FREE else ["policy", "value_model"])
    for name in wa:
        assert wa[name].keys() == wb[name].keys() and all(torch.equal(wa[name][k], wb[name][k]) for k in wa[name])


def test_a_run_stopped_in_its_default_folder_resumes_with_resume_auto_alone(tiny, tmp_path, straight):
    """Without --output_dir a run writes runs/<exp_name>__<seed>__<time>/; stopped by Ctrl-C (SIGINT), it says the
    flags to add, and the same command plus --resume auto (no --output_dir) finds that folder and goes on exactly."""
    process = cli_run(tiny, None, cwd=tmp_path)
    deadline = time.time() + 300
    while not glob.glob(str(tmp_path / "runs" / "ppo_rlhf__1__*" / "checkpoint-000002")) and time.time() < deadline:
        time.sleep(0.01)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=300)
    folder = os.path.relpath(glob.glob(str(tmp_path / "runs" / "ppo_rlhf__1__*"))[0], tmp_path)
    assert process.returncode == 0 and f"--output_dir {folder} --resume auto" in out.splitlines()[-1], err
    notice = ("SIGINT: finishing this update, then saving a checkpoint (a second Ctrl-C stops at "
              "once, losing this update)")
    assert err.strip().splitlines()[-1] == notice
    resumed = cli_run(tiny, None, "--resume", "auto", cwd=tmp_path)
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0 and f"output {folder}" in out.splitlines()[0] and "resumed from" in out, err
    assert os.listdir(tmp_path / "runs") == [os.path.basename(folder)]  # no new folder
    a, b = read_metrics(straight()), read_metrics(tmp_path / folder)
    assert [DETERMINISTIC_KEYS(m) for m in a] == [DETERMINISTIC_KEYS(m) for m in b]


def test_resume_auto_with_nothing_to_resume_says_where_it_looked_starts_then_resumes(
        tiny, tmp_path, monkeypatch, capsys):
    """A requeue script's one command, --resume auto, on its first launch (no runs/ yet) starts a
    run, naming the runs/ it searched and the folder it starts as absolute paths (a job started in
    another folder looks elsewhere); stopped after update 1, the same command resumes it, and once
    more finds it complete."""
    monkeypatch.chdir(tmp_path)
    args = run_args(tiny, tmp_path, output_dir=None, resume="auto", save_every=0)
    stop = [(signal.SIGTERM, time.monotonic())]
    monkeypatch.setattr(P, "STOP_SIGNALS", stop)  # stops after update 1
    P.main(args)
    folder = glob.glob(str(tmp_path / "runs" / "ppo_rlhf__1__*"))[0]
    assert (f"--resume auto: no checkpoint in {tmp_path}/runs/ppo_rlhf__1__*, nothing to resume: "
            f"starting {folder} at update 1") in capsys.readouterr().out
    monkeypatch.setattr(P, "STOP_SIGNALS", [])
    P.main(args)
    assert "resumed from runs/ppo_rlhf__1__" in capsys.readouterr().out
    assert [m["update"] for m in read_metrics(folder)] == [1, 2]
    assert P.main(args) is None and "holds a complete run of 2 updates" in capsys.readouterr().out


def test_resume_auto_alone_takes_the_newest_run_folder_that_has_a_checkpoint(tmp_path, monkeypatch):
    """Without --output_dir, --resume auto goes on in the newest runs/<exp_name>__<seed>__<time> with a checkpoint:
    not a newer one without (a run that died before its first save), nor another seed's or name's."""
    monkeypatch.chdir(tmp_path)
    for folder, checkpoint in (("ppo_rlhf__1__100", True), ("ppo_rlhf__1__200", True), ("ppo_rlhf__1__300", False),
                               ("ppo_rlhf__2__400", True), ("other__1__500", True), ("ppo_rlhf__1__600.old", True)):
        os.makedirs(f"runs/{folder}/checkpoint-000001" if checkpoint else f"runs/{folder}")
        (tmp_path / "runs" / folder / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "runs" / "ppo_rlhf__1__700").write_text("a note, not a run")  # a plain file
    folder = P.run_folder(P.Args(resume="auto"), SimpleNamespace(rank=0))
    assert folder == os.path.join("runs", "ppo_rlhf__1__200")


def test_only_rank_0_prints_the_stop_notice(monkeypatch, capsys):
    for rank, printed in (("1", False), ("0", True)):
        monkeypatch.setattr(P, "STOP_SIGNALS", [])
        monkeypatch.setenv("RANK", rank)
        P.request_stop(signal.SIGINT, None)
        assert ("SIGINT: finishing this update" in capsys.readouterr().err) == printed and P.STOP_SIGNALS


def test_a_stopped_run_keeps_how_to_go_on_in_its_folder_and_warns_of_a_second_ctrl_c(
        tiny, tmp_path, monkeypatch, capsys):
    """`... 2>&1 | tee log` dies with the Ctrl-C, and with it the lines saying how to go on:
    stopped.txt in the run folder keeps them. The notice says what a second Ctrl-C costs."""
    monkeypatch.setattr(P, "STOP_SIGNALS", [])
    P.request_stop(signal.SIGINT, None)  # Ctrl-C during update 1
    assert capsys.readouterr().err == ("\nSIGINT: finishing this update, then saving a checkpoint "
                                       "(a second Ctrl-C stops at once, losing this update)\n")
    args = run_args(tiny, tmp_path, save_every=0)
    P.main(args)
    how = (f"saved {args.output_dir}/checkpoint-000001; continue with the same flags plus: "
           f"--output_dir {args.output_dir} --resume auto")
    assert capsys.readouterr().out.splitlines()[-1] == how
    with open(os.path.join(args.output_dir, "stopped.txt")) as f:
        assert f.read() == f"stopped by a signal after update 1\n{how}\n"
    P.STOP_SIGNALS.clear()
    P.main(dataclasses.replace(args, resume="auto"))  # completed: the note of the stop goes
    assert "complete.json" in os.listdir(args.output_dir)
    assert "stopped.txt" not in os.listdir(args.output_dir)


def test_a_signal_delivered_twice_is_one_stop_request_but_a_later_one_exits(monkeypatch):
    monkeypatch.setattr(P, "STOP_SIGNALS", [])
    exits = []
    monkeypatch.setattr(os, "_exit", exits.append)
    P.request_stop(signal.SIGINT, None)
    P.request_stop(signal.SIGINT, None)  # Ctrl-C under torchrun: from the terminal and again from torchrun
    assert len(P.STOP_SIGNALS) == 1 and exits == []
    P.STOP_SIGNALS[0] = (signal.SIGINT, time.monotonic() - 2)  # a second Ctrl-C 2 s later: leave now
    P.request_stop(signal.SIGINT, None)
    assert exits == [128 + signal.SIGINT]


@pytest.mark.parametrize("output,sig", [("pipe", signal.SIGINT), ("pty", signal.SIGHUP)], ids=["pipe", "pty"])
def test_a_run_whose_output_is_gone_stops_saves_and_resumes_bit_identically(tiny, tmp_path, output, sig, straight):
    """`... 2>&1 | tee log`, then Ctrl-C: tee exits, then every write fails (EPIPE); a closed terminal: SIGHUP, and
    writes fail (EIO). The run drops those lines, saves a checkpoint after the update it finishes (--save_every 0:
    the only one), exits 0, and resumes as if it had not stopped."""
    import pty
    stopped = str(tmp_path / "stopped")
    if output == "pipe":
        process = cli_run(tiny, stopped, "--save_every", "0")
        reader = process.stdout
    else:  # stdout and stderr on a pseudo-terminal, whose master side the test holds
        master, slave = pty.openpty()
        # SIGHUP at its default, as a terminal's shell starts it: a suite run under nohup passes on
        # SIG_IGN, which the script keeps (nohup's meaning), and the run would never stop
        hup = lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL)  # noqa: E731
        process = cli_run(tiny, stopped, "--save_every", "0", stream=slave, preexec_fn=hup)
        os.close(slave)
        reader = open(master, errors="replace")
    for line in reader:  # the first update line: the run is under way
        if line.startswith("update "):
            break
    reader.close()  # the pipe's reader exits, or the terminal closes
    if process.stderr:
        process.stderr.close()
    process.send_signal(sig)
    assert process.wait(timeout=300) == 0
    stopped_at = len(read_metrics(stopped))
    checkpoint = os.path.join(stopped, f"checkpoint-{stopped_at:06d}")
    assert P.list_checkpoints(stopped) == [checkpoint] and 1 <= stopped_at < 12
    assert not os.path.exists(os.path.join(stopped, "policy"))
    resumed = cli_run(tiny, stopped, "--resume", "auto")
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0 and f"resumed from {checkpoint} after update {stopped_at}" in out, err
    a, b = read_metrics(straight()), read_metrics(stopped)
    assert [DETERMINISTIC_KEYS(m) for m in a] == [DETERMINISTIC_KEYS(m) for m in b]
    wa, wb = final_weights(straight()), final_weights(stopped)
    assert list(wa) == list(wb) == ["policy", "value_model"]
    assert all(wa[name].keys() == wb[name].keys() and all(torch.equal(wa[name][k], wb[name][k]) for k in wa[name])
               for name in wa)


def test_resume_auto_on_a_finished_run_says_it_is_complete_and_redoes_nothing(tiny, tmp_path, monkeypatch, capsys):
    """In its --output_dir with a checkpoint left (without the marker it would redo update 3 and rewrite policy/), and
    in its default folder with none (found by the marker alone: no new folder)."""
    monkeypatch.chdir(tmp_path)
    for output_dir, save_every in ((str(tmp_path / "run"), 1), (None, 0)):
        args = run_args(tiny, tmp_path, output_dir=output_dir, total_episodes=24, save_every=save_every)
        P.main(args)
        folder = output_dir or glob.glob(os.path.join("runs", "ppo_rlhf__1__*"))[0]
        with open(os.path.join(folder, "complete.json")) as f:
            marker = json.load(f)
        assert marker["updates"] == 3 and f"saved {marker['saved']} to {folder}" in capsys.readouterr().out

        def files():  # name -> (inode, mtime): a file or folder rewritten (save_folder swaps one in) differs
            stats = {n: os.stat(os.path.join(folder, n)) for n in os.listdir(folder)}
            return {n: (s.st_ino, s.st_mtime_ns) for n, s in stats.items()}
        before, metrics = files(), open(os.path.join(folder, "metrics.jsonl")).read()
        assert P.main(dataclasses.replace(args, resume="auto")) is None
        assert capsys.readouterr().out == (f"--resume auto: {folder} holds a complete run of 3 updates, nothing to "
                                           f"resume; saved there: {marker['saved']}\n")
        assert files() == before and open(os.path.join(folder, "metrics.jsonl")).read() == metrics
    assert len(os.listdir("runs")) == 1


def test_resume_auto_on_a_crashed_run_sets_its_metrics_aside_and_starts_over(tiny, tmp_path, capsys):
    """A run that crashed before any checkpoint (here: non-finite losses) leaves metrics.jsonl: a rerun is refused
    naming --resume auto, which keeps that log as metrics.jsonl.stale-<time> and runs as a new run would."""
    args = run_args(tiny, tmp_path, reward_model_path=None, reward_fn=[f"{__file__}:huge_score"], total_episodes=24)
    with pytest.raises(SystemExit, match="non-finite"):  # at update 3, with updates 1 and 2 logged
        P.main(args)
    crashed = open(os.path.join(args.output_dir, "metrics.jsonl")).read()
    args = dataclasses.replace(args, reward_fn=[f"{__file__}:count_w1"], total_episodes=16)
    with pytest.raises(SystemExit, match="pass --resume auto .* sets its metrics.jsonl aside and starts over"):
        P.main(args)
    capsys.readouterr()
    P.main(dataclasses.replace(args, resume="auto"))
    stale = glob.glob(os.path.join(args.output_dir, "metrics.jsonl.stale-*"))
    assert len(stale) == 1 and open(stale[0]).read() == crashed and len(crashed.splitlines()) == 2
    assert f"set aside as {os.path.basename(stale[0])}, starting over at update 1" in capsys.readouterr().out
    fresh = dataclasses.replace(args, output_dir=str(tmp_path / "fresh"))
    P.main(fresh)
    assert [DETERMINISTIC_KEYS(m) for m in read_metrics(args.output_dir)] == [
        DETERMINISTIC_KEYS(m) for m in read_metrics(fresh.output_dir)]
    assert [m["update"] for m in read_metrics(args.output_dir)] == [1, 2]


@pytest.mark.parametrize("damaged", ["state.pt", "__0_0.distcp", "replay-rank0.pt"])
def test_a_damaged_checkpoint_is_refused_or_skipped(tiny, tmp_path, capsys, damaged):
    """The small state, a DCP shard of the weights, or rank 0's replay buffer (cut, then lost)."""
    replay = dict(replay_rounds=1, replay_correction="naive") if damaged[:6] == "replay" else {}
    args = run_args(tiny, tmp_path, total_episodes=24, save_every=1,  # 3 updates; checkpoints 2 and 3 are kept
                    eval_dataset=tiny["txt"], num_sample_generations=3,  # an evaluation each update
                    **replay)
    P.main(args)
    newest = os.path.join(args.output_dir, "checkpoint-000003")
    checkpoints = sorted(d for d in os.listdir(args.output_dir) if d.startswith("checkpoint"))
    assert checkpoints == ["checkpoint-000002", newest[-17:]]
    weights = os.path.join(newest, damaged)
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    with pytest.raises(SystemExit, match="--resume") as exc:
        P.main(dataclasses.replace(args, resume=newest))
    assert "\n" not in str(exc.value) and (not replay or "replay-rank0.pt: " in str(exc.value))
    if replay:  # lost, not only cut short: skipped too
        os.remove(weights)
    os.remove(os.path.join(args.output_dir, "complete.json"))  # as if stopped before its end: auto resumes it
    P.main(dataclasses.replace(args, resume="auto"))
    assert "skipping damaged checkpoint" in capsys.readouterr().err
    assert [m["update"] for m in read_metrics(args.output_dir)] == [1, 2, 3]
    samples = read_lines(os.path.join(args.output_dir, "samples.jsonl"))  # update 3's, once: cut back, then redone
    assert [x["update"] for x in samples] == sorted(x["update"] for x in samples) and len(samples) == 3 * 3
    with pytest.raises(SystemExit, match="--learning_rate"):  # a checkpoint of another config is refused
        P.main(dataclasses.replace(args, resume=newest, learning_rate=5e-4))


def test_a_checkpoint_that_fails_with_no_message_is_skipped_or_refused_in_one_line(
        tiny, tmp_path, monkeypatch, capsys):
    """An exception with an empty message (OSError()) while a checkpoint loads: --resume auto skips
    it, naming the exception; --resume that checkpoint stops in one line."""
    args = run_args(tiny, tmp_path, total_episodes=24, save_every=1)
    P.main(args)
    os.remove(os.path.join(args.output_dir, "complete.json"))  # as if stopped before its end
    newest, check = os.path.join(args.output_dir, "checkpoint-000003"), P.check_checkpoint

    def check_checkpoint(path, *a):
        if path == newest:
            raise OSError()
        return check(path, *a)
    monkeypatch.setattr(P, "check_checkpoint", check_checkpoint)
    refused = r"^error: --resume '.*checkpoint-000003': OSError:  \("
    with pytest.raises(SystemExit, match=refused) as exc:
        P.main(dataclasses.replace(args, resume=newest))
    assert "\n" not in str(exc.value)
    P.main(dataclasses.replace(args, resume="auto"))
    skipped = r"skipping damaged checkpoint .*checkpoint-000003: OSError\(\)"
    assert re.search(skipped, capsys.readouterr().err)
    assert [m["update"] for m in read_metrics(args.output_dir)] == [1, 2, 3]


def test_every_run_only_field_is_a_field_and_run_only_flags_may_change_on_resume(tiny, tmp_path):
    assert P.RUN_ONLY_FIELDS < {f.name for f in dataclasses.fields(P.Args)}
    args = run_args(tiny, tmp_path, total_episodes=24, save_every=1)
    P.main(args)
    first = os.path.join(args.output_dir, "checkpoint-000002")
    state = torch.load(os.path.join(first, "state.pt"), weights_only=True)
    with pytest.raises(SystemExit, match="--whiten_rewards"):  # it ran without whitening: whitening now is refused
        P.main(dataclasses.replace(args, resume=first, whiten_rewards=True))
    state["world_size"] = 2  # written by 2 processes: the prompt stream of 1 would differ
    torch.save(state, os.path.join(first, "state.pt"))
    with pytest.raises(SystemExit, match="2 processes"):
        P.main(dataclasses.replace(args, resume=first))
    state["world_size"] = 1
    torch.save(state, os.path.join(first, "state.pt"))
    P.main(dataclasses.replace(args, resume=first, num_sample_generations=3, save_total_limit=5, exp_name="other"))
    assert [m["update"] for m in read_metrics(args.output_dir)] == [1, 2, 3]


def test_the_checkpoint_to_resume_is_checked_before_any_model_loads(tiny, tmp_path):
    """A checkpoint of other flags is refused in one line naming stored -> given values before any
    weights load: here the policy's weights are gone, so loading them would fail first with another
    error. With --resume auto the checkpoint it finds is checked so too."""
    policy = str(tmp_path / "policy")
    shutil.copytree(tiny["gpt2"], policy)
    args = run_args(tiny, tmp_path, model_name_or_path=policy, total_episodes=8, save_every=1)
    P.main(args)
    for weights in glob.glob(os.path.join(policy, "*.safetensors")):
        os.remove(weights)
    os.remove(os.path.join(args.output_dir, "complete.json"))  # as if stopped: auto would resume it
    checkpoint = os.path.join(args.output_dir, "checkpoint-000001")
    for resume in (checkpoint, "auto"):
        with pytest.raises(SystemExit) as exc:
            P.main(dataclasses.replace(args, resume=resume, learning_rate=2e-3, kl_coef=0.1))
        assert str(exc.value) == (
            f"error: --resume {checkpoint!r} was written with other values of --kl_coef "
            "(0.05 → 0.1), --learning_rate (0.001 → 0.002); resume with the stored values, or "
            "export it (--export_checkpoint --resume FOLDER) and start a new run from the exported "
            "policy")


def test_an_export_says_what_it_exports_not_the_training_sizes(tiny, tmp_path, capsys):
    args = run_args(tiny, tmp_path, total_episodes=8, save_every=1)
    P.main(args)
    checkpoint = os.path.join(args.output_dir, "checkpoint-000001")
    exported = str(tmp_path / "exported")
    capsys.readouterr()
    P.main(dataclasses.replace(args, resume=checkpoint, export_checkpoint=True,
                               output_dir=exported))
    out = capsys.readouterr().out
    assert "updates of" not in out and out.splitlines()[0] == (
        f"ppo_rlhf: exporting {checkpoint}: policy and value model, --save_dtype fp32, to "
        f"{exported}")
    assert out.splitlines()[-1] == f"saved policy and value model (fp32) to {exported}"


def test_the_non_finite_streak_survives_a_resume(tiny, tmp_path, capsys):
    args = run_args(tiny, tmp_path, reward_model_path=None, reward_fn=[f"{__file__}:huge_score"], total_episodes=64,
                    save_every=1)
    with pytest.raises(SystemExit, match="3 updates in a row"):
        P.main(args)
    assert [m["update"] for m in read_metrics(args.output_dir)] == [1, 2]
    with pytest.raises(SystemExit, match="3 updates in a row"):  # 2 bad updates before the checkpoint, 1 after
        P.main(dataclasses.replace(args, resume=os.path.join(args.output_dir, "checkpoint-000002")))
    assert capsys.readouterr().err.count("warning: update") == 3 + 1
    assert [m["update"] for m in read_metrics(args.output_dir)] == [1, 2]


# ---------------------------------------------------------------------------------------------- torchrun: DDP and FSDP2
# Two gloo processes on CPU. Collectives time out after 60 s, so a hang fails the test instead of stalling CI.
needs_gloo = pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                                reason="torch.distributed with gloo is not available")


def torchrun(*args, timeout=300):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", SCRIPT,
           "--dist_timeout_s", "60", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@needs_gloo
@pytest.mark.parametrize("mode,replay", [("ddp", ()), ("fsdp", ()), ("fsdp", REPLAY)],
                         ids=["ddp", "fsdp", "fsdp_replay"])
def test_torchrun_runs_complete_and_only_rank_0_writes(tiny, tmp_path, mode, replay):
    """Also with replay: each rank replays its own rows, the checkpoint holds each rank's buffer in
    a file of its own, and a checkpoint that lost rank 1's file is skipped by both ranks."""
    out = str(tmp_path / mode)
    flags = ["--model_name_or_path", tiny["gpt2"], "--reward_model_path", tiny["gpt2_rm"], tiny["other_rm"],
             "--dataset", tiny["prompts"], "--output_dir", out, "--total_episodes", "32",
             "--per_device_train_batch_size", "8", "--num_mini_batches", "2", "--num_ppo_epochs", "2",
             "--response_length", "6", "--num_sample_generations", "0", "--save_every", "1", "--distributed", mode,
             *replay]
    flags += ["--shard_frozen_models"] if mode == "fsdp" else []
    result = torchrun(*flags)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(out)
    assert [m["episode"] for m in metrics] == [16, 32]  # 2 ranks x 8 prompts per update, one line per update
    assert all(m["objective/rm_spread"] > 0 for m in metrics)  # two reward models, one with its own tokenizer
    assert result.stdout.count("update 1/2 ") == 1 and "2 processes" in result.stdout  # rank 0 alone prints
    replayed = [{k: v for k, v in m.items() if v is not None or not k.startswith("replay/")} for m in metrics]
    check_run(out, tiny["gpt2"], replayed, value_init=tiny["gpt2_rm"])  # null: nothing replayed at update 1
    assert sorted(os.listdir(out)) == ["checkpoint-000001", "checkpoint-000002", "complete.json", "metrics.jsonl",
                                       "policy", "value_model"]
    newest, first = os.path.join(out, "checkpoint-000002"), os.path.join(out, "checkpoint-000001")
    state = torch.load(os.path.join(newest, "state.pt"), weights_only=True)
    if replay:  # rank r's buffer: its rows of updates 1 and 2, by update
        files = [os.path.join(newest, f"replay-rank{r}.pt") for r in (0, 1)]
        buffers = [torch.load(file, weights_only=True) for file in files]
        assert [[b["update"] for b in rank] for rank in buffers] == [[0, 1], [0, 1]]
        assert "replay" not in state
        assert not torch.equal(*[rank[0]["query_responses"][:, -6:] for rank in buffers])
        assert metrics[1]["replay/share"] > 0.4 and metrics[1]["replay/weight_max"] > 1
        os.remove(files[1])  # rank 0 could load the newest checkpoint, rank 1 cannot
        os.remove(os.path.join(out, "complete.json"))  # as if stopped: --resume auto tries it first
    last = checkpoint_state(newest)["model"]
    for name, weights in final_weights(out).items():  # the saved models are the whole trained ones, not a shard
        assert all(torch.equal(value, last[f"{name}.{key}"]) for key, value in weights.items()) and len(weights) > 20
    # resuming from the first checkpoint redoes update 2 exactly: weights and optimizer state came back whole
    resumed = torchrun(*flags, "--resume", "auto" if replay else first)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {first} " in resumed.stdout
    assert [DETERMINISTIC_KEYS(m) for m in read_metrics(out)] == [DETERMINISTIC_KEYS(m) for m in metrics]
    if replay:
        assert f"skipping damaged checkpoint {newest}: replay-rank1.pt: " in resumed.stderr
        return
    # one process exports the 2-rank checkpoint: its trained weights as from_pretrained folders, no update
    exported = str(tmp_path / "exported")
    result = subprocess.run([sys.executable, SCRIPT, *flags, "--output_dir", exported, "--resume", first,
                             "--export_checkpoint"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    weights, saved = checkpoint_state(first)["model"], final_weights(exported)
    assert all(torch.equal(v, weights[f"{name}.{k}"]) for name in saved for k, v in saved[name].items())
    key = "transformer.h.0.attn.c_attn.weight"  # update 1's, not update 2's
    assert sorted(saved) == ["policy", "value_model"] and not torch.equal(saved["policy"][key], last[f"policy.{key}"])
    policy = AutoModelForCausalLM.from_pretrained(os.path.join(exported, "policy"))
    assert torch.equal(policy.get_parameter(key), weights[f"policy.{key}"])
    with open(os.path.join(exported, "complete.json")) as f:
        assert json.load(f)["updates"] == 1 and not os.path.exists(os.path.join(exported, "checkpoint-000002"))


@needs_gloo
def test_fsdp_saves_keep_the_generation_config_and_2_ranks_export_a_1_process_replay_checkpoint(
        tiny, tmp_path):
    """Under FSDP2 the policy loads into its shards, not by from_pretrained: its final save and a
    2-rank --export_checkpoint still write the model's generation_config.json (stop ids, sampling).
    The export is of a 1-process replay checkpoint: it reads no replay buffer, so 2 ranks can."""
    model = str(tmp_path / "chat")
    shutil.copytree(tiny["chat"], model)
    sampling = dict(do_sample=True, temperature=0.7, top_p=0.9, top_k=7)  # none of them a default
    with open(os.path.join(model, "generation_config.json")) as f:
        generation_config = json.load(f)
    with open(os.path.join(model, "generation_config.json"), "w") as f:
        json.dump({**generation_config, **sampling}, f)
    args = run_args(tiny, tmp_path, model_name_or_path=model, reward_model_path=None,
                    reward_fn=[f"{__file__}:chat_words"], dataset=tiny["chat_prompts"],
                    save_every=1, replay_rounds=1, replay_correction="naive")  # 2 updates
    P.main(args)
    flags = ["--model_name_or_path", model, "--reward_fn", f"{__file__}:chat_words",
             "--dataset", tiny["chat_prompts"], "--total_episodes", "16",
             "--per_device_train_batch_size", "8", "--num_mini_batches", "2",
             "--num_ppo_epochs", "2", "--response_length", "6", "--learning_rate", "1e-3",
             "--num_sample_generations", "0", "--replay_rounds", "1",
             "--replay_correction", "naive", "--distributed", "fsdp"]
    trained, exported = str(tmp_path / "fsdp"), str(tmp_path / "exported")
    result = torchrun(*flags, "--output_dir", trained)  # 1 update of 2 ranks
    assert result.returncode == 0, result.stderr[-3000:]
    first = os.path.join(args.output_dir, "checkpoint-000001")
    result = torchrun(*flags, "--output_dir", exported, "--resume", first, "--export_checkpoint")
    assert result.returncode == 0, result.stderr[-3000:]
    weights, policy = checkpoint_state(first)["model"], final_weights(exported)["policy"]
    assert len(policy) > 10
    assert all(torch.equal(v, weights[f"policy.{k}"]) for k, v in policy.items())
    for folder in (trained, exported):
        with open(os.path.join(folder, "policy", "generation_config.json")) as f:
            written = json.load(f)
        eos = written.get("eos_token_id")
        assert set(eos if isinstance(eos, list) else [eos]) == {0, 3}, (folder, written)
        assert {k: written.get(k) for k in sampling} == sampling, (folder, written)


@needs_gloo
def test_a_killed_two_rank_run_with_replay_resumes_bit_identically(tiny, tmp_path):
    """SIGKILL to torchrun and both ranks mid-run with --replay_rounds 2: --resume auto reloads each rank's buffer and
    the run ends as one never stopped (metrics and saved weights)."""
    flags = ["--model_name_or_path", tiny["gpt2"], "--reward_fn", f"{__file__}:count_w1", "--dataset", tiny["prompts"],
             "--total_episodes", "128", "--per_device_train_batch_size", "8", "--num_ppo_epochs", "2",
             "--response_length", "6", "--num_sample_generations", "0", "--save_every", "1", *REPLAY]
    straight, killed = str(tmp_path / "straight"), str(tmp_path / "killed")
    assert torchrun(*flags, "--output_dir", straight).returncode == 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", SCRIPT,
           "--dist_timeout_s", "60", *flags, "--output_dir", killed]
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 300
    while not os.path.exists(os.path.join(killed, "checkpoint-000003")) and time.time() < deadline:
        time.sleep(0.01)
    for pid in [p for p in os.listdir("/proc") if p.isdigit()]:  # the launcher and both ranks (own sessions)
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if killed.encode() in f.read():
                    os.kill(int(pid), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass  # gone meanwhile
    process.wait(timeout=60)
    time.sleep(1)  # SIGKILL lands asynchronously
    newest = max(c for c in os.listdir(killed) if re.fullmatch(r"checkpoint-\d+", c))
    assert 3 <= len(read_metrics(killed)) < 8 and not os.path.exists(os.path.join(killed, "policy"))
    resumed = torchrun(*flags, "--output_dir", killed, "--resume", "auto")
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr[-3000:]
    assert f"resumed from {os.path.join(killed, newest)} " in resumed.stdout  # nothing ran on after the kill
    a, b = read_metrics(straight), read_metrics(killed)
    assert [DETERMINISTIC_KEYS(m) for m in a] == [DETERMINISTIC_KEYS(m) for m in b] and len(a) == 8
    assert a[-1]["replay/share"] > 0.5  # two batches replayed beside each fresh one
    wa, wb = final_weights(straight), final_weights(killed)
    assert all(torch.equal(wa[name][k], wb[name][k]) for name in wa for k in wa[name])


def trained_name(key):
    """A key of a saved adapter file -> the name of the parameter that trained (peft's file drops the adapter name)."""
    return re.sub(r"\.(lora_[AB])\.", r".\1.default.", key).replace(".score.", ".score.modules_to_save.default.")


@needs_gloo
def test_torchrun_lora_under_fsdp(tiny, tmp_path):
    """LoRA with FSDP2 and sharded frozen models on 2 ranks: the reference is the policy with its adapter off, the
    checkpoint holds only what trains, a resume redoes update 2 exactly, and the saved adapter is the trained one."""
    out = str(tmp_path / "lora")
    flags = ["--model_name_or_path", tiny["llama"], "--reward_model_path", tiny["llama_rm"],
             "--dataset", tiny["prompts"], "--output_dir", out, "--total_episodes", "32",
             "--per_device_train_batch_size", "8",
             "--num_mini_batches", "2", "--num_ppo_epochs", "2", "--response_length", "6", "--learning_rate", "1e-2",
             "--num_sample_generations", "0", "--save_every", "1", "--distributed", "fsdp", "--shard_frozen_models",
             "--lora_r", "4"]
    result = torchrun(*flags)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(out)
    assert all(abs(m["policy/first_ratio"] - 1) < 1e-5 for m in metrics)
    last = checkpoint_state(os.path.join(out, "checkpoint-000002"))["model"]
    assert all(".lora_" in k or ".modules_to_save." in k for k in last)
    assert min(v.abs().max() for k, v in last.items() if ".lora_B." in k) > 0  # B starts at 0: every adapter trained
    for name, weights in final_weights(out).items():  # the whole trained adapters, not a shard
        assert len(weights) > 10 and all(torch.equal(value, last[f"{name}.{trained_name(key)}"])
                                         for key, value in weights.items())
    resumed = torchrun(*flags, "--resume", os.path.join(out, "checkpoint-000001"))
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr[-3000:]
    assert [DETERMINISTIC_KEYS(m) for m in read_metrics(out)] == [DETERMINISTIC_KEYS(m) for m in metrics]


@needs_gloo
def test_torchrun_builtin_task(tmp_path):
    """The built-in task under FSDP on 2 ranks, with its held-out evaluation split 10 + 10 over the ranks: the
    evaluation after the last update equals a one-process greedy evaluation of the saved policy."""
    out = str(tmp_path / "builtin")
    result = torchrun("--distributed", "fsdp", "--output_dir", out, "--total_episodes", "768",
                      "--num_sample_generations", "0", "--no-eval-on-start")
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(out)
    assert [m["episode"] for m in metrics] == [256, 512, 768]  # 2 ranks x 128 prompts per update
    assert "eval/score" in metrics[-1] and all("eval/score" not in m for m in metrics[:-1])  # after the last update
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(out, "policy"))
    eval_file = P.build_addition_task(str(tmp_path / "task"), 1)[2]
    models = SimpleNamespace(policy=AutoModelForCausalLM.from_pretrained(os.path.join(out, "policy")), ref_policy=None,
                             value_model=None, reward_models=[], builtin_reward=True,
                             reward_fns=[(P.addition_reward, "addition_reward", None)], reward_weights=torch.ones(1),
                             tokenizer=tokenizer, pad_token_id=tokenizer.pad_token_id,
                             stop_token_ids=[tokenizer.eos_token_id], policy_head=None, ref_head=None)
    args = P.Args(response_length=2)
    state = SimpleNamespace(global_step=3, max_steps=3, epoch=9.6)
    alone, samples = P.evaluate(models, P.load_prompts(eval_file, args, tokenizer, None), 2, args, P.Runtime(), state)
    assert len(samples) == 20 and len(read_lines(os.path.join(out, "samples.jsonl"))) == 10  # rank 0's half
    for key in ("eval/score", "eval/success_rate", "eval/response_length"):
        assert metrics[-1][key] == pytest.approx(alone[key], abs=1e-6), key
    args, prompts = P.Args(response_length=2, eval_temperature=1.0), P.load_prompts(eval_file, args, tokenizer, None)
    state = torch.get_rng_state()  # sampling at T = 1 uses a random stream of its own, seeded from (seed, update)
    first, second = (P.evaluate(models, prompts, 2, args, P.Runtime(), state)[1] for _ in range(2))
    assert torch.equal(torch.get_rng_state(), state) and first == second
    assert first != P.evaluate(models, prompts, 3, args, P.Runtime(), state)[1]


@needs_gloo
def test_under_fsdp_the_training_log_probs_at_a_151936_vocabulary_come_from_the_chunked_output_layer(big_vocab,
                                                                                                     tmp_path):
    """2 ranks, --distributed fsdp, 8 rows of 120 tokens per rank: the update's peak memory (the high-water mark of
    RSS, reset before it, malloc returning large blocks) grows by less than two (B, R, V) float32 tensors of logits:
    1.6, as in one process, where the full-logit forward and its backward under FSDP2 made 2.6."""
    policy, prompts = big_vocab
    B, R, V = 8, 120, 151_936
    code = f"""
import json, os, sys
import ppo_rlhf as P
peaks, real = [], P.ppo_epochs
def rss(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key)) * 1024
def ppo_epochs(*a):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = rss("VmRSS")
    result = real(*a)
    peaks.append(rss("VmHWM") - before)
    return result
P.ppo_epochs = ppo_epochs
P.main(P.Args(model_name_or_path={policy!r}, reward_fn=[{__file__ + ":num_words"!r}], dataset={prompts!r},
              eval_dataset=None, output_dir={str(tmp_path / "run")!r}, per_device_train_batch_size={B},
              total_episodes=16, response_length={R}, stop_token=None, num_sample_generations=0, distributed="fsdp",
              dist_timeout_s=60, kl_coef=0.0, advantage_estimator="rloo", num_generations=2))
print("peaks", json.dumps(peaks))
P.leave_process_group()
"""
    with open(tmp_path / "run_fsdp.py", "w") as f:
        f.write(code)
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             str(tmp_path / "run_fsdp.py")], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": HERE, "OMP_NUM_THREADS": "1",
                                 "MALLOC_MMAP_THRESHOLD_": "131072"})
    assert result.returncode == 0, result.stderr[-3000:]
    peaks = [json.loads(line.split(" ", 1)[1]) for line in result.stdout.splitlines() if line.startswith("peaks ")]
    assert len(peaks) == 2 and all(len(p) == 1 for p in peaks)  # both ranks, one update
    assert all(0 < p[0] < 2 * B * R * V * 4 for p in peaks), (peaks, B * R * V * 4)


@needs_gloo
def test_fsdp_in_bf16_gathers_bf16_and_its_first_kl_is_zero(tiny, tmp_path):
    """2 ranks, --dtype bf16 --shard_frozen_models, a Llama (RoPE), its reward model and one with
    its own tokenizer: FSDP2 gathers the policy and the reference in bf16 (MixedPrecisionPolicy), so
    at update 1, where π_θ = π_ref, every response's KL Σ_t (log π_old − log π_ref) is 0 within 1e-6
    and the first ratio is 1; after an update it is not 0. log π_old is score()'s recompute (a full
    forward, as π_ref's), not the sampler's μ (KV-cache decoding), whose gap to it depends on the
    CPU's bf16 kernels."""
    def run(name):
        code = f"""
import json
import ppo_rlhf as P
kls, real = [], P.score
def score(models, batch, *a):
    out = real(models, batch, *a)
    kl = ((out["logprobs"] - out["ref_logprobs"]) * batch["response_mask"]).sum(1)
    kls.append(kl.abs().max().item())
    return out
P.score = score
P.main(P.Args(model_name_or_path={tiny["llama"]!r}, reward_model_path=[{tiny["llama_rm"]!r}, {tiny["other_rm"]!r}],
              dataset={tiny["prompts"]!r}, output_dir={str(tmp_path / name)!r}, per_device_train_batch_size=4,
              total_episodes=16, response_length=6, num_sample_generations=0, distributed="fsdp", dist_timeout_s=60,
              dtype="bf16", shard_frozen_models=True, learning_rate=1e-3))
print("kls", json.dumps(kls))
P.leave_process_group()
"""
        with open(tmp_path / f"{name}.py", "w") as f:
            f.write(code)
        result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                 "2", str(tmp_path / f"{name}.py")], capture_output=True, text=True, timeout=300,
                                env={**os.environ, "PYTHONPATH": HERE, "OMP_NUM_THREADS": "1"})
        assert result.returncode == 0, result.stderr[-3000:]
        lines = [line.split(" ", 1)[1] for line in result.stdout.splitlines() if line.startswith("kls ")]
        return [json.loads(line) for line in lines], read_metrics(str(tmp_path / name))
    kls, metrics = run("run")
    assert len(kls) == 2 and all(len(k) == 2 and k[0] < 1e-6 and k[1] > 1e-4 for k in kls), kls
    assert metrics[0]["policy/first_ratio"] == pytest.approx(1, abs=1e-6) and abs(metrics[1]["objective/kl"]) > 1e-5


@needs_gloo
def test_bad_input_under_torchrun_is_one_line_from_the_whole_run(tiny, tmp_path):
    for flags, expected in ((["--learning_rate", "-1"], "error: --learning_rate -1.0 is out of range"),  # flags
                            (["--model_name_or_path", tiny["gpt2"], "--reward_fn", f"{__file__}:count_w1", "--dataset",
                              str(tmp_path / "none.txt")], "error: --dataset"),  # files: checked by every rank
                            (["--model_name_or_path", tiny["gpt2"], "--reward_fn", f"{__file__}:fails_on_rank_1",
                              "--dataset", tiny["prompts"], "--response_length", "4"],  # one rank's reward: a vote
                             f"error: --reward_fn {__file__}:fails_on_rank_1 failed: RuntimeError: "
                             "rank 1's grader")):
        start = time.time()
        result = torchrun("--output_dir", str(tmp_path / "run"), *flags, timeout=120)
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert result.returncode != 0 and len(errors) == 1 and errors[0].startswith(expected), result.stderr[-2000:]
        assert "terminate called" not in result.stderr and time.time() - start < 50  # no rank waited 60 s
        assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")


def init_gloo(rank, port):
    import datetime
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                         timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_2(worker, *args):
    torch.multiprocessing.spawn(worker, args=(free_port(), *args), nprocs=2, join=True)


def whitened(x, mask):
    """Advantage whitening as main() does it, and explained variance, with global_mean_var's statistics."""
    return (P.masked_whiten(x, mask, *P.global_mean_var(x, mask)),
            P.masked_whiten(x, mask, *P.global_mean_var(x, mask), shift_mean=False),
            P.explained_variance(P.global_mean_var(x - 0.5 * x, mask)[1], P.global_mean_var(x, mask)[1]))


def whiten_worker(rank, port, data_file, out_file):
    init_gloo(rank, port)
    x, mask = torch.load(data_file)
    half = slice(rank * 5, rank * 5 + 5)
    torch.save(whitened(x[half], mask[half]), f"{out_file}.{rank}")
    P.leave_process_group()  # once the models that hold the group are freed


SHARD_LOADS = [("gpt2", False), ("llama", False), ("chat", False), ("llama", True)]  # (model, a new value head)


def shard_load_worker(rank, port, tiny, out_file):
    init_gloo(rank, port)
    rt, results = P.Runtime(rank=rank, world_size=2, torchrun=True, fsdp=True), []
    for key, value in SHARD_LOADS:
        cls = AutoModelForSequenceClassification if value else AutoModelForCausalLM
        models = []
        for into_shards in (True, False):  # (False: loaded whole, then sharded)
            torch.manual_seed(0)  # the new head's numbers
            models.append(P.load_pretrained(cls, tiny[key], "model_name_or_path", P.Args(), new_head=value,
                                            rt=rt if into_shards else None, num_labels=1))
        model = models[0]
        P.shard(models[1])
        assert all(hasattr(p, "full_tensor") for p in model.parameters())  # into shards: no plain path
        assert value or (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == (
            key != "llama")  # tied heads stay tied
        with torch.no_grad():
            logits = [P.forward(m, torch.tensor([[3, 5, 7, 9, 2, 4]]), torch.ones(1, 6, dtype=torch.bool), 6)
                      for m in models]
        results.append(({k: v.full_tensor() for k, v in model.state_dict().items()}, *logits))
    torch.save(results, f"{out_file}.{rank}")
    P.leave_process_group()


@needs_gloo
def test_loading_into_fsdp_shards_gives_the_weights_and_logits_of_a_whole_load_bit_for_bit(tiny, tmp_path):
    """2 ranks build each model on the meta device, shard it and read their slices of its bf16 safetensors files:
    GPT-2 and a chat Llama with tied heads, a Llama (RoPE: its inv_freq is in no checkpoint) with an untied one, and
    a value model from that Llama with a new score head (the same seed, the same numbers as from_pretrained). Its
    weights are a single-process load's, its logits those of the same load sharded after it; FSDP2's own compute
    is within float32 rounding of one process."""
    spawn_2(shard_load_worker, tiny, str(tmp_path / "out"))
    for (key, value), *ranks in zip(SHARD_LOADS, *[torch.load(tmp_path / f"out.{r}") for r in range(2)]):
        torch.manual_seed(0)
        cls = AutoModelForSequenceClassification if value else AutoModelForCausalLM
        model = P.load_pretrained(cls, tiny[key], "model_name_or_path", P.Args(), new_head=value, num_labels=1)
        with torch.no_grad():
            whole = P.forward(model, torch.tensor([[3, 5, 7, 9, 2, 4]]), torch.ones(1, 6, dtype=torch.bool), 6)
        for weights, logits, sharded_after in ranks:
            assert weights.keys() == model.state_dict().keys(), (key, value)
            assert all(torch.equal(v, model.state_dict()[k]) for k, v in weights.items()), (key, value)
            assert torch.equal(logits, sharded_after) and torch.allclose(logits, whole, rtol=0, atol=1e-6)


@needs_gloo
def test_whitening_over_two_ranks_equals_whitening_over_the_concatenated_batch(tmp_path):
    x, mask = torch.randn(10, 7, dtype=torch.float64) * 3 + 1, random_mask((10, 7), seed=5)
    mask[:5, 4:] = False  # rank 0 holds far fewer real entries than rank 1: a mean of the ranks' means would be wrong
    torch.save((x, mask), tmp_path / "data.pt")
    spawn_2(whiten_worker, str(tmp_path / "data.pt"), str(tmp_path / "out"))
    ranks = [torch.load(tmp_path / f"out.{r}") for r in range(2)]
    whole = whitened(x, mask)
    for r in range(2):
        half = slice(r * 5, r * 5 + 5)
        assert torch.allclose(ranks[r][0], whole[0][half], atol=1e-12)
        assert torch.allclose(ranks[r][1], whole[1][half], atol=1e-12)
        assert torch.allclose(ranks[r][2], whole[2], atol=1e-12)
    local = whitened(x[:5], mask[:5])[0]  # the test has teeth: whitening with one rank's statistics differs
    assert (local[mask[:5]] - whole[0][:5][mask[:5]]).abs().max() > 1e-3


def agreed_worker(rank, port, out_file):
    init_gloo(rank, port)
    os.environ["RANK"] = str(rank)
    try:
        P.agreed(lambda: {}["typo"] if rank == 1 else 1)  # a bug on rank 1 only
        got = "returned"
    except SystemExit as e:
        got = f"SystemExit {e.code}"
    except KeyError as e:
        got = f"KeyError {e} from {traceback.extract_tb(e.__traceback__)[-1].name}"
    with open(f"{out_file}.{rank}", "w") as f:
        f.write(got)


@needs_gloo
def test_a_bug_on_one_rank_stops_every_rank_and_keeps_its_traceback_there(tmp_path):
    spawn_2(agreed_worker, str(tmp_path / "out"))
    got = [(tmp_path / f"out.{rank}").read_text() for rank in range(2)]
    assert got[1] == "KeyError 'typo' from <lambda>"  # the rank that met it: the exception itself
    assert got[0].startswith("SystemExit error: KeyError: 'typo' (test_ppo_rlhf.py:")  # the others


def entropy_case(rank):
    """trl_case's micro-batch of one rank, with its entropies: rank 1's higher than rank 0's."""
    new, old, advantages, mask, _, ref = trl_case(rank)
    new = (old + 0.1 * (new - old).clamp(-1, 1)).detach().requires_grad_()
    entropy = torch.rand(5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    return new, old, advantages, mask, ref, entropy + rank


def entropy_worker(rank, port, out_file):
    init_gloo(rank, port)
    new, old, advantages, mask, ref, entropy = entropy_case(rank)
    args = P.Args(top_entropy_quantile=0.3, kl_in="loss", kl_coef=0.04, kl_estimator="k3")
    P.check_args(args)
    mb = dict(logprobs=old, advantages=advantages, response_mask=mask, ref_logprobs=ref)
    loss, _, _, tokens = P.ppo_loss(new, entropy, None, mb, 0.04, args)  # gathers over both
    torch.save((loss.item(), torch.autograd.grad(loss, new)[0], tokens["entropy_masked"]),
               f"{out_file}.{rank}")
    P.leave_process_group()


@needs_gloo
def test_the_high_entropy_quantile_spans_every_ranks_loss_tokens(tmp_path):
    """2 ranks, --top_entropy_quantile 0.3: each rank's micro-batch keeps the tokens at or above
    the 0.7-quantile of both ranks' loss-token entropies (TRL gathers them), value and gradient as
    naive_entropy_masked_clip's; one rank's own quantile would keep other tokens."""
    spawn_2(entropy_worker, str(tmp_path / "out"))
    cases = [entropy_case(rank) for rank in range(2)]
    both = torch.cat([entropy[mask] for _, _, _, mask, _, entropy in cases])
    for rank, (new, old, advantages, mask, ref, entropy) in enumerate(cases):
        loss, grad, masked = torch.load(tmp_path / f"out.{rank}")
        theirs = naive_entropy_masked_clip(new, old, advantages, mask, entropy, both, 0.3, 0.04,
                                           ref)
        assert abs(loss - theirs.item()) < 1e-10
        assert torch.allclose(grad, torch.autograd.grad(theirs, new)[0], rtol=0, atol=1e-10)
        alone = P.high_entropy_tokens(entropy, mask, entropy[mask], 0.3)
        assert not torch.equal(mask & ~alone, masked)  # the test has teeth
    assert cases[0][-1].max() < cases[1][-1].min()  # rank 1's entropies all higher


def spy_on_updates(monkeypatch):
    """Record what main() hands to ppo_epochs: the batch of phases 1-4, and π_θ's log-probs and V on it before the
    update (teacher-forced, by the model being trained). -> the list it fills."""
    calls, real = [], P.ppo_epochs

    def spy(model, optimizer, scaler, batch, args, sizes, rt):
        with torch.no_grad(), rt.autocast():  # with LoRA under bf16/fp16 the frozen base is in that dtype
            logprobs, _, values = model(batch["query_responses"], batch["attention_mask"], batch["context_length"],
                                        args.temperature)
        calls.append(({k: v.clone() if torch.is_tensor(v) else v for k, v in batch.items()}, logprobs, values, model))
        return real(model, optimizer, scaler, batch, args, sizes, rt)

    monkeypatch.setattr(P, "ppo_epochs", spy)
    return calls


def fixed_rollout(tiny, tmp_path, batch_size):
    """The batch of one update of main() on the tiny GPT-2 (phases 1-4: rollout, score, rewards, advantages), with
    response lengths cut short by a frequent stop token."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        calls = spy_on_updates(monkeypatch)
        P.main(run_args(tiny, tmp_path, total_episodes=batch_size, per_device_train_batch_size=batch_size,
                        stop_token_id=5, seed=3))
    return {k: v for k, v in calls[0][0].items() if k in ("query_responses", "attention_mask", "context_length",
            "response_mask", "lengths", "logprobs", "ref_logprobs", "values", "advantages", "returns", "kl_coef",
            "loss_mask", "truncated")}


def one_update(tiny, batch, mode, gradient_accumulation_steps, steps=None, **flags):
    """One PPO update (2 epochs unless flags say otherwise, 1 minibatch: an optimizer step per
    epoch) on `batch`; -> the full weights afterwards, and what ppo_epochs returned (which took
    `steps`, default one per epoch)."""
    policy, value_model = loaded(tiny, "gpt2"), loaded_value(tiny)
    if mode == "fsdp":
        P.shard(policy), P.shard(value_model)
    model = P.PolicyAndValue(policy, value_model, fused_head=True)  # as main() does (under FSDP2 too)
    if mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, fused=True)
    rows = len(batch["lengths"]) // gradient_accumulation_steps  # per micro-batch
    args = P.Args(**{**dict(num_ppo_epochs=2, num_mini_batches=1, per_device_train_batch_size=rows,
                            gradient_accumulation_steps=gradient_accumulation_steps, response_length=6), **flags})
    world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    rt = P.Runtime(world_size=world_size, torchrun=world_size > 1, fsdp=mode == "fsdp")
    torch.manual_seed(0)
    trained = P.ppo_epochs(model, optimizer, torch.amp.GradScaler("cpu", enabled=False), batch, args,
                           P.check_args(args), rt)
    assert trained.optimizer_steps == (steps or args.num_ppo_epochs)  # a stop after the last: same
    weights = P.full_state_dict(model)  # rank 0's; {} on the others
    if mode == "fsdp":  # --save_dtype bf16 for the policy: its shards cast first, so the gather moves bf16
        half = P.full_state_dict(model, {"policy": torch.bfloat16})
        assert half.keys() == weights.keys() and all(torch.equal(v, weights[k].to(v.dtype)) and v.dtype == (
            torch.bfloat16 if k.startswith("policy.") else torch.float32) for k, v in half.items())
    return weights, trained


def update_worker(rank, port, tiny, batch_file, mode, flags, out_file):
    init_gloo(rank, port)
    P.logprobs_chunk_rows = lambda vocab_size: 4  # log-probs from the hidden states in chunks (FSDP2 too)
    batch = torch.load(batch_file)
    half = {k: v[rank * 4 : rank * 4 + 4] if torch.is_tensor(v) else v for k, v in batch.items()}
    weights, _ = one_update(tiny, half, mode, 2, **flags)  # 2 micro-batches of 2 per rank
    if rank == 0:
        torch.save(weights, out_file)
    P.leave_process_group()  # once the models that hold the group are freed


@needs_gloo
@pytest.mark.parametrize("mode,flags", [("ddp", {}), ("fsdp", {}), ("ddp", dict(loss_agg="seq_mean_token_mean")),
                                        ("ddp", dict(loss_agg="seq_mean_token_sum_norm", kl_in="loss",
                                                     entropy_coef=0.1))])
def test_two_ranks_with_half_the_batch_make_the_same_update_as_one_rank(tiny, tmp_path, mode, flags):
    """Every --loss_agg weighs micro-batches and ranks so that they make the one-process update."""
    batch = fixed_rollout(tiny, tmp_path, 8)
    assert batch["lengths"][:4].sum() != batch["lengths"][4:].sum()  # unequal token counts: the loss weighting matters
    torch.save(batch, tmp_path / "batch.pt")
    spawn_2(update_worker, tiny, str(tmp_path / "batch.pt"), mode, flags, str(tmp_path / "weights.pt"))
    two_ranks = torch.load(tmp_path / "weights.pt")
    one_rank, _ = one_update(tiny, batch, "none", 1, **flags)  # the full logits, 1 micro-batch of 8
    initial = P.full_state_dict(P.PolicyAndValue(loaded(tiny, "gpt2"), loaded_value(tiny)))
    assert two_ranks.keys() == one_rank.keys()
    assert sum(not torch.equal(one_rank[k], initial[k]) for k in one_rank) > len(one_rank) // 2  # it did train
    for k in one_rank:
        assert torch.allclose(two_ranks[k], one_rank[k], atol=1e-5), k  # AdamW: ~1e-3 a step


def target_kl_worker(rank, port, tiny, batch_file):
    init_gloo(rank, port)
    batch = torch.load(batch_file)
    half = {k: v[rank * 4 : rank * 4 + 4] if torch.is_tensor(v) else v for k, v in batch.items()}
    _, free = one_update(tiny, half, "ddp", 2, num_ppo_epochs=3)  # 3 steps of 2 micro-batches per rank
    approxkl = torch.stack(free.stats["policy/approxkl_avg"])  # per step, over both ranks' tokens
    assert torch.equal(P.all_ranks_sum(approxkl.clone()) / 2, approxkl)  # the same on both ranks
    assert approxkl[1] > 1e-6  # after the first step π_θ moved
    target = 1.5 * approxkl[1].item()
    one_update(tiny, half, "ddp", 2, num_ppo_epochs=3, target_kl=target)  # asserts 3 steps
    P.leave_process_group()


@needs_gloo
def test_target_kl_on_two_ranks_compares_the_mean_of_their_approx_kl(tiny, tmp_path):
    """--target_kl under torchrun: the early stop compares the approx KL over both ranks' tokens
    with the target (one all-reduce; the ranks' sum would stop world_size times too early). 3 epochs
    of one step; a target 1.5x above the approx KL of the second step (before which the first moved
    π_θ) lets the third step run."""
    torch.save(fixed_rollout(tiny, tmp_path, 8), tmp_path / "batch.pt")
    spawn_2(target_kl_worker, tiny, str(tmp_path / "batch.pt"))


def test_target_kl_reads_the_token_mean_not_a_mean_of_micro_batch_means(tiny, tmp_path,
                                                                        monkeypatch):
    """--target_kl with --gradient_accumulation_steps 2 and micro-batches of unequal token counts:
    the early stop and policy/approxkl_avg read Σ approx KL over the minibatch's tokens / their
    count. A target between that and the mean of the two micro-batch means stops the update as the
    token mean says."""
    batch, real = fixed_rollout(tiny, tmp_path, 8), P.ppo_loss
    seen = []  # (Σ approx KL, tokens) of each micro-batch

    def spy(new_logprobs, entropy, new_values, mb, kl_coef, args):
        out = real(new_logprobs, entropy, new_values, mb, kl_coef, args)
        mask = mb["response_mask"]
        seen.append((torch.where(mask, out[3]["approxkl"], 0.0).sum().item(), mask.sum().item()))
        return out
    monkeypatch.setattr(P, "ppo_loss", spy)
    _, free = one_update(tiny, batch, "none", 2, num_ppo_epochs=3)
    (s1, n1), (s2, n2) = seen[2:4]  # the second step's micro-batches, after the first moved π_θ
    token_mean, mean_of_means = (s1 + s2) / (n1 + n2), (s1 / n1 + s2 / n2) / 2
    assert n1 != n2
    assert free.stats["policy/approxkl_avg"][1].item() == pytest.approx(token_mean, rel=1e-5)
    assert abs(token_mean - mean_of_means) > 1e-3 * token_mean > 0  # far apart next to float32
    target = (token_mean + mean_of_means) / 2  # the two statistics on opposite sides
    steps = 2 if token_mean > target else 3
    one_update(tiny, batch, "none", 2, steps=steps, num_ppo_epochs=3, target_kl=target)


def test_the_update_takes_the_beta_of_its_batch(tiny, tmp_path):
    """With --kl_in loss the KL term's β is the batch's (what the adaptive controller set after the last update), not
    --kl_coef: the update with batch β 0.5 and --kl_coef 0.1 is the one with both 0.5, not the one with both 0.1."""
    batch = fixed_rollout(tiny, tmp_path, 8)
    runs = {}
    for batch_beta, flag_beta in ((0.5, 0.1), (0.5, 0.5), (0.1, 0.1)):
        runs[batch_beta, flag_beta], _ = one_update(tiny, {**batch, "kl_coef": batch_beta}, "none", 1, kl_in="loss",
                                                   kl_coef=flag_beta)
    assert all(torch.equal(v, runs[0.5, 0.5][k]) for k, v in runs[0.5, 0.1].items())
    assert not all(torch.equal(v, runs[0.1, 0.1][k]) for k, v in runs[0.5, 0.1].items())


@pytest.mark.parametrize("correction", ["naive", "decoupled", "grpo", "decoupled_bf16"])
def test_one_round_of_replay_trains_on_the_last_batch_and_this_one(tiny, tmp_path, monkeypatch, correction):
    """--replay_rounds 1: each update trains on its fresh rows and the previous update's rows (not
    older ones), row by row as sampled but re-padded, age 1, with μ, log π_ref and what phase 4 made
    of them when they were sampled (advantages, returns, loss mask: phase 4 runs once per update);
    π_prox and V of the models at the update's start (under --dtype bf16 in bf16 autocast, at
    --temperature, as the fresh rows' log π_old), V the value clip's centre. The first update
    (nothing to replay) is today's."""
    seen = []  # per update: the fresh batch, the buffer's batch and the models' π_prox and V of it, the train batch
    replay_batch = P.replay_batch

    def spy(progress, batch, update, models, args, rt):
        old = progress["replay"][-1] if progress["replay"] else None
        if old is not None:  # computed here on the rows as they were padded then
            ids, ids_mask, c = old["query_responses"], old["attention_mask"], old["context_length"]
            with torch.no_grad(), rt.autocast():
                prox = P.response_logprobs(models.policy, ids, ids_mask, c, args.temperature)[0]
                values = P.state_values(models.value_model, ids, ids_mask, c) if models.value_model else 0 * prox
            pad = ~old["response_mask"]
            old = dict(old, prox=prox.masked_fill(pad, 0), values=values.masked_fill(pad, 0))
        seen.append((dict(batch), old, replay_batch(progress, batch, update, models, args, rt)))
        return seen[-1][2]

    monkeypatch.setattr(P, "replay_batch", spy)
    flags = {"decoupled": dict(replay_weight_cap=1.02), "naive": {},
             "grpo": dict(advantage_estimator="grpo", num_generations=2, off_policy_mask_threshold=0.0),
             "decoupled_bf16": dict(replay_weight_cap=1.02, dtype="bf16", temperature=0.7)}[correction]
    B = 4  # rows per batch: few, so that batches differ in width
    flags.update(per_device_train_batch_size=B, num_mini_batches=1)  # a minibatch of B rows: 2 per update
    metrics = P.main(run_args(tiny, tmp_path, total_episodes=3 * B, replay_rounds=1,
                              replay_correction="naive" if correction in ("naive", "grpo") else "decoupled", **flags))
    fresh, _, train = seen[0]  # nothing to replay yet
    for key in ("query_responses", "logprobs", "advantages", "returns", "loss_mask"):
        assert torch.equal(train[key], fresh[key])
    assert (train["age"] == 0).all()
    if correction == "decoupled_bf16":  # fresh rows: π_old (the recompute) over the sampler's μ, as the rollout correction
        mismatch = P.rollout_weights(fresh["logprobs"], fresh["sampler_logprobs"], fresh["response_mask"], "token_mask",
                                     1.02)
        assert torch.equal(train["weights"], mismatch)
    else:  # fp32: μ is π_old
        assert torch.equal(train.get("weights", torch.ones(1)).unique(), torch.ones(1))
    widths = set()
    for u in (1, 2):
        fresh, old, train = seen[u]
        assert old["update"] == u - 1 and torch.equal(old["query_responses"], seen[u - 1][0]["query_responses"])
        assert train["age"].tolist() == [0] * B + [1] * B  # this batch, then the last one only
        P_ = train["context_length"]
        for j, (part, i) in enumerate([(fresh, i) for i in range(B)] + [(old, i) for i in range(B)]):
            c, r = part["context_length"], part["query_responses"].shape[1] - part["context_length"]
            widths.add((c, r))
            real = train["attention_mask"][j]
            assert torch.equal(train["query_responses"][j][real], part["query_responses"][i][part["attention_mask"][i]])
            assert torch.equal(train["query_responses"][j, P_ : P_ + r], part["query_responses"][i, c:])
            for key in ("response_mask", "loss_mask", "ref_logprobs", "advantages", "returns"):
                assert torch.equal(train[key][j, :r], part[key][i]) and not train[key][j, r:].any()
        parts = (fresh, old)
        width = train["logprobs"].shape[1]
        mu = torch.cat([F.pad(b["sampler_logprobs"], (0, width - b["sampler_logprobs"].shape[1]))
                        for b in parts])
        values = torch.cat([F.pad(b["values"], (0, mu.shape[1] - b["values"].shape[1])) for b in parts])
        prox = torch.cat([F.pad(x, (0, width - x.shape[1])) for x in (fresh["logprobs"], old["prox"])])  # fresh: π_old
        assert torch.allclose(train["values"], values, atol=1e-5)  # V of now, for the replayed rows too
        assert torch.equal(train["sampler_logprobs"], mu)  # the off-policy mask's μ: the sampler's, stored
        mask, then = train["response_mask"], seen[u - 1][0]  # then: the old rows' own update

        def widened(key):  # the fresh rows', then the old ones' when sampled, at the train width
            return torch.cat([F.pad(b[key], (0, width - b[key].shape[1])) for b in (fresh, then)])
        for key in ("advantages", "returns", "loss_mask", "sampler_logprobs"):  # phase 4's
            assert torch.equal(train[key], widened(key)), key
        if correction == "grpo":  # no value model
            assert not train["values"].any()
            continue
        assert not torch.allclose(old["values"], then["values"], atol=1e-3)  # V has moved since
        if correction == "naive":  # the ratio's denominator is μ
            assert torch.equal(train["logprobs"], mu) and "weights" not in train
        else:  # π_prox, each token weighted min(π_prox/μ, c)
            assert torch.allclose(train["logprobs"], prox, atol=1e-5) and torch.equal(train["logprobs"][:B], prox[:B])
            w = (train["logprobs"] - mu).exp()
            assert torch.allclose(train["weights"], torch.where(w <= 1.02, w, 0.0))  # AReaL: 0 above the cap
            assert (train["weights"][B:][mask[B:]] == 0).any() and (train["weights"][B:][mask[B:]] < 1).any()
    assert metrics["update"] == 3 and metrics["policy/epochs"] == 2  # 2B rows: 2 minibatches per epoch
    assert abs(metrics["policy/first_ratio"] - 1) < 1e-5  # of fresh tokens (a replayed one's starts at π_prox/μ)
    assert len(widths) > 1  # some rows were padded to another width than their own
    replayed = mask & (train["age"] == 1)[:, None]
    assert metrics["replay/share"] == pytest.approx((replayed.sum() / mask.sum()).item())
    k3 = P.kl_estimate(mu, prox, "k3")[replayed].mean()  # KL(μ‖π_prox) of the one-update-old rows
    assert metrics["replay/kl_age1"] == pytest.approx(k3.item(), rel=1e-4) and metrics["replay/mean_age"] > 0.3
    if correction.startswith("decoupled"):  # the share of replayed tokens whose π_prox/μ the cap masked
        above = ((train["logprobs"] - mu).exp() > 1.02) & replayed
        assert 0 < metrics["replay/weight_masked"] == pytest.approx((above.sum() / replayed.sum()).item())
    monkeypatch.undo()
    cap = flags.pop("replay_weight_cap", None)
    if correction == "decoupled_bf16":  # the fresh rows' weight: one mechanism with the rollout correction
        flags.update(rollout_correction="token_mask", rollout_correction_cap=cap)
    P.main(run_args(tiny, tmp_path / "today", total_episodes=B, **flags))  # --replay_rounds 0
    first, today = read_metrics(tmp_path / "run")[0], read_metrics(tmp_path / "today" / "run")[0]
    first = {k: v for k, v in DETERMINISTIC_KEYS(first).items() if not k.startswith("replay/")}
    assert first == DETERMINISTIC_KEYS(today)


def process_reward_fork(tmp_path):
    """A throwaway fork, as the README's How to fork invites: a per-token process reward (0.01 x the
    token's id), an argument of advantages_and_returns that main passes, added to p_t. -> it."""
    edits = {"def advantages_and_returns(scores, kl, kl_coef, values, mask, loss_mask, args):":
             "def advantages_and_returns(scores, kl, kl_coef, values, mask, loss_mask, args,\n"
             "                           process=None):",
             "    baselined = baselined_scores(scores, mask.sum(-1)":
             "    if process is not None:\n"
             "        penalties = penalties + torch.where(mask, process, 0.0)\n"
             "    baselined = baselined_scores(scores, mask.sum(-1)",
             '            scores, kl, kl_coef, batch["values"], mask, loss_mask, args))':
             '            scores, kl, kl_coef, batch["values"], mask, loss_mask, args,\n'
             '            process=0.01 * batch["query_responses"][:, batch["context_length"]:]))'}
    return forked(tmp_path, edits)


@pytest.mark.parametrize("correction", ["naive", "decoupled"])
def test_a_term_a_fork_adds_in_phase_4_reaches_every_row_replay_trains_on(tiny, tmp_path,
                                                                          monkeypatch, correction):
    """Phase 4 runs once per update and replay trains on what it made: a fork's process reward
    (process_reward_fork) is in the advantages ppo_epochs trains on, the fresh rows' equal to
    main's (max |ΔA| = 0), each replayed row's to those it got when it was sampled (--replay_rounds
    2); objective/rlhf_reward sums it: the score plus every non-score term phase 4 applied."""
    fork = process_reward_fork(tmp_path)
    sampled, trained = [], []  # main's batch per update; what ppo_epochs got
    replay_batch, ppo_epochs = fork.replay_batch, fork.ppo_epochs
    monkeypatch.setattr(fork, "replay_batch", lambda progress, batch, *a: (
        sampled.append(dict(batch)), replay_batch(progress, batch, *a))[1])
    monkeypatch.setattr(fork, "ppo_epochs", lambda model, o, s, batch, *a: (
        trained.append(batch), ppo_epochs(model, o, s, batch, *a))[1])
    args = run_args(tiny, tmp_path, total_episodes=24, replay_rounds=2,
                    replay_correction=correction, stop_token_id=5)
    fork.main(args)
    metrics = read_metrics(args.output_dir)
    for update, (train, m) in enumerate(zip(trained, metrics)):
        width = train["advantages"].shape[1]
        for age in range(update + 1):
            then = sampled[update - age]  # the update that sampled these rows
            rows = train["age"] == age
            for key in ("advantages", "returns", "loss_mask"):
                x = F.pad(then[key], (0, width - then[key].shape[1]))
                assert (train[key][rows] == x).all(), (update, age, key)
        batch, mask = sampled[update], sampled[update]["response_mask"]
        process = 0.01 * batch["query_responses"][:, batch["context_length"]:].where(mask, 0)
        penalty = batch["kl_coef"] * batch["kl"]
        assert torch.allclose(batch["penalties"], (process - penalty).where(mask, 0), atol=1e-6)
        applied = batch["scores"] - penalty.sum(1) + process.sum(1)
        assert process.sum(1).mean() > 0.05 and m["objective/rlhf_reward"] == pytest.approx(
            applied.mean().item(), rel=1e-6)
    assert [(t["age"] > 0).sum().item() for t in trained] == [0, 8, 16]


def test_the_rollout_correction_weights_the_loss_without_replay(tiny, tmp_path, monkeypatch):
    """--rollout_correction is phase 2's, where μ and π_old meet: with --replay_rounds 0
    replay_batch is not called (here it would fail the test), and the PPO epochs get w =
    rollout_weights(π_old, μ) as the batch's weights (a cap of 0.5: every weight 0.5)."""
    monkeypatch.setattr(P, "replay_batch", lambda *a: pytest.fail("replay_batch ran"))
    calls = spy_on_updates(monkeypatch)
    P.main(run_args(tiny, tmp_path, dtype="bf16", rollout_correction="token_truncate",
                    rollout_correction_cap=0.5, total_episodes=8))
    batch = calls[0][0]
    mask = batch["response_mask"]
    mu = batch["sampler_logprobs"]
    expected = P.rollout_weights(batch["logprobs"], mu, mask, "token_truncate", 0.5)
    assert torch.equal(batch["weights"], expected) and (batch["weights"][mask] == 0.5).all()


def stored_batch(gen, update, rows=4, width=5, scale=1.0):
    """A batch as replay keeps it (3 prompt tokens, ragged responses; the first row full), V and π_prox of now."""
    lengths = torch.randint(1, width + 1, (rows,), generator=gen)
    lengths[0] = width
    mask = torch.arange(width) < lengths[:, None]
    real = lambda x: x.masked_fill(~mask, 0.0)  # noqa: E731
    logprobs = real(-torch.rand(rows, width, generator=gen))
    return dict(query_responses=torch.randint(3, 40, (rows, 3 + width), generator=gen), response_mask=mask,
                attention_mask=torch.cat([torch.ones(rows, 3, dtype=torch.bool), mask], 1), loss_mask=mask,
                lengths=lengths, sampler_logprobs=logprobs, ref_logprobs=real(logprobs - 0.1),
                update=update, context_length=3,
                advantages=real(torch.randn(rows, width, generator=gen)),
                returns=real(torch.randn(rows, width, generator=gen)), kl_coef=0.05 * (1 + update),
                values=real(torch.randn(rows, width, generator=gen)),
                prox=real(logprobs + scale * 0.3 * torch.randn(rows, width, generator=gen)))


def replay_worker(rank, port, out_file):
    init_gloo(rank, port)
    gen = torch.Generator().manual_seed(rank)
    scale = 1.0 + 2 * rank  # rank 1's π_prox/μ spread wider: one rank's are not the batch's
    old, fresh = stored_batch(gen, 0, scale=scale), stored_batch(gen, 1, scale=scale)
    P.recomputed = lambda models, b, args, rt: (b["prox"], b["values"])  # forwards stubbed
    args = P.Args(replay_rounds=1, replay_correction="naive", response_length=5)
    models = SimpleNamespace(pad_token_id=0)
    batch = dict(fresh, logprobs=fresh["sampler_logprobs"])  # fp32: μ is π_old
    train = P.replay_batch({"replay": [old]}, batch, 1, models, args, P.Runtime(rank=rank, world_size=2, torchrun=True))
    torch.save((train, batch["replay_metrics"]), f"{out_file}.{rank}")
    P.leave_process_group()


@needs_gloo
def test_replay_reports_over_every_ranks_rows(tmp_path):
    """2 ranks under --replay_rounds 1: each rank trains on its fresh and replayed rows' advantages
    as phase 4 made them (no statistics of now); replay/weight_max is the largest π_prox/μ of any
    rank's replayed tokens and replay/weight_mean their mean over the replayed (real) tokens."""
    spawn_2(replay_worker, str(tmp_path / "out"))
    (train0, metrics0), (train1, metrics1) = [torch.load(tmp_path / f"out.{r}") for r in range(2)]
    assert metrics0 == metrics1
    keys = ("response_mask", "advantages", "prox", "sampler_logprobs", "age")
    train = {k: torch.cat([train0[k], train1[k]]) for k in keys}
    for rank, rows in enumerate((train0, train1)):
        gen = torch.Generator().manual_seed(rank)
        scale = 1.0 + 2 * rank
        old, fresh = stored_batch(gen, 0, scale=scale), stored_batch(gen, 1, scale=scale)
        assert torch.equal(rows["advantages"], torch.cat([fresh["advantages"], old["advantages"]]))
    mask = train["response_mask"]
    replayed = mask & (train["age"] > 0)[:, None]
    weight = (train["prox"] - train["sampler_logprobs"]).exp()
    assert metrics0["replay/weight_max"] == pytest.approx(weight[replayed].max().item(), rel=1e-6)
    assert weight[:8][replayed[:8]].max() < 0.9 * weight[replayed].max()  # the largest is rank 1's
    assert metrics0["replay/weight_mean"] == pytest.approx(weight[replayed].mean().item(), rel=1e-6)
    assert replayed.sum() < 0.6 * mask.sum()  # over all tokens the mean would differ


def test_replays_clip_shares_count_real_tokens_only():
    """update_stats and replay_stats on two micro-batches with garbage on the padding: the clip shares of fresh and
    replayed tokens, the outside-the-clip share and the first ratio of fresh tokens, against counts of real ones."""
    gen = torch.Generator().manual_seed(0)
    lengths, age = torch.tensor([5, 2, 3, 5, 1, 4]), torch.tensor([0, 1, 0, 1, 1, 2])
    mask = torch.arange(5) < lengths[:, None]
    old, A = -torch.rand(6, 5, generator=gen), torch.randn(6, 5, generator=gen)  # not 0 on the padding
    new = old + 0.4 * torch.randn(6, 5, generator=gen)
    stats = defaultdict(list)
    for rows in (slice(0, 3), slice(3, 6)):
        mb = dict(logprobs=old[rows], advantages=A[rows], response_mask=mask[rows], age=age[rows])
        P.update_stats(stats, mb, torch.zeros(3, 5), {}, P.policy_loss(new[rows], old[rows], A[rows], None, P.Args(cliprange_high=0.28))[1])
    shares = P.replay_stats(stats, 2)
    ratio = (new - old).exp()
    clipped = ((A > 0) & (ratio > 1.28)) | ((A < 0) & (ratio < 0.8))
    fresh, replayed = mask & (age == 0)[:, None], mask & (age > 0)[:, None]
    assert shares["replay/clipfrac_fresh"] == pytest.approx((clipped[fresh].float().mean()).item())
    assert shares["replay/clipfrac_replayed"] == pytest.approx((clipped[replayed].float().mean()).item())
    outside = (ratio < 0.8) | (ratio > 1.28)
    assert shares["replay/outside_clip_fresh"] == pytest.approx(outside[fresh].float().mean().item())
    assert shares["policy/first_ratio"] == pytest.approx(ratio[fresh].mean().item())
    assert 0 < clipped[replayed].float().mean() < 1 and (clipped & ~mask).any()  # the test has teeth


def test_ppo_epochs_clips_and_weighs_as_its_flags_say(tiny, tmp_path):
    """On a fixed batch with plain SGD (lr 1, so a step moves the weights by exactly the clipped gradient): every step's
    gradient norm is clipped to max_grad_norm; vf_coef 0 leaves the value model untouched; a tiny cliprange and
    cliprange_value clip most tokens; the stats are of the model's own entropy."""
    batch = fixed_rollout(tiny, tmp_path, 8)

    def run(lr, **flags):
        model = P.PolicyAndValue(loaded(tiny, "gpt2"), loaded_value(tiny))
        before = {k: v.clone() for k, v in model.state_dict().items()}
        args = P.Args(per_device_train_batch_size=8, **flags)
        torch.manual_seed(0)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        trained = P.ppo_epochs(model, optimizer, torch.amp.GradScaler("cpu", enabled=False), batch, args,
                               P.check_args(args), P.Runtime())
        moved = {k: (v - before[k]).norm() ** 2 for k, v in model.state_dict().items()}
        return model, trained, {part: sum(v for k, v in moved.items() if k.startswith(part)) ** 0.5
                                for part in ("policy.", "value_model.")}

    model, trained, moved = run(1.0, num_ppo_epochs=2, num_mini_batches=2, max_grad_norm=1e-3, vf_coef=0.0,
                                cliprange=1e-6)
    assert trained.optimizer_steps == 4 and min(trained.stats["policy/grad_norm"]) > 1e-2  # clipping had work to do
    assert 1e-3 < moved["policy."] <= 4e-3 * (1 + 1e-4) and moved["value_model."] == 0
    assert torch.stack(trained.stats["policy/clipfrac_avg"][1:]).mean() > 0.2  # after the first step, ρ ≠ 1
    _, trained, _ = run(1e-2, num_ppo_epochs=2, num_mini_batches=1, vf_coef=1.0, cliprange_value=1e-6)
    assert trained.stats["val/clipfrac_avg"][1] > 0.5
    model, trained, moved = run(0.0, num_ppo_epochs=1, num_mini_batches=1)  # one micro-batch: all 8 rows, no step
    with torch.no_grad():
        _, entropy, _ = model(batch["query_responses"], batch["attention_mask"], batch["context_length"], 1.0)
    assert torch.isclose(trained.stats["policy/entropy_avg"][0], P.masked_mean(entropy, batch["response_mask"]))
    assert trained.stats["val/ratio"][0] == 1 and trained.stats["policy/approxkl_avg"][0] == 0


def frozen_worker(rank, port, tiny, out_file):
    init_gloo(rank, port)
    ref_policy = loaded(tiny, "gpt2")
    P.shard(ref_policy, frozen=True)
    ids, mask = P.left_pad([[5, 6, 7, 8], [9, 10]], pad_token_id=0)
    with torch.no_grad():
        logprobs = P.response_logprobs(ref_policy, ids, mask, 2, 1.0)[0]
    kinds = {type(p).__name__ for p in ref_policy.parameters()}  # a DTensor is a shard; a plain tensor is whole
    torch.save((logprobs, kinds), f"{out_file}.{rank}")
    del ref_policy
    P.leave_process_group()  # once the models that hold the group are freed


@needs_gloo
def test_a_sharded_frozen_model_stays_sharded_after_its_forward(tiny, tmp_path):
    spawn_2(frozen_worker, tiny, str(tmp_path / "out"))
    ids, mask = P.left_pad([[5, 6, 7, 8], [9, 10]], pad_token_id=0)
    with torch.no_grad():
        expected = P.response_logprobs(loaded(tiny, "gpt2"), ids, mask, 2, 1.0)[0]
    for rank in range(2):
        logprobs, kinds = torch.load(tmp_path / f"out.{rank}")
        assert kinds == {"DTensor"} and torch.allclose(logprobs, expected, atol=1e-5)


def generate_worker(rank, port, tiny, unshard, out_file):
    init_gloo(rank, port)
    policy = loaded(tiny, "gpt2")
    queries, query_mask = P.left_pad([[5, 6, 7]] * 3 if rank == 0 else [[8, 9], [10, 11, 12], [13]], pad_token_id=0)
    with torch.no_grad():  # rank 0 stops at its greedy first token: after one step; rank 1 never stops
        stop = int(policy(input_ids=queries).logits[0, -1].argmax()) if rank == 0 else None
    torch.manual_seed(rank)
    with torch.no_grad():
        reference = P.generate(policy, queries, query_mask, 8, 0.01, [stop] if rank == 0 else [], pad_token_id=0)
    P.shard(policy)
    torch.manual_seed(rank)
    with torch.no_grad(), P.gathered(policy, unshard):
        sharded = P.generate(policy, queries, query_mask, 8, 0.01, [stop] if rank == 0 else [], pad_token_id=0,
                             sync_ranks=not unshard)
    torch.save((reference, sharded), f"{out_file}.{rank}")
    del policy
    P.leave_process_group()  # once the models that hold the group are freed


@needs_gloo
@pytest.mark.parametrize("unshard", [True, False])
def test_fsdp_ranks_that_stop_at_different_lengths_do_not_hang(tiny, tmp_path, unshard):
    spawn_2(generate_worker, tiny, unshard, str(tmp_path / "out"))  # a hang would end in the collective timeout
    for rank in range(2):
        (ref_tokens, ref_logprobs), (tokens, logprobs) = torch.load(tmp_path / f"out.{rank}")
        assert ref_tokens.shape[1] == (1 if rank == 0 else 8)
        n = ref_tokens.shape[1]  # the sharded policy samples the same tokens with the same log-probs
        assert torch.equal(tokens[:, :n], ref_tokens) and torch.allclose(logprobs[:, :n], ref_logprobs, atol=1e-5)
        assert (tokens[:, n:] == 0).all()  # a rank kept in step by the others only adds padding


def main_worker(rank, port, tiny, output_dir, flags, out_file):
    """One rank of a 2-rank run of main() with the real wiring, recording what it hands to the PPO update."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")  # as torchrun sets them
    init_gloo(rank, port)
    with pytest.MonkeyPatch.context() as monkeypatch:
        calls = spy_on_updates(monkeypatch)
        P.main(P.Args(**{**dict(model_name_or_path=tiny["gpt2"], reward_fn=[f"{__file__}:num_words"],
                                dataset=tiny["prompts"], output_dir=output_dir, total_episodes=16,
                                per_device_train_batch_size=4, num_mini_batches=1, num_ppo_epochs=1, response_length=6,
                                stop_token_id=5, num_sample_generations=0, eval_on_start=False),
                             **flags}))
    torch.save([batch for batch, *_ in calls], f"{out_file}.{rank}")
    del calls  # it holds the DDP model
    P.leave_process_group()  # once the models that hold the group are freed


@needs_gloo
def test_two_ranks_of_main_take_their_own_prompts_and_whiten_over_the_global_batch(tiny, tmp_path):
    """2 ranks of main(): each its own prompts; rewards and advantages whitened, scores scaled by the running std of
    every raw score so far, and explained variance, all with the global batch's statistics; the held-out evaluation
    of 3 prompts (2 per rank, the last repeated to fill rank 1's slice) counts each prompt once."""
    flags = dict(whiten_rewards=True, score_scaling="running_std", eval_dataset=tiny["txt"],
                 reward_fn=[f"{__file__}:words_with_the_prompts"])  # a score each prompt's own
    spawn_2(main_worker, tiny, str(tmp_path / "run"), flags, str(tmp_path / "out"))
    ranks = [torch.load(tmp_path / f"out.{r}") for r in range(2)]
    metrics = read_metrics(tmp_path / "run")
    assert [len(r) for r in ranks] == [2, 2] and len(metrics) == 2
    raw_so_far = []
    for update in range(2):
        a, b = ranks[0][update], ranks[1][update]
        raw_so_far.append(torch.cat([a["raw_scores"], b["raw_scores"]]).double())
        std = torch.cat(raw_so_far).std()  # of both ranks' raw scores, all updates so far
        assert torch.allclose(torch.cat([a["scores"], b["scores"]]).double(), raw_so_far[-1] / std, atol=1e-5)
        alone = torch.cat([ranks[0][u]["raw_scores"] for u in range(update + 1)]).double().std()
        assert abs(alone - std) > 1e-3  # the test has teeth: rank 0's own scores have another spread
        returns, values = (torch.cat([a[k][a["response_mask"]], b[k][b["response_mask"]]]).double()
                           for k in ("returns", "values"))
        explained = 1 - (returns - values).var() / returns.var()  # of the global batch, not of one rank
        assert metrics[update]["val/explained_variance"] == pytest.approx(explained.item(), abs=1e-5)
        queries = [r["query_responses"][:, : r["context_length"]] for r in (a, b)]
        assert queries[0].shape != queries[1].shape or not torch.equal(*queries)  # each rank its own prompts
        for key, shifted in (("advantages", True), ("rewards", False)):  # rewards: unit variance, mean kept
            both = torch.cat([a[key][a["response_mask"]], b[key][b["response_mask"]]]).double()
            assert abs(both.var() - 1) < 1e-4 and (not shifted or abs(both.mean()) < 1e-5), key
            alone = a[key][a["response_mask"]].double()  # the test has teeth: one rank's own statistics differ
            assert abs(alone.var() - 1) > 1e-3 or abs(alone.mean() - both.mean()) > 1e-3
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "run" / "policy")
    models = SimpleNamespace(policy=AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "policy"),
                             ref_policy=AutoModelForCausalLM.from_pretrained(tiny["gpt2"], dtype=torch.float32),
                             value_model=None, reward_models=[], builtin_reward=False, reward_weights=torch.ones(1),
                             reward_fns=[(words_with_the_prompts, "w", ("completions", "prompts"))],
                             tokenizer=tokenizer,
                             pad_token_id=tokenizer.pad_token_id, stop_token_ids=[5], policy_head=None, ref_head=None,
                             reference=contextlib.nullcontext)
    args = P.Args(response_length=6, kl_estimator="k1")  # as main resolves it
    state = SimpleNamespace(global_step=2, max_steps=2, epoch=0.4)
    alone, samples = P.evaluate(models, P.load_prompts(tiny["txt"], args, tokenizer, None), 1, args, P.Runtime(),
                                state)
    assert len(samples) == 3 and len(read_lines(tmp_path / "run" / "samples.jsonl")) == 2  # rank 0's 2 of 3
    keys = ("eval/score", "eval/response_length")
    for key in keys:
        assert metrics[-1][key] == pytest.approx(alone[key], abs=1e-6), key
    (tmp_path / "last.txt").write_text(open(tiny["txt"]).read().split("\n")[-2] + "\n")  # the repeated prompt
    repeated, _ = P.evaluate(models, P.load_prompts(str(tmp_path / "last.txt"), args, tokenizer, None), 1, args,
                             P.Runtime(), state)
    # counted twice, it would move a mean off the one of 3 prompts: the test has teeth
    assert max(abs(repeated[key] - alone[key]) for key in keys) > 1e-4


@needs_gloo
def test_two_ranks_of_main_keep_each_group_on_one_rank(tiny, tmp_path, monkeypatch):
    """--num_generations 2 over 2 ranks: each rank samples its own prompts twice, in consecutive rows; the GRPO
    advantages (KL in the loss, γ = 1: A_t = the baselined score on every token) are those of the concatenated batch,
    with no whitening over ranks. A TRL-style reward function on each rank gets its own rows' answers."""
    monkeypatch.setenv("REWARD_LOG", str(tmp_path / "log"))
    spawn_2(main_worker, tiny, str(tmp_path / "run"), dict(
        num_generations=2, advantage_estimator="grpo", kl_in="loss", dataset=tiny["answers"],
        reward_fn=[f"{__file__}:num_words", f"{__file__}:answer_matches"]), str(tmp_path / "out"))
    ranks = [torch.load(tmp_path / f"out.{r}") for r in range(2)]
    tokenizer = AutoTokenizer.from_pretrained(tiny["gpt2"])
    answers = {r["prompt"]: r for r in read_lines(tiny["answers"])}
    for rank in range(2):
        for batch, call in zip(ranks[rank], read_lines(tmp_path / f"log.{rank}"), strict=True):
            queries = batch["query_responses"][:, : batch["context_length"]]
            assert call["prompts"] == tokenizer.batch_decode(queries, skip_special_tokens=True)  # this rank's rows
            assert call["answer"] == [answers[p]["answer"] for p in call["prompts"]]
    for a, b in zip(*ranks):
        queries = [r["query_responses"][:, : r["context_length"]] for r in (a, b)]
        for q in queries:
            assert torch.equal(q[0::2], q[1::2])  # rows 2i and 2i + 1: one prompt
        assert queries[0].shape != queries[1].shape or not torch.equal(*queries)  # each rank its own prompts
        scores = torch.cat([a["scores"], b["scores"]])
        expected = P.baselined_scores(scores, torch.cat([a["lengths"], b["lengths"]]), 2, "grpo")
        mask = torch.cat([F.pad(r["response_mask"], (0, 6 - r["response_mask"].shape[1])) for r in (a, b)])
        advantages = torch.cat([F.pad(r["advantages"], (0, 6 - r["advantages"].shape[1])) for r in (a, b)])
        assert torch.allclose(advantages, torch.where(mask, expected[:, None], 0.0), atol=1e-6)
        assert scores.std() > 0 and expected.abs().max() > 0.5  # not all equal: the test has teeth


# ----------------------------------------------------------------------------------------------------------------- LoRA
def lora_policy(tiny, arch, **flags):
    """The tiny policy with LoRA adapters whose B is random (at the start B = 0 and the adapter does nothing)."""
    policy = P.add_lora(loaded(tiny, arch), P.Args(lora_r=4, **flags))
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return policy


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_lora_reference_is_the_base_and_only_adapters_and_the_value_head_train(tiny, arch):
    policy, base = lora_policy(tiny, arch), loaded(tiny, arch)
    assert type(P.backbone(policy)).__name__ == type(P.backbone(base)).__name__  # the decoder stack, not the LM
    ids, mask = P.left_pad([[5, 6, 7, 8, 9], [9, 10, 11]], pad_token_id=0)
    with torch.no_grad():
        with policy.disable_adapter():
            off = P.response_logprobs(policy, ids, mask, 2, 1.0, P.output_layer(policy))[0]
        on = P.response_logprobs(policy, ids, mask, 2, 1.0, P.output_layer(policy))[0]
        reference = P.response_logprobs(base, ids, mask, 2, 1.0)[0]
    assert torch.allclose(off, reference, atol=1e-6) and not torch.allclose(on, reference, atol=1e-3)
    value_model = loaded(tiny, arch, AutoModelForSequenceClassification, f"{arch}_rm")
    value_model = P.add_lora(value_model, P.Args(lora_r=4), modules_to_save=["score"])
    model = P.PolicyAndValue(policy, value_model, fused_head=True)
    logprobs, entropy, values = model(ids, mask, 2, 1.0)
    (logprobs.sum() + entropy.sum() + values.sum()).backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert with_grad == trainable and all("lora_" in n or "modules_to_save" in n for n in trainable)
    assert any("score.modules_to_save" in n for n in trainable) and len(trainable) > 10


@pytest.mark.parametrize("frozen", [True, False])
def test_the_chunked_output_layer_makes_no_gradient_for_a_frozen_head(monkeypatch, frozen):
    """With LoRA the output layer is frozen: backward must not build its (V, H) gradient (hundreds of MiB at a 150k
    vocabulary); the gradient of the hidden states is the same either way."""
    monkeypatch.setattr(P, "logprobs_chunk_rows", lambda vocab_size: 4)
    gen = torch.Generator().manual_seed(8)
    hidden = torch.randn(2, 6, 16, generator=gen, requires_grad=True)
    head = torch.nn.Linear(16, 50, bias=True)
    head.requires_grad_(not frozen)
    tokens = torch.randint(0, 50, (2, 6), generator=gen)
    logprobs, entropy = P.chunked_logprobs(hidden, tokens, 1.0, head)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        (logprobs.sum() + entropy.sum()).backward()
    grad_w = sum(e.count for e in prof.key_averages(group_by_input_shape=True)  # ∂W = ∂zᵀ·x, per chunk of 4 rows
                 if e.key == "aten::mm" and e.input_shapes == [[50, 4], [4, 16]])
    assert grad_w == (0 if frozen else 3) and (head.weight.grad is None) == frozen
    expected = torch.autograd.grad((lambda lp: (lp.gather(-1, tokens[..., None]).sum() - (lp.exp() * lp).sum()))(
        torch.log_softmax(head(hidden), -1)), hidden)[0]
    assert torch.allclose(hidden.grad, expected, atol=1e-5)


def lora_logprobs(model, batch):
    with torch.no_grad():
        return P.response_logprobs(model, batch["query_responses"], batch["attention_mask"], batch["context_length"],
                                   1.0)[0]


@pytest.mark.parametrize("arch,dtype,gradient_checkpointing", [("gpt2", "fp32", False), ("llama", "bf16", True)])
def test_lora_end_to_end_saves_an_adapter(tiny, tmp_path, monkeypatch, arch, dtype,
                                          gradient_checkpointing):
    """A LoRA run: the first ratio is 1, the reference log-probs are the base model's, the checkpoint holds only what
    trains; policy/ is an adapter naming the base it was trained on, holding the trained adapter."""
    from peft import PeftModel
    calls, loaded_models, load_models = spy_on_updates(monkeypatch), [], P.load_models
    monkeypatch.setattr(P, "load_models", lambda *a: loaded_models.append(load_models(*a)) or loaded_models[-1])
    args = run_args(tiny, tmp_path, model_name_or_path=tiny[arch], reward_model_path=[tiny[f"{arch}_rm"]],
                    lora_r=4, lora_alpha=8.0, dtype=dtype, learning_rate=1e-2, save_every=2,
                    gradient_checkpointing=gradient_checkpointing, eval_dataset=tiny["txt"])
    P.main(args)
    metrics = read_metrics(args.output_dir)
    assert all(abs(m["policy/first_ratio"] - 1) < 1e-5 for m in metrics)
    assert metrics[-1]["objective/kl"] > 1e-3  # its reference is the base, the adapter switched off
    assert loaded_models[0][0].ref_policy is loaded_models[0][0].policy  # no copy: the same weights, adapter off
    base = loaded(tiny, arch)
    for batch, logprobs, _, _ in calls:
        mask = batch["response_mask"]
        reference = lora_logprobs(base, batch) if dtype == "fp32" else None
        if reference is not None:
            assert torch.allclose(batch["ref_logprobs"][mask], reference[mask], atol=1e-5)
    assert not torch.allclose(calls[-1][1][mask], batch["ref_logprobs"][mask], atol=1e-3)  # the adapter moved
    state = checkpoint_state(os.path.join(args.output_dir, "checkpoint-000002"))["model"]
    assert state and all(".lora_" in k or ".modules_to_save." in k for k in state)
    assert sorted(os.listdir(args.output_dir)) == ["checkpoint-000002", "complete.json", "metrics.jsonl", "policy",
                                                   "samples.jsonl",
                                                   "value_model"]  # the base: the tiny model's folder
    policy_dir = os.path.join(args.output_dir, "policy")
    assert P.adapter_base(policy_dir) == tiny[arch]
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny[arch], dtype=torch.float32),
                                        policy_dir)
    adapter = {k: v for k, v in adapted.state_dict().items() if ".lora_" in k}
    assert adapter.keys() == {k[len("policy."):] for k in state if k.startswith("policy.")}  # the trained adapter
    assert all(torch.equal(v, state["policy." + k]) for k, v in adapter.items())


def test_an_adapter_checkpoint_as_the_policy_is_merged_and_is_the_reference(tiny, tmp_path, monkeypatch):
    """--model_name_or_path an adapter folder: the base with that adapter merged in is both where the new adapter
    starts and the reference; also with a value-free estimator (no value model)."""
    from peft import PeftModel
    adapter_dir = str(tmp_path / "adapter")
    lora_policy(tiny, "gpt2").save_pretrained(adapter_dir)
    assert P.adapter_base(adapter_dir) == tiny["gpt2"]
    calls = spy_on_updates(monkeypatch)
    args = run_args(tiny, tmp_path, model_name_or_path=adapter_dir, lora_r=4, total_episodes=8,
                    advantage_estimator="grpo", num_generations=2)
    P.main(args)
    policy_dir = os.path.join(args.output_dir, "policy")  # its base is the merged model, saved beside it
    assert P.adapter_base(policy_dir) == os.path.join(args.output_dir, "policy_base")
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(P.adapter_base(policy_dir)), policy_dir)
    merged = PeftModel.from_pretrained(loaded(tiny, "gpt2"), adapter_dir).merge_and_unload()
    batch, logprobs, values, _ = calls[0]
    mask = batch["response_mask"]
    assert values is None and torch.allclose(batch["ref_logprobs"][mask], lora_logprobs(merged, batch)[mask], atol=1e-5)
    assert torch.allclose(logprobs[mask], batch["ref_logprobs"][mask], atol=1e-5)  # B = 0: π_θ starts at the merged
    assert not torch.allclose(lora_logprobs(loaded(tiny, "gpt2"), batch)[mask], logprobs[mask], atol=1e-3)


def test_an_adapter_given_with_a_tilde_loads_with_its_own_tokenizer(tiny, tmp_path, monkeypatch):
    """--model_name_or_path ~/adapter: the adapter loads (transformers and peft read no `~`), with
    the tokenizer saved beside it, not its base's."""
    monkeypatch.setenv("HOME", str(tmp_path))
    lora_policy(tiny, "gpt2").save_pretrained(str(tmp_path / "adapter"))
    tokenizer = AutoTokenizer.from_pretrained(tiny["gpt2"])
    assert tokenizer.chat_template is None
    tokenizer.chat_template = CHAT_TEMPLATE  # its own: the base's has none
    tokenizer.save_pretrained(str(tmp_path / "adapter"))
    args = run_args(tiny, tmp_path, model_name_or_path="~/adapter", lora_r=4, total_episodes=8)
    P.main(args)
    saved = AutoTokenizer.from_pretrained(os.path.join(args.output_dir, "policy"))
    assert saved.chat_template == CHAT_TEMPLATE


def test_lora_on_the_built_in_task_saves_the_base_beside_the_adapters(tmp_path):
    """The built-in task's model lives in a temp folder deleted at exit: its base weights are saved beside the
    adapters, which name them, so that the adapters load after the run."""
    from peft import PeftModel
    out = str(tmp_path / "run")
    result = subprocess.run([sys.executable, SCRIPT, "--lora_r", "4", "--total_episodes", "256", "--output_dir", out],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert "LoRA r 4: " in result.stdout.splitlines()[0]
    for name, cls in (("policy", AutoModelForCausalLM), ("value_model", AutoModelForSequenceClassification)):
        folder = os.path.join(out, name)
        assert P.adapter_base(folder) == os.path.join(out, f"{name}_base")
        model = PeftModel.from_pretrained(cls.from_pretrained(P.adapter_base(folder)), folder)
        assert any(v.abs().max() > 0 for k, v in model.state_dict().items() if "lora_B" in k)  # trained adapters


def test_truncated_completions_left_out_of_the_loss(tiny, tmp_path, monkeypatch):
    """--mask_truncated_completions: responses cut off before the stop token get no weight in the loss (whatever their
    advantages and returns, the update is the same), and a minibatch left with no token is skipped, not a NaN."""
    calls = spy_on_updates(monkeypatch)
    args = run_args(tiny, tmp_path, total_episodes=8, per_device_train_batch_size=8, stop_token_id=5, seed=3,
                    mask_truncated_completions=True)
    P.main(args)
    batch = calls[0][0]
    responses, mask = batch["query_responses"][:, batch["context_length"]:], batch["response_mask"]
    truncated = torch.tensor([5 not in row[:n] for row, n in zip(responses.tolist(), batch["lengths"].tolist())])
    assert torch.equal(batch["truncated"], truncated) and 0 < truncated.sum() < len(truncated)  # some of each
    assert torch.equal(batch["loss_mask"], mask & ~truncated[:, None])
    assert read_metrics(args.output_dir)[0]["val/truncated_frac"] == pytest.approx(truncated.float().mean().item())

    def update(batch):
        model = P.PolicyAndValue(loaded(tiny, "gpt2"), loaded_value(tiny))
        train_args = P.Args(per_device_train_batch_size=8, num_ppo_epochs=2, num_mini_batches=2)
        torch.manual_seed(0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        trained = P.ppo_epochs(model, optimizer, torch.amp.GradScaler("cpu", enabled=False), batch, train_args,
                               P.check_args(train_args), P.Runtime())
        return model.state_dict(), trained

    gen = torch.Generator().manual_seed(11)
    noise = {k: torch.where(truncated[:, None], torch.randn(mask.shape, generator=gen) * 10, batch[k])
             for k in ("advantages", "returns")}
    masked, _ = update(batch)
    assert all(torch.equal(masked[k], v) for k, v in update({**batch, **noise})[0].items())
    unmasked = {**batch, "loss_mask": mask}
    assert not all(torch.equal(update(unmasked)[0][k], v) for k, v in update({**unmasked, **noise})[0].items())
    nothing = {**batch, "loss_mask": torch.zeros_like(mask)}
    weights, trained = update(nothing)
    initial = P.PolicyAndValue(loaded(tiny, "gpt2"), loaded_value(tiny)).state_dict()
    assert trained.optimizer_steps == 0 and trained.stop_reason is None  # skipped, not a non-finite loss
    assert all(torch.equal(weights[k], initial[k]) for k in weights)


# -------------------------------------------------------- behaviours a mutation run found unpinned
# the sampler's μ against π_old (--dtype bf16/fp16)
def mismatch_metrics(mu, old, mask):
    """update_metrics on a hand-built batch of (B, R) log-probs, μ the sampler's and π_old the
    recomputed ones: one reward function, no reference, no value model, no PPO statistics; rt
    under bf16 autocast, so that the mismatch metrics are computed."""
    B, R = mu.shape
    zeros = torch.zeros(B, R)
    batch = {"response_mask": mask, "kl": zeros, "scores": torch.zeros(B), "returns": zeros,
             "penalties": zeros, "scored": torch.ones(B, dtype=torch.bool), "logprobs": old,
             "sampler_logprobs": mu,
             "raw_scores": torch.zeros(B), "lengths": mask.sum(1),
             "truncated": torch.zeros(B, dtype=torch.bool), "source_scores": torch.zeros(B, 1),
             "attention_mask": torch.ones(B, R + 2, dtype=torch.bool), "kl_coef": 0.0}
    trained = SimpleNamespace(stats={}, optimizer_steps=1, steps_per_epoch=1,
                              train_tokens=int(mask.sum()))
    models = SimpleNamespace(ref_policy=None, value_model=None, builtin_reward=False,
                             reward_models=[], reward_fns=[(num_words, "num_words", None)])
    args = SimpleNamespace(num_generations=1, gradient_accumulation_steps=1, kl_in="reward",
                           reward_model_path=None)
    rt = P.Runtime(low_dtype=torch.bfloat16)
    averaged, _ = P.update_metrics(batch, trained, models, args, rt)
    return averaged


def real_entries(x, mask):
    return [v for v, m in zip(x.flatten().tolist(), mask.flatten().tolist()) if m]


def test_mismatch_kl_is_the_kl_of_the_sampler_from_pi_old_by_k3():
    """rollout/mismatch_kl is KL(μ‖π_old) over the tokens μ sampled: per real token k3 = w − 1 −
    log w with w = π_old/μ, averaged over the real tokens (padding ignored). The other direction,
    KL(π_old‖μ), per token 1/w − 1 + log w, differs wherever μ ≠ π_old."""
    log_w = torch.tensor([[0.5, -0.7, 0.2, 9.0], [-1.2, 0.3, 5.0, -5.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    mu = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-0.3, -1.5, -2.0, -1.0]], dtype=torch.float64)
    old = mu + log_w
    real = real_entries(log_w, mask)
    expected = sum(math.exp(x) - 1 - x for x in real) / len(real)
    reverse = sum(math.exp(-x) - 1 + x for x in real) / len(real)
    assert abs(expected - reverse) > 0.1  # the two directions are far apart here
    got = mismatch_metrics(mu.float(), old.float(), mask)["rollout/mismatch_kl"]
    assert got == pytest.approx(expected, rel=1e-5)


def test_mismatch_outside_frac_judges_w_itself_against_0_9_and_1_1():
    """rollout/mismatch_outside_frac is the share of real tokens whose w = π_old/μ is outside
    [0.9, 1.1] (|w − 1| > 0.1), judged on w, not on log w: log w = 0.098 (w = 1.103) is outside
    and log w = −0.103 (w = 0.902) inside, although |log w| says the opposite of each."""
    log_w = torch.tensor([[0.098, -0.103, 0.05, 0.2], [-0.2, 0.0, 0.098, 0.3]],
                         dtype=torch.float64)
    mask = torch.tensor([[True, True, True, True], [True, True, True, False]])
    mu = torch.full((2, 4), -1.0, dtype=torch.float64)
    old = mu + log_w
    real = real_entries(log_w, mask)
    outside = [abs(math.exp(x) - 1) > 0.1 for x in real]  # 0.098 twice, ±0.2
    assert outside != [abs(x) > 0.1 for x in real]  # log space would count other tokens
    got = mismatch_metrics(mu.float(), old.float(), mask)["rollout/mismatch_outside_frac"]
    assert got == pytest.approx(sum(outside) / len(real)) and got == pytest.approx(4 / 7)


# ----------------------------------------------------------- the reference's precision under bf16
def test_a_reference_model_path_under_bf16_is_loaded_in_fp32_as_the_policy(tiny, tmp_path,
                                                                            monkeypatch):
    """--ref_model_path with --dtype bf16 in one process: the reference is loaded in the policy's
    precision (fp32 weights under bf16 autocast), not in bf16, so that where π_θ = π_ref (here
    the same checkpoint, in update 1's rollout) the KL is exactly 0, not a bf16 floor."""
    loaded = []
    real = P.load_models
    monkeypatch.setattr(P, "load_models", lambda *a: loaded.append(real(*a)) or loaded[-1])
    args = run_args(tiny, tmp_path, reward_model_path=None, reward_fn=[f"{__file__}:count_w1"],
                    dtype="bf16", ref_model_path=tiny["gpt2"], total_episodes=8)
    P.main(args)
    (models, _), = loaded
    assert models.ref_policy is not None and models.ref_policy is not models.policy
    assert {p.dtype for p in models.policy.parameters()} == {torch.float32}
    assert {p.dtype for p in models.ref_policy.parameters()} == {torch.float32}
    assert read_metrics(args.output_dir)[0]["objective/kl"] == 0.0


# ------------------------------------------------------------------------------ the warmup's length
def test_a_warmup_ratio_that_is_not_a_whole_number_of_updates_rounds_up_as_trl(tiny, tmp_path):
    """--warmup_ratio 0.3 of 4 updates: TRL's ceil(0.3·4) = 2 warmup updates (not floor: 1).
    Linear schedule: the learning rate of updates 1-4 is s/2 for step s = u − 1 < 2 (0, ½), then
    (4 − s)/(4 − 2) (1, ½) of --learning_rate; a warmup of 1 would give 0, 1, ⅔, ⅓."""
    warmup, steps = math.ceil(0.3 * 4), 4
    expected = [s / warmup if s < warmup else (steps - s) / (steps - warmup) for s in range(steps)]
    assert expected == [0.0, 0.5, 1.0, 0.5]
    P.main(run_args(tiny, tmp_path, total_episodes=32, lr_scheduler_type="linear",
                    warmup_ratio=0.3))
    assert [m["lr"] / 1e-3 for m in read_metrics(tmp_path / "run")] == pytest.approx(expected)


# -------------------------------------------------------------- a crashed run's samples set aside
def test_resume_auto_on_a_crashed_run_sets_its_samples_aside_too(tiny, tmp_path, capsys):
    """A run that crashed before any checkpoint (non-finite losses at update 3) leaves
    metrics.jsonl and samples.jsonl; --resume auto keeps both under the same .stale-<time> suffix,
    the crashed run's evaluations intact (not cut back to update 0 and lost), and the new
    samples.jsonl holds only the new run's evaluations."""
    args = run_args(tiny, tmp_path, reward_model_path=None, reward_fn=[f"{__file__}:huge_score"],
                    total_episodes=24, eval_dataset=tiny["txt"], num_sample_generations=3)
    with pytest.raises(SystemExit, match="non-finite"):  # at update 3, updates 1 and 2 logged
        P.main(args)
    samples = os.path.join(args.output_dir, "samples.jsonl")
    crashed = open(samples).read()
    assert {json.loads(line)["update"] for line in crashed.splitlines()} == {1, 2}
    P.main(dataclasses.replace(args, reward_fn=[f"{__file__}:count_w1"], total_episodes=16,
                               resume="auto"))
    stale_metrics = glob.glob(os.path.join(args.output_dir, "metrics.jsonl.stale-*"))
    stale = glob.glob(samples + ".stale-*")
    assert len(stale) == 1 and open(stale[0]).read() == crashed
    assert len(stale_metrics) == 1  # the same suffix: one crash, one time
    assert stale_metrics[0].rsplit(".", 1)[1] == stale[0].rsplit(".", 1)[1]
    new = read_lines(samples)
    num_prompts = len([line for line in open(tiny["txt"]) if line.strip()])
    assert [s["update"] for s in new] == [1] * num_prompts + [2] * num_prompts
    assert all(s["score"] == s["completion"].split().count("w1") for s in new)  # count_w1's


# ------------------------------------------------------------------------------------ a dead stderr
def test_say_points_a_dead_file_it_was_given_at_dev_null_and_leaves_stdout_alone(monkeypatch):
    """say(line, file=sys.stderr) whose reader is gone (EPIPE): that file's descriptor, not
    stdout's, now points at /dev/null, so what is still buffered and every later write vanish
    instead of raising; stdout stays where it was. Both are stand-ins (a pipe whose read end is
    closed, a temp file), so that pytest's own streams are untouched."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader exits
    dead = open(write_end, "w")
    stdout = tempfile.TemporaryFile("w+")
    monkeypatch.setattr(sys, "stdout", stdout)
    monkeypatch.setattr(sys, "stderr", dead)
    try:
        P.say("x", file=sys.stderr)  # no exception: the write's EPIPE is caught
        assert os.readlink(f"/proc/self/fd/{dead.fileno()}") == "/dev/null"
        assert os.readlink(f"/proc/self/fd/{stdout.fileno()}") != "/dev/null"
        P.say("y", file=sys.stderr)  # a write that succeeds now, into /dev/null
        P.say("to stdout")
        stdout.seek(0)
        assert stdout.read() == "to stdout\n"
    finally:
        monkeypatch.undo()
        with contextlib.suppress(OSError):  # still the pipe if say() missed it: EPIPE again
            dead.close()
        stdout.close()


# ------------------------------------------------------------------------ SIGHUP, and under nohup
def hup_run(tiny, output_dir, disposition):
    """The script (its __main__ block) on the tiny GPT-2 for 6 short updates, started with SIGHUP
    at `disposition` (set, then exec, as a shell or nohup leaves it); stdout and stderr piped."""
    wrapper = ("import os, signal, sys; signal.signal(signal.SIGHUP, getattr(signal, sys.argv[1]));"
               " os.execv(sys.executable, [sys.executable] + sys.argv[2:])")
    cmd = [sys.executable, "-c", wrapper, disposition, SCRIPT, "--model_name_or_path", tiny["gpt2"],
           "--reward_fn", f"{__file__}:count_w1", "--dataset", tiny["prompts"],
           "--output_dir", output_dir, "--total_episodes", "24",
           "--per_device_train_batch_size", "4", "--num_mini_batches", "1", "--num_ppo_epochs", "1",
           "--response_length", "4", "--num_sample_generations", "0"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("disposition", ["SIG_DFL", "SIG_IGN"], ids=["terminal", "nohup"])
def test_sighup_stops_and_saves_unless_it_was_ignored_as_under_nohup(tiny, tmp_path,
                                                                      disposition):
    """Started with SIGHUP at its default (a terminal that may close), the script installs its stop
    handler: a SIGHUP during the run finishes the update, saves a checkpoint, says how to go on and
    exits 0. Started with SIGHUP ignored (nohup), it leaves it ignored: the same SIGHUP changes
    nothing, and all 6 updates run. The disposition is set explicitly, whatever pytest's is."""
    output_dir = str(tmp_path / "run")
    process = hup_run(tiny, output_dir, disposition)
    lines = []
    for line in process.stdout:  # update 1 is logged: the run is under way
        lines.append(line)
        if line.startswith("update 1/6"):
            break
    process.send_signal(signal.SIGHUP)
    out, err = process.communicate(timeout=300)
    out = "".join(lines) + out
    assert process.returncode == 0, err
    updates = [m["update"] for m in read_metrics(output_dir)]
    notice = "SIGHUP: finishing this update, then saving a checkpoint"
    if disposition == "SIG_DFL":
        assert 1 <= len(updates) < 6 and updates == list(range(1, len(updates) + 1))
        checkpoint = os.path.join(output_dir, f"checkpoint-{len(updates):06d}")
        assert P.list_checkpoints(output_dir) == [checkpoint]
        assert notice in err and f"--output_dir {output_dir} --resume auto" in out
        assert not os.path.exists(os.path.join(output_dir, "policy"))
    else:
        assert updates == [1, 2, 3, 4, 5, 6] and P.list_checkpoints(output_dir) == []
        assert notice not in err and os.path.exists(os.path.join(output_dir, "policy"))
