"""The trainer lowers its loss on a tiny target, resumes from its checkpoint, and ships bf16."""

import json

import pytest
import torch

from sglang_dspark.model import load_drafter
from sglang_dspark.training.target_cache import cache_in_memory
from sglang_dspark.training.trainer import (
    DrafterSpec, TrainSettings, draft_vocabulary, lr_at, target_to_draft, train_drafters,
)
from tests.tiny import TINY_LAYER_IDS, TINY_MASK_TOKEN_ID, make_tiny_target

# A peaked random target: its next-token distributions are far from the untrained drafter's.
PEAKED_INIT_STD = 0.5


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _tiny_setup(tmp_path, num_seqs: int = 24):
    """A tiny target saved as a folder, and a cache of its own greedy continuations."""
    target = make_tiny_target(seed=0, initializer_range=PEAKED_INIT_STD)
    target_dir = tmp_path / "target"
    target.save_pretrained(target_dir)
    generator = torch.Generator().manual_seed(0)
    records = []
    for index in range(num_seqs):
        prompt = torch.randint(3, 400, (8,), generator=generator).tolist()
        with torch.no_grad():
            out = target.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False,
                                  pad_token_id=0, eos_token_id=None)
        records.append({"id": f"s{index}", "domain": "chat", "prompt_ids": prompt,
                        "response_ids": out[0, len(prompt):].tolist()})
    cache = cache_in_memory(target.to(torch.bfloat16), records, list(TINY_LAYER_IDS), top_k=16)
    return target_dir, cache


def _settings(steps: int) -> TrainSettings:
    return TrainSettings(layers=1, block_size=4, draft_vocab_size=384, mask_token_id=TINY_MASK_TOKEN_ID,
                         anchors_per_seq=16, seqs_per_step=4, steps=steps, lr=1e-2, seed=0,
                         checkpoint_every=1000, eval_every=steps, holdout_fraction=0.2)


def test_loss_falls_and_both_drafters_ship(tmp_path):
    target_dir, cache = _tiny_setup(tmp_path)
    specs = [DrafterSpec(out=str(tmp_path / "dspark"), markov_rank=16),
             DrafterSpec(out=str(tmp_path / "dflash"), markov_rank=0, confidence_head=False)]
    summary = train_drafters(cache, target_dir, specs, _settings(80), progress=False)
    assert summary["step"] == 80
    for spec in specs:
        log = [json.loads(line) for line in open(f"{spec.out}/train_log.jsonl")]
        drafter = load_drafter(spec.out, target=make_tiny_target(seed=0, initializer_range=PEAKED_INIT_STD))
        assert drafter.dtype == torch.bfloat16 and drafter.config.draft_vocab_size == 384
        assert log[-1]["holdout_tau_t1"] > 1.0
    first = _first_step_loss(tmp_path, cache, target_dir)
    final = json.loads(open(f"{specs[0].out}/train_log.jsonl").readlines()[-1])["holdout_loss"]
    assert final < 0.85 * first, (first, final)


def test_mixed_precision_training_lowers_the_loss_as_well(tmp_path):
    """`--autocast bf16` (the default on a CPU with AMX): fp32 weights and optimizer, bf16 matmuls."""
    target_dir, cache = _tiny_setup(tmp_path)
    settings = _settings(80)
    settings.bf16_autocast = True
    spec = DrafterSpec(out=str(tmp_path / "mixed"), markov_rank=16)
    train_drafters(cache, target_dir, [spec], settings, progress=False)
    final = json.loads(open(f"{spec.out}/train_log.jsonl").readlines()[-1])["holdout_loss"]
    assert final < 0.85 * _first_step_loss(tmp_path, cache, target_dir)


def _first_step_loss(tmp_path, cache, target_dir) -> float:
    """Holdout loss of the untrained drafter (one eval at step 1 of a fresh run)."""
    settings = _settings(1)
    settings.eval_every = 1
    spec = DrafterSpec(out=str(tmp_path / "fresh"), markov_rank=16)
    train_drafters(cache, target_dir, [spec], settings, progress=False)
    return json.loads(open(f"{spec.out}/train_log.jsonl").readline())["holdout_loss"]


def test_resume_continues_to_the_same_weights(tmp_path):
    target_dir, cache = _tiny_setup(tmp_path, num_seqs=16)
    straight = DrafterSpec(out=str(tmp_path / "straight"), markov_rank=8)
    train_drafters(cache, target_dir, [straight], _settings(10), progress=False)
    split = DrafterSpec(out=str(tmp_path / "split"), markov_rank=8)
    train_drafters(cache, target_dir, [split], _settings(10), time_budget_s=0.0, progress=False)
    assert json.loads(open(f"{split.out}/training.json").read())["steps_done"] == 0
    train_drafters(cache, target_dir, [split], _settings(10), stop_at=6, progress=False)
    assert json.loads(open(f"{split.out}/training.json").read())["steps_done"] == 6
    train_drafters(cache, target_dir, [split], _settings(10), progress=False)
    a = load_drafter(straight.out, target=make_tiny_target(seed=0, initializer_range=PEAKED_INIT_STD)).state_dict()
    b = load_drafter(split.out, target=make_tiny_target(seed=0, initializer_range=PEAKED_INIT_STD)).state_dict()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_draft_vocabulary_keeps_frequent_tokens_and_eos(tmp_path):
    _, cache = _tiny_setup(tmp_path, num_seqs=8)
    d2t = draft_vocabulary(cache, 32, always=[2])
    assert len(d2t) == 32 and 2 in d2t.tolist() and bool((d2t[1:] > d2t[:-1]).all())
    response_tokens = cache.input_ids[cache.loss_mask].long()
    most_common = torch.bincount(response_tokens).argmax()
    assert most_common in d2t
    t2d = target_to_draft(d2t, 512)
    assert torch.equal(d2t[t2d[d2t]], d2t) and int((t2d >= 0).sum()) == 32


def test_the_soft_cross_entropy_term_pulls_the_drafter_towards_the_target(tmp_path):
    target_dir, cache = _tiny_setup(tmp_path)
    settings = _settings(40)
    settings.kl_alpha, settings.eval_every = 1.0, 20
    spec = DrafterSpec(out=str(tmp_path / "kl"), markov_rank=8)
    train_drafters(cache, target_dir, [spec], settings, progress=False)
    log = [json.loads(line) for line in open(f"{spec.out}/train_log.jsonl")]
    soft_ce = [row["holdout_soft_ce"] for row in log if "holdout_soft_ce" in row]
    assert len(soft_ce) == 2 and soft_ce[-1] < soft_ce[0], soft_ce


def _holdout_loss_at_first_step(spec: DrafterSpec, cache, target_dir, layers: int) -> float:
    settings = _settings(1)
    settings.layers, settings.eval_every, settings.lr = layers, 1, 0.0
    train_drafters(cache, target_dir, [spec], settings, progress=False)
    return json.loads(open(f"{spec.out}/train_log.jsonl").readline())["holdout_loss"]


def _trained_rank8_source(tmp_path):
    """A 1-layer rank-8 drafter trained 20 steps: the cache, target, its checkpoint, and the
    holdout loss a run started from it has at step 0 with the same shape."""
    target_dir, cache = _tiny_setup(tmp_path)
    source = DrafterSpec(out=str(tmp_path / "one-layer"), markov_rank=8)
    train_drafters(cache, target_dir, [source], _settings(20), progress=False)
    checkpoint = f"{source.out}/checkpoint"
    kept = _holdout_loss_at_first_step(DrafterSpec(out=str(tmp_path / "same"), markov_rank=8,
                                                   init_from=checkpoint), cache, target_dir, layers=1)
    return target_dir, cache, source, checkpoint, kept


def test_a_grown_drafter_starts_where_its_source_stopped(tmp_path):
    target_dir, cache, source, checkpoint, kept = _trained_rank8_source(tmp_path)
    grown = _holdout_loss_at_first_step(DrafterSpec(out=str(tmp_path / "grown"), markov_rank=8,
                                                    init_from=checkpoint), cache, target_dir, layers=2)
    fresh = _holdout_loss_at_first_step(DrafterSpec(out=str(tmp_path / "fresh2"), markov_rank=8),
                                        cache, target_dir, layers=2)
    assert grown == pytest.approx(kept, rel=1e-5) and grown < 0.9 * fresh, (kept, grown, fresh)
    shipped = load_drafter(f"{tmp_path}/grown", target=make_tiny_target(seed=0, initializer_range=PEAKED_INIT_STD))
    source_d2t = load_drafter(source.out, target=make_tiny_target(seed=0, initializer_range=PEAKED_INIT_STD)).d2t
    assert shipped.config.num_hidden_layers == 2 and torch.equal(shipped.d2t, source_d2t)


def test_a_wider_markov_head_starts_where_its_source_stopped_and_then_learns(tmp_path):
    """Rank 8 -> 16: the same holdout loss at step 0 (new W2 and confidence columns are zero), and
    the new columns move once trained."""
    target_dir, cache, _, checkpoint, kept = _trained_rank8_source(tmp_path)
    wide = _holdout_loss_at_first_step(DrafterSpec(out=str(tmp_path / "wide"), markov_rank=16,
                                                   init_from=checkpoint), cache, target_dir, layers=1)
    assert wide == pytest.approx(kept, rel=1e-5), (kept, wide)
    trained = DrafterSpec(out=str(tmp_path / "wide-trained"), markov_rank=16, init_from=checkpoint)
    train_drafters(cache, target_dir, [trained], _settings(5), progress=False)
    drafter = load_drafter(trained.out, target=make_tiny_target(seed=0, initializer_range=PEAKED_INIT_STD))
    assert drafter.markov_head.rank == 16
    assert float(drafter.markov_head.markov_w2.weight.detach()[:, 8:].abs().sum()) > 0, "the new rank never learnt"


def test_growing_refuses_a_source_with_other_heads(tmp_path):
    target_dir, cache = _tiny_setup(tmp_path, num_seqs=8)
    source = DrafterSpec(out=str(tmp_path / "rank8"), markov_rank=8)
    train_drafters(cache, target_dir, [source], _settings(2), progress=False)
    other = DrafterSpec(out=str(tmp_path / "rank4"), markov_rank=4, init_from=f"{source.out}/checkpoint")
    with pytest.raises(ValueError, match="another shape"):
        train_drafters(cache, target_dir, [other], _settings(2), progress=False)


def test_a_reselected_vocabulary_keeps_the_shared_tokens_markov_rows(tmp_path):
    target_dir, cache = _tiny_setup(tmp_path, num_seqs=8)
    source = DrafterSpec(out=str(tmp_path / "narrow"), markov_rank=8)
    narrow = _settings(3)
    narrow.draft_vocab_size = 128
    train_drafters(cache, target_dir, [source], narrow, progress=False)
    wide = _settings(3)
    wide.draft_vocab_size, wide.reselect_vocab = 256, True
    moved = DrafterSpec(out=str(tmp_path / "wide"), markov_rank=8, init_from=source.out)
    train_drafters(cache, target_dir, [moved], wide, stop_at=0, progress=False)  # ship the start point

    def load(folder):
        return load_drafter(folder, target=make_tiny_target(seed=0, initializer_range=PEAKED_INIT_STD))

    before, after = load(source.out), load(moved.out)
    assert len(before.d2t) == 128 and len(after.d2t) == 256
    # the same cache ranks the tokens the same way: the 128 most frequent are among the 256
    assert set(before.d2t.tolist()) < set(after.d2t.tolist())
    rows_before = before.markov_head.markov_w2.weight
    rows_after = after.markov_head.markov_w2.weight
    position = {int(t): i for i, t in enumerate(before.d2t)}
    shared = [(i, position[int(t)]) for i, t in enumerate(after.d2t) if int(t) in position]
    new = [i for i, t in enumerate(after.d2t) if int(t) not in position]
    assert shared and new
    assert torch.equal(rows_after[[i for i, _ in shared]], rows_before[[j for _, j in shared]])
    assert not rows_after[new].any()


def test_a_time_schedule_anneals_the_learning_rate_and_ends_the_run(tmp_path):
    settings = _settings(1000)
    assert lr_at(500, settings, time_fraction=0.0) > 0.4 * settings.lr  # halfway by steps
    assert lr_at(500, settings, time_fraction=0.99) < 1e-3 * settings.lr  # the clock is further on
    target_dir, cache = _tiny_setup(tmp_path, num_seqs=12)
    specs = [DrafterSpec(out=str(tmp_path / "dspark"), markov_rank=16)]
    summary = train_drafters(cache, target_dir, specs, settings, progress=False, schedule_seconds=3.0)
    assert 0 < summary["step"] < 1000  # ended by the clock, not by the step count
    log = [json.loads(line) for line in open(tmp_path / "dspark" / "train_log.jsonl")]
    assert log[-1]["step"] == summary["step"]  # the run's end is evaluated even off the eval grid


def _shipped_and_run(tmp_path):
    """A 'shipped' drafter folder with a cost model and stale calibrations, and a run grown from it."""
    from sglang_dspark.calibration.sts import StsCalibration

    target_dir, cache = _tiny_setup(tmp_path, num_seqs=12)
    shipped = DrafterSpec(out=str(tmp_path / "shipped"), markov_rank=8)
    train_drafters(cache, target_dir, [shipped], _settings(6), progress=False)
    for name in ("sts.json", "sts-greedy.json"):
        StsCalibration.identity(4).save(tmp_path / "shipped" / name)
    (tmp_path / "shipped" / "sps.json").write_text('{"kept": true}\n')
    run = DrafterSpec(out=str(tmp_path / "run"), markov_rank=8, init_from=shipped.out)
    settings = _settings(4)
    settings.seed = 1
    train_drafters(cache, target_dir, [run], settings, progress=False)
    return tmp_path / "shipped", tmp_path / "run"


def _ship(shipped, run, *extra):
    from typer.testing import CliRunner

    from dspark_ctl.cli import app

    return CliRunner().invoke(app, ["ship", "--run", str(run), "--into", str(shipped),
                                    "--note", "test run", *extra])


def test_ship_puts_a_run_over_the_folder_it_grew_from_and_keeps_the_history(tmp_path):
    from sglang_dspark.calibration.sts import StsCalibration

    shipped, run = _shipped_and_run(tmp_path)
    old_record = (shipped / "training.json").read_text()
    old_log = (shipped / "train_log.jsonl").read_text().splitlines()
    refused = _ship(shipped, run)
    assert refused.exit_code == 2 and "sts.json, sts-greedy.json" in refused.output
    assert (shipped / "training.json").read_text() == old_record  # nothing changed
    fitted = StsCalibration.identity(4)
    fitted.temperatures[0] = 2.0
    for name in ("sts.json", "sts-greedy.json"):
        fitted.save(run / name)

    result = _ship(shipped, run)
    assert result.exit_code == 0, result.output
    assert (shipped / "model.safetensors").read_bytes() == (run / "model.safetensors").read_bytes()
    assert (shipped / "training_run1.json").read_text() == old_record
    assert json.loads((shipped / "training.json").read_text())["seed"] == 1
    assert StsCalibration.load(shipped / "sts.json").temperatures[0] == 2.0  # the run's, not the stale one
    assert (shipped / "sps.json").read_text() == '{"kept": true}\n'
    log = [json.loads(line) for line in (shipped / "train_log.jsonl").read_text().splitlines()]
    assert [row["step"] for row in log] == [6, 10] and log[-1]["run"] == "test run"
    assert log[-1]["train_seconds"] >= log[0]["train_seconds"]
    assert len(log) == len(old_log) + 1 and not list(tmp_path.glob("shipped.*"))


def test_ship_refuses_a_run_that_grew_from_other_weights(tmp_path):
    shipped, run = _shipped_and_run(tmp_path)
    for name in ("sts.json", "sts-greedy.json"):
        (run / name).write_bytes((shipped / name).read_bytes())
    other = tmp_path / "other"
    other.mkdir()
    for path in shipped.iterdir():
        if path.is_file():
            (other / path.name).write_bytes(path.read_bytes())
    (other / "model.safetensors").write_bytes(b"other weights")
    result = _ship(other, run)
    assert result.exit_code == 2 and "did not start from the weights" in result.output
    assert (other / "model.safetensors").read_bytes() == b"other weights"


def test_train_cli_ends_an_annealed_run_on_its_minute_schedule(tmp_path):
    from typer.testing import CliRunner

    from dspark_ctl.cli import app
    from sglang_dspark.training.target_cache import build_target_cache

    target = make_tiny_target(seed=0, initializer_range=PEAKED_INIT_STD)
    target.save_pretrained(tmp_path / "target")
    generator = torch.Generator().manual_seed(0)
    records = [{"id": f"r{i}", "domain": "math", "prompt_ids": torch.randint(3, 400, (6,), generator=generator).tolist(),
                "response_ids": torch.randint(3, 400, (30,), generator=generator).tolist()} for i in range(12)]
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    build_target_cache(str(tmp_path / "target"), tmp_path / "records.jsonl", tmp_path / "cache",
                       list(TINY_LAYER_IDS), top_k=8)
    common = ["train", "--target", str(tmp_path / "target"), "--cache", str(tmp_path / "cache"),
              "--out", str(tmp_path / "run"), "--markov-rank", "8", "--block-size", "4", "--draft-vocab", "256",
              "--anchors", "8", "--steps", "100000", "--eval-every", "100000", "--threads", "1", "--json"]
    refused = CliRunner().invoke(app, [*common, "--schedule-min", "0.05", "--time-budget-min", "1"])
    assert refused.exit_code == 2 and "give one of them" in refused.output
    result = CliRunner().invoke(app, [*common, "--schedule-min", "0.05"])
    assert result.exit_code == 0, result.output
    steps = json.loads((tmp_path / "run" / "training.json").read_text())["steps_done"]
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert 0 < steps < 100000 and log[-1]["step"] == steps
