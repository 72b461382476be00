"""Build a tiny SGLang-servable target (random Llama + a real byte-level BPE tokenizer) and run servers.

Used by the session-scoped server fixtures in `conftest.py`, and usable by hand:
`python tests/server_fixtures.py /tmp/tiny-target` writes the target folder.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = [EOS_TOKEN, "<|im_start|>", "<|im_end|>", "<|MASK|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TINY_TARGET = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=256, max_position_embeddings=4096, rope_theta=10000.0)


def _training_text(max_chars: int = 400_000) -> list[str]:
    """A bit of the Python standard library: real text the BPE can learn merges from, offline."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="ignore")
        texts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return texts


def build_tokenizer(folder: Path, vocab_size: int = 1024) -> int:
    """Train a byte-level BPE, save it as a transformers fast tokenizer; return its vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_training_text(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN,
                                   pad_token=EOS_TOKEN, mask_token="<|MASK|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return tokenizer.get_vocab_size()


def build_tiny_target(folder: Path, seed: int = 0, init_std: float = 0.08) -> Path:
    """Write a random tiny Llama with its tokenizer to `folder` (idempotent).

    Shaped so that server tests are meaningful and robust:
    * a large token embedding and damped attention/MLP outputs make the next token mostly a
      function of the current one (a drafter with a bigram table then accepts about 60 % of
      drafts: both accepted runs and rejections happen), while context still matters;
    * a scaled-up lm_head keeps top-2 logit gaps far above float rounding, so greedy decoding
      does not hinge on summation-order differences between a decode and a verify forward.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = Path(folder)
    if (folder / "config.json").exists() and (folder / "tokenizer.json").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    vocab_size = build_tokenizer(folder)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, initializer_range=init_std, tie_word_embeddings=False,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0, torch_dtype="float32", **TINY_TARGET)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(30.0)
        model.lm_head.weight.mul_(5.0)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.3)
            layer.mlp.down_proj.weight.mul_(0.3)
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 0, "bos_token_id": 0}))
    return folder


BIGRAM_BIAS = 100.0
MASK_TOKEN = "<|MASK|>"


def _successor_table(model, vocab_size: int):
    """The target's greedy next token after each single token (its bigram map)."""
    import torch

    with torch.no_grad():
        return model(torch.arange(vocab_size).unsqueeze(1)).logits[:, -1].argmax(-1)


def build_tiny_drafter(target_folder: Path, folder: Path, block_size: int = 4,
                       target_layer_ids: tuple[int, ...] = (1, 2), bigrams: str = "right") -> Path:
    """A DSpark drafter for the tiny target whose Markov head encodes the target's greedy bigrams.

    Random backbone weights would accept almost nothing, leaving the commit-of-accepted-drafts
    path untested; the target's own single-token successor table makes drafts right often enough that server tests see multi-token accepted runs (and wrong often enough
    to exercise rejection). Written with `save_drafter` in the DeepSpec layout, token weights
    omitted: the server shares the target's embedding and lm_head.

    `bigrams="wrong"` shifts every successor by one token: drafts the target almost never accepts,
    so that drafting is not worth its cost whatever the machine's timings (a right drafter's
    drafts paid for themselves at batch 3 on one run and not on another). `bigrams="runner_up"`
    makes the shifted token a close first choice after every odd token, the successor second
    (probability ~0.27): a chain misses there and a tree of drafts holds the right one.
    """
    import torch
    from transformers import LlamaForCausalLM

    from sglang_dspark.model import DSparkConfig, DSparkDrafter, save_drafter

    folder = Path(folder)
    if (folder / "config.json").exists():
        return folder
    target = LlamaForCausalLM.from_pretrained(target_folder, dtype=torch.float32).eval()
    vocab = target.config.vocab_size
    mask_id = json.loads((Path(target_folder) / "tokenizer.json").read_text())["model"]["vocab"][MASK_TOKEN]
    config = DSparkConfig.from_target_config(
        target.config, num_draft_layers=1, block_size=block_size, mask_token_id=mask_id,
        target_layer_ids=list(target_layer_ids), markov_rank=vocab, markov_head_type="vanilla",
        enable_confidence_head=True, confidence_head_with_markov=True,
    )
    torch.manual_seed(0)
    drafter = DSparkDrafter(config, target=target).eval()
    if bigrams not in ("right", "wrong", "runner_up"):
        raise ValueError(f"bigrams={bigrams!r}: expected right, wrong or runner_up")
    successor = _successor_table(target, vocab)
    if bigrams == "wrong":
        successor = (successor + 1) % vocab
    with torch.no_grad():
        drafter.markov_head.markov_w1.weight.copy_(torch.eye(vocab))
        w2 = torch.zeros(vocab, vocab)
        w2[successor, torch.arange(vocab)] = BIGRAM_BIAS
        if bigrams == "runner_up":
            odd = torch.arange(1, vocab, 2)
            w2[(successor[odd] + 1) % vocab, odd] = BIGRAM_BIAS + 1.0
        drafter.markov_head.markov_w2.weight.copy_(w2)
    save_drafter(drafter, folder, include_token_weights=False)
    return folder


@dataclass
class ServerHandle:
    """A running `python -m sglang.launch_server` and how to reach it."""

    url: str
    process: subprocess.Popen
    log_path: Path
    args: list[str] = field(default_factory=list)

    def stop(self) -> None:
        """Stop the whole process group (scheduler and detokenizer are children)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""


def start_server(model_path: Path, port: int, log_path: Path, extra_args: list[str] | None = None,
                 env: dict[str, str] | None = None) -> ServerHandle:
    """Start SGLang on CPU in its own process group (returns at once; see `wait_healthy`)."""
    args = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_path),
            "--device", "cpu", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--max-total-tokens", "16384", "--max-running-requests", "16", "--sleep-on-idle",
            *(extra_args or [])]
    full_env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", **(env or {})}
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT, env=full_env,
                                   start_new_session=True)
    return ServerHandle(url=f"http://127.0.0.1:{port}", process=process, log_path=log_path, args=args)


def wait_healthy(handle: ServerHandle, timeout_s: float = 420.0) -> ServerHandle:
    """Poll /health until 200; on exit, on a port it could not bind (its HTTP server stops but the
    process lives on) or on timeout, stop the server and raise with its log tail."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if handle.process.poll() is not None:
            raise RuntimeError(f"SGLang server exited with {handle.process.returncode}:\n{handle.log_tail()}")
        if "address already in use" in handle.log_tail():
            handle.stop()
            raise RuntimeError(f"SGLang server could not bind {handle.url}:\n{handle.log_tail()}")
        try:
            if httpx.get(f"{handle.url}/health", timeout=5).status_code == 200:
                return handle
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    handle.stop()
    raise TimeoutError(f"SGLang server not healthy after {timeout_s:.0f}s:\n{handle.log_tail()}")


def launch_servers(model_path: Path, specs: list[tuple[str, int, list[str], dict[str, str]]],
                   log_dir: Path) -> dict[str, ServerHandle]:
    """Start several servers (name, port, args, env) at once and wait until all are healthy."""
    handles = {name: start_server(model_path, port, Path(log_dir) / f"{name}.log", extra, env)
               for name, port, extra, env in specs}
    try:
        for handle in handles.values():
            wait_healthy(handle)
    except Exception:
        for handle in handles.values():
            handle.stop()
        raise
    return handles


if __name__ == "__main__":
    target_dir = build_tiny_target(Path(sys.argv[1]))
    print(target_dir, build_tiny_drafter(target_dir, Path(sys.argv[2])) if len(sys.argv) > 2 else "")
