"""A target cache built on disk, in several shards and folders, reads back as the in-memory one."""

import json

import pytest
import torch

from sglang_dspark.training.target_cache import (
    TapShards, build_target_cache, cache_in_memory, load_target_caches,
)
from tests.tiny import TINY_LAYER_IDS, make_tiny_target

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _records(prefix: str, count: int, generator: torch.Generator) -> list[dict]:
    return [{"id": f"{prefix}{i}", "domain": "math",
             "prompt_ids": torch.randint(3, 400, (6,), generator=generator).tolist(),
             "response_ids": torch.randint(3, 400, (10 + 3 * i,), generator=generator).tolist()}
            for i in range(count)]


def test_sharded_disk_caches_read_back_as_one_in_memory_cache(tmp_path):
    target = make_tiny_target(seed=0)
    target.save_pretrained(tmp_path / "target")
    generator = torch.Generator().manual_seed(0)
    halves = [_records("a", 5, generator), _records("b", 4, generator)]
    folders = []
    for half, records in zip("ab", halves):
        responses = tmp_path / f"{half}.jsonl"
        responses.write_text("".join(json.dumps(r) + "\n" for r in records))
        folders.append(tmp_path / f"cache-{half}")
        # tiny shards and batches: every folder holds several shards
        build_target_cache(str(tmp_path / "target"), responses, folders[-1], list(TINY_LAYER_IDS),
                           top_k=8, tokens_per_batch=40, shard_tokens=40)
    assert all(len(json.loads((f / "index.json").read_text())["shards"]) > 1 for f in folders)

    loaded = load_target_caches(folders)
    reference = cache_in_memory(target.eval(), halves[0] + halves[1], list(TINY_LAYER_IDS), top_k=8)
    order = {rid: i for i, rid in enumerate(reference.ids)}
    assert sorted(loaded.ids) == sorted(reference.ids)
    assert isinstance(loaded.taps, TapShards) and len(loaded.taps.parts) > 2
    assert loaded.taps.shape == reference.taps.shape
    for index, rid in enumerate(loaded.ids):
        got, want = loaded.sequence(index), reference.sequence(order[rid])
        assert torch.equal(got["input_ids"], want["input_ids"])
        assert torch.equal(got["topk_ids"], want["topk_ids"])
        torch.testing.assert_close(got["taps"].float(), want["taps"].float(), atol=0.02, rtol=0.02)


def test_tap_shards_refuse_a_slice_across_two_shards():
    shards = TapShards([torch.zeros(3, 2), torch.ones(4, 2)])
    assert torch.equal(shards[3:7], torch.ones(4, 2))
    assert shards.shape == (7, 2)
    with pytest.raises(IndexError, match="straddle"):
        shards[2:5]
