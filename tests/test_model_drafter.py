"""The DSpark drafter computes section 1-3 of dspark-algorithm.md, batched and incrementally."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from tiny import TINY_MASK_TOKEN_ID, make_tiny_drafter, make_tiny_target, tiny_taps  # noqa: E402

ATOL = 2e-5


@pytest.fixture(scope="module")
def target():
    return make_tiny_target(seed=0)


@pytest.fixture(scope="module")
def sequences(target):
    ids = torch.randint(0, 500, (3, 16), generator=torch.Generator().manual_seed(7))
    return ids, tiny_taps(target, ids)


def reference_block(drafter, taps: torch.Tensor, anchor: int) -> torch.Tensor:
    """Section 1.4 written out naively for one slot: `[gamma, d]` hidden states."""
    cfg, sd = drafter.config, drafter.state_dict()
    heads, kv, hd, gamma = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, drafter.gamma

    def rms(x, w):
        x32 = x.float()
        return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps))

    def rope(x, pos):
        inv = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        ang = (pos[:, None].double() * inv).float()
        cos, sin = torch.cat((ang, ang), -1).cos()[:, None], torch.cat((ang, ang), -1).sin()[:, None]
        return x * cos + torch.cat((-x[..., hd // 2:], x[..., : hd // 2]), -1) * sin

    ctx_len = taps.shape[0]
    ctx = rms(taps @ sd["fc.weight"].T, sd["hidden_norm.weight"])
    tokens = torch.tensor([anchor] + [cfg.mask_token_id] * (gamma - 1))
    h = drafter.embed_tokens.weight[tokens]
    pos_ctx, pos_blk = torch.arange(ctx_len), ctx_len + torch.arange(gamma)
    for i in range(cfg.num_hidden_layers):
        w = {k.split(f"layers.{i}.", 1)[1]: v for k, v in sd.items() if k.startswith(f"layers.{i}.")}
        x = rms(h, w["input_layernorm.weight"])
        q = rope(rms((x @ w["self_attn.q_proj.weight"].T).view(gamma, heads, hd), w["self_attn.q_norm.weight"]), pos_blk)
        both = torch.cat((ctx, x))
        k = (both @ w["self_attn.k_proj.weight"].T).view(-1, kv, hd)
        k = rope(rms(k, w["self_attn.k_norm.weight"]), torch.cat((pos_ctx, pos_blk)))
        v = (both @ w["self_attn.v_proj.weight"].T).view(-1, kv, hd)
        k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
        attn = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / hd**0.5, -1)
        h = h + torch.einsum("hqk,khd->qhd", attn, v).reshape(gamma, -1) @ w["self_attn.o_proj.weight"].T
        x = rms(h, w["post_attention_layernorm.weight"])
        h = h + (F.silu(x @ w["mlp.gate_proj.weight"].T) * (x @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T
    return rms(h, sd["norm.weight"])


def draft_alone(drafter, taps: torch.Tensor, anchor: int) -> torch.Tensor:
    cache = drafter.new_cache(1)
    drafter.append_context(cache, [0], taps, [taps.shape[0]])
    return drafter.forward_block(cache, [0], torch.tensor([anchor]))[0]


@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize("context_len", [0, 1, 11])
def test_block_matches_an_independent_reference(target, sequences, num_layers, context_len) -> None:
    ids, taps = sequences
    drafter = make_tiny_drafter(target, num_layers=num_layers, gamma=5)
    anchor = int(ids[0, context_len])
    got = draft_alone(drafter, taps[0, :context_len], anchor)
    torch.testing.assert_close(got, reference_block(drafter, taps[0, :context_len], anchor), atol=ATOL, rtol=0)


def test_block_reads_the_anchor_and_masks(target, sequences) -> None:
    """Slot 0 input is the anchor, later slots the mask token: changing the anchor moves every slot."""
    ids, taps = sequences
    drafter = make_tiny_drafter(target, gamma=4)
    a, b = draft_alone(drafter, taps[0, :6], 5), draft_alone(drafter, taps[0, :6], 6)
    assert (a - b).abs().amax(-1).min() > 1e-4  # bidirectional: the anchor reaches all slots
    assert drafter.config.mask_token_id == TINY_MASK_TOKEN_ID


def test_batched_slots_with_different_lengths_equal_each_slot_alone(target, sequences) -> None:
    ids, taps = sequences
    drafter = make_tiny_drafter(target, num_layers=2, gamma=6)
    lengths, slots = [2, 13, 7], [4, 0, 2]
    cache = drafter.new_cache(num_slots=6, capacity=8)
    packed = torch.cat([taps[i, :n] for i, n in enumerate(lengths)])
    drafter.append_context(cache, slots, packed, lengths)
    anchors = torch.stack([ids[i, n] for i, n in enumerate(lengths)])
    batched = drafter.forward_block(cache, slots, anchors)
    for i, n in enumerate(lengths):
        torch.testing.assert_close(batched[i], draft_alone(drafter, taps[i, :n], int(anchors[i])), atol=ATOL, rtol=0)
    assert cache.lengths.tolist() == [13, 0, 7, 0, 2, 0]
    first_two = drafter.forward_block(cache, [0, 1], torch.tensor([int(ids[1, 13]), 9]))
    torch.testing.assert_close(first_two[0], batched[1], atol=ATOL, rtol=0)


def test_incremental_appends_equal_one_shot_projection(target, sequences) -> None:
    ids, taps = sequences
    drafter = make_tiny_drafter(target, num_layers=2)
    one_shot = drafter.new_cache(num_slots=2)
    drafter.append_context(one_shot, [0, 1], torch.cat((taps[0, :12], taps[1, :9])), [12, 9])
    chunked = drafter.new_cache(num_slots=2, capacity=2)  # also exercises growth
    done = [0, 0]
    for chunk0, chunk1 in [(3, 1), (1, 0), (0, 4), (6, 2), (2, 2)]:
        part = torch.cat((taps[0, done[0]: done[0] + chunk0], taps[1, done[1]: done[1] + chunk1]))
        drafter.append_context(chunked, [0, 1], part, [chunk0, chunk1])
        done = [done[0] + chunk0, done[1] + chunk1]
    assert chunked.lengths.tolist() == one_shot.lengths.tolist() == [12, 9]
    for layer in range(2):
        for slot, n in ((0, 12), (1, 9)):
            torch.testing.assert_close(chunked.keys[layer][slot, :n], one_shot.keys[layer][slot, :n], atol=1e-5, rtol=0)
            torch.testing.assert_close(chunked.values[layer][slot, :n], one_shot.values[layer][slot, :n], atol=1e-5, rtol=0)
    anchors = torch.tensor([int(ids[0, 12]), int(ids[1, 9])])
    torch.testing.assert_close(drafter.forward_block(chunked, [0, 1], anchors),
                               drafter.forward_block(one_shot, [0, 1], anchors), atol=ATOL, rtol=0)


def test_blocks_never_enter_the_cache_and_truncate_rewinds(target, sequences) -> None:
    ids, taps = sequences
    drafter = make_tiny_drafter(target)
    cache = drafter.new_cache(1)
    drafter.append_context(cache, [0], taps[0, :10], [10])
    first = drafter.forward_block(cache, [0], ids[0, 10:11])
    assert cache.lengths.tolist() == [10]
    torch.testing.assert_close(drafter.forward_block(cache, [0], ids[0, 10:11]), first, atol=0, rtol=0)
    cache.truncate([0], [4])
    drafter.append_context(cache, [0], taps[0, 4:10], [6])
    torch.testing.assert_close(drafter.forward_block(cache, [0], ids[0, 10:11]), first, atol=ATOL, rtol=0)
    cache.reset([0])
    assert cache.lengths.tolist() == [0]
    assert drafter.forward_block(cache, torch.zeros(0, dtype=torch.long), torch.zeros(0)).shape == (0, 4, 64)
    with pytest.raises(ValueError, match=r"new_lengths"):
        cache.truncate([0], [3])


def test_forward_train_equals_inference_for_each_anchor(target, sequences) -> None:
    ids, taps = sequences
    drafter = make_tiny_drafter(target, num_layers=2, gamma=5, markov_head_type="rnn")
    anchors = torch.tensor([[0, 5, 9, 15], [3, 3, 11, 14]])  # overlapping and repeated blocks
    trained = drafter.forward_train(taps[:2], ids[:2], anchors)
    assert trained.shape == (2, 4, 5, 64)
    for s in range(2):
        for n, a in enumerate(anchors[s].tolist()):
            torch.testing.assert_close(trained[s, n], draft_alone(drafter, taps[s, :a], int(ids[s, a])), atol=ATOL, rtol=0)
    unbatched = drafter.forward_train(taps[0], ids[0], anchors[0])
    torch.testing.assert_close(unbatched, trained[0], atol=ATOL, rtol=0)


def test_forward_train_trains_the_drafter_but_not_the_frozen_tensors(target, sequences) -> None:
    ids, taps = sequences
    drafter = make_tiny_drafter(target, markov_head_type="gated").train()
    hidden = drafter.forward_train(taps[0], ids[0], torch.tensor([2, 8]))
    prev = ids[0, torch.tensor([[2, 3, 4, 5], [8, 9, 10, 11]])]
    logits = drafter.base_logits(hidden) + drafter.markov_bias_block(prev, hidden)
    (logits.logsumexp(-1).sum() + drafter.confidence_logits(hidden, prev).sum()).backward()
    for name, param in drafter.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name
    assert target.lm_head.weight.grad is None and not drafter.lm_head.weight.requires_grad


def test_markov_heads_follow_the_formulas(target) -> None:
    g = torch.Generator().manual_seed(1)
    hidden, prev = torch.randn(3, 64, generator=g), torch.tensor([4, 400, 7])
    vanilla = make_tiny_drafter(target, markov_head_type="vanilla")
    w1, w2 = vanilla.markov_head.markov_w1.weight, vanilla.markov_head.markov_w2.weight
    bias, state = vanilla.markov_bias(prev, hidden)
    torch.testing.assert_close(bias, w1[prev] @ w2.T)
    assert state is None

    gated = make_tiny_drafter(target, markov_head_type="gated")
    head = gated.markov_head
    e = head.markov_w1.weight[prev]
    gate = torch.sigmoid(torch.cat((hidden, e), -1) @ head.gate_proj.weight.T + head.gate_proj.bias)
    torch.testing.assert_close(gated.markov_bias(prev, hidden)[0], (gate * e) @ head.markov_w2.weight.T)

    rnn = make_tiny_drafter(target, markov_head_type="rnn")
    head, r = rnn.markov_head, 16
    s = torch.zeros(3, r)
    hiddens, prevs = torch.randn(3, 2, 64, generator=g), torch.tensor([[1, 2], [3, 4], [5, 6]])
    expected, state = [], None
    for k in range(2):
        e = head.markov_w1.weight[prevs[:, k]]
        a, c, o = (torch.cat((s, e, hiddens[:, k]), -1) @ head.joint_proj.weight.T + head.joint_proj.bias).split(r, -1)
        expected.append(torch.tanh(o) @ head.markov_w2.weight.T)  # the output reads z_k (the old state)
        s = torch.sigmoid(a) * s + (1 - torch.sigmoid(a)) * torch.tanh(c)
        got, state = rnn.markov_bias(prevs[:, k], hiddens[:, k], state)
        torch.testing.assert_close(got, expected[-1])
    torch.testing.assert_close(rnn.markov_bias_block(prevs, hiddens), torch.stack(expected, 1))


def test_confidence_head_reads_hidden_and_previous_token(target) -> None:
    hidden, prev = torch.randn(2, 64, generator=torch.Generator().manual_seed(2)), torch.tensor([10, 20])
    drafter = make_tiny_drafter(target)
    proj, w1 = drafter.confidence_head.proj, drafter.markov_head.markov_w1.weight
    expected = (torch.cat((hidden, w1[prev]), -1) @ proj.weight.T + proj.bias).squeeze(-1)
    torch.testing.assert_close(drafter.confidence_logits(hidden, prev), expected)
    plain = make_tiny_drafter(target, confidence_with_markov=False)
    assert plain.confidence_head.proj.in_features == 64
    no_head = make_tiny_drafter(target, markov_rank=0, markov_head_type=None, confidence=False)
    assert not no_head.has_confidence_head and not no_head.has_markov_head
    assert torch.equal(no_head.markov_bias(prev, hidden)[0], torch.zeros(2, 512))
    with pytest.raises(RuntimeError, match="no confidence head"):
        no_head.confidence_logits(hidden, prev)


def test_reduced_vocabulary_uses_target_rows(target, sequences) -> None:
    ids, taps = sequences
    drafter = make_tiny_drafter(target, draft_vocab_size=128)
    assert drafter.d2t.shape == (128,) and bool((drafter.d2t[1:] > drafter.d2t[:-1]).all())
    assert drafter.markov_head.markov_w1.weight.shape == (512, 16)
    assert drafter.markov_head.markov_w2.weight.shape == (128, 16)
    hidden = draft_alone(drafter, taps[0, :5], int(ids[0, 5]))
    full = hidden @ target.lm_head.weight.T
    torch.testing.assert_close(drafter.base_logits(hidden), full[:, drafter.d2t])
    assert drafter.markov_bias(ids[0, :2], hidden[:2])[0].shape == (2, 128)


def test_bf16_drafter_tracks_fp32(target, sequences) -> None:
    ids, taps = sequences
    fp32 = make_tiny_drafter(target, num_layers=2)
    bf16 = make_tiny_drafter(target, num_layers=2, dtype=torch.bfloat16)
    assert bf16.fc.weight.dtype == torch.bfloat16
    a = fp32.base_logits(draft_alone(fp32, taps[0, :9], int(ids[0, 9])))
    b = bf16.base_logits(draft_alone(bf16, taps[0, :9], int(ids[0, 9])))
    assert b.dtype == torch.bfloat16
    torch.testing.assert_close(b.float(), a, atol=0.1, rtol=0.05)


def test_bad_inputs_get_clear_errors(target, sequences) -> None:
    ids, taps = sequences
    drafter = make_tiny_drafter(target)
    cache = drafter.new_cache(2)
    with pytest.raises(ValueError, match=r"expected m\*d = 128"):
        drafter.append_context(cache, [0], taps[0, :3, :64], [3])
    with pytest.raises(ValueError, match=r"expected \[5, m\*d\]"):
        drafter.append_context(cache, [0, 1], taps[0, :4], [2, 3])
    with pytest.raises(ValueError, match=r"out of range"):
        drafter.forward_block(cache, [2], torch.tensor([1]))
    with pytest.raises(ValueError, match=r"distinct"):
        drafter.forward_block(cache, [1, 1], torch.tensor([1, 2]))


def test_importing_the_model_package_leaves_sglang_out() -> None:
    code = "import sys, sglang_dspark.model; print('sglang' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"]


def test_a_qwen3_target_gets_a_matching_drafter() -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from sglang_dspark.model import DSparkDrafter, taps_from_hidden_states

    config = Qwen3Config(vocab_size=256, hidden_size=48, intermediate_size=96, num_hidden_layers=6,
                         num_attention_heads=6, num_key_value_heads=2, head_dim=16, rope_theta=1e6,
                         max_position_embeddings=256, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        target = Qwen3ForCausalLM(config).eval()
        drafter = DSparkDrafter.for_target(target, num_draft_layers=2, block_size=7, mask_token_id=255, markov_rank=8)
    assert drafter.target_layer_ids == (1, 3) and drafter.config.rope_theta == 1e6
    assert (drafter.config.head_dim, drafter.config.num_key_value_heads) == (16, 2)
    ids = torch.randint(0, 250, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        taps = taps_from_hidden_states(target(ids, output_hidden_states=True).hidden_states, drafter.target_layer_ids)
    got = draft_alone(drafter, taps[0, :11], int(ids[0, 11]))
    torch.testing.assert_close(got, reference_block(drafter, taps[0, :11], int(ids[0, 11])), atol=ATOL, rtol=0)


def test_a_short_draft_width_reaches_the_lm_head_as_a_contiguous_block(target, monkeypatch) -> None:
    """A step drafting w < gamma slots passes the block's first w columns, a strided view; torch's
    CPU linear took 50-57 ms on such a bf16 view (16 requests x 2 slots) against 0.3 ms on a
    contiguous one, so every drafted step of width 2-6 at batch >= 2 paid it."""
    drafter = make_tiny_drafter(target)
    block = torch.randn(3, drafter.gamma + 1, target.config.hidden_size)
    seen = []
    linear = F.linear
    monkeypatch.setattr(F, "linear", lambda x, *a, **k: seen.append(x.is_contiguous()) or linear(x, *a, **k))
    logits = drafter.base_logits(block[:, :2])
    assert seen == [True]
    torch.testing.assert_close(logits, block[:, :2].contiguous() @ drafter.lm_head.weight.T)



def test_rows_packed_run_by_run_know_their_run_and_offset_empty_runs_included():
    from sglang_dspark.model.cache import packed_rows

    run, offset = packed_rows(torch.tensor([1, 3, 0, 2, 0]))
    assert run.tolist() == [0, 1, 1, 1, 3, 3] and offset.tolist() == [0, 0, 1, 2, 0, 1]
    run, offset = packed_rows(torch.tensor([0, 0, 2]))
    assert run.tolist() == [2, 2] and offset.tolist() == [0, 1]
    assert packed_rows(torch.tensor([], dtype=torch.long))[0].numel() == 0
