"""The model's identity (engine/identity.py): the content of the weights, never where they sit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.identity import DIGEST_FILE, kv_config, model_identity, parameters_digest, weights_digest
from scheduler.prefix import chunk_keys, make_fingerprint


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()


def save(model: LlamaForCausalLM, directory: Path) -> Path:
    model.save_pretrained(directory)
    return directory


def load(directory: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def root(model: torch.nn.Module, directory: Path, cache: Path) -> str:
    ident = model_identity(model, {"a": 0, "b": 1}, directory, cache)
    fp = make_fingerprint(
        weights=ident.weights,
        config=ident.config,
        dtype=ident.dtype,
        vocabulary=ident.vocabulary,
        chunk_size=4,
    )
    return chunk_keys(fp, list(range(8)), 4)[0]


def test_a_moved_or_copied_model_keeps_every_key(tmp_path):
    a = save(tiny_model(), tmp_path / "a")
    key_a = root(load(a), a, tmp_path / "cache")
    moved = tmp_path / "elsewhere" / "b"
    moved.parent.mkdir()
    shutil.move(a, moved)
    assert root(load(moved), moved, tmp_path / "cache") == key_a
    copied = tmp_path / "copy"
    shutil.copytree(moved, copied, copy_function=shutil.copy)  # new modification times
    assert root(load(copied), copied, tmp_path / "cache2") == key_a


def test_other_weights_never_share_a_key(tmp_path):
    a = save(tiny_model(0), tmp_path / "a")
    b_model = tiny_model(0)
    with torch.no_grad():
        b_model.model.layers[1].mlp.down_proj.weight[3, 7] += 1e-3  # one value of one tensor
    b = save(b_model, tmp_path / "b")
    assert root(load(a), a, tmp_path / "c") != root(load(b), b, tmp_path / "c")


def test_dtype_is_part_of_the_identity(tmp_path):
    a = save(tiny_model(), tmp_path / "a")
    fp32 = model_identity(load(a), {}, a, tmp_path / "c")
    bf16 = model_identity(LlamaForCausalLM.from_pretrained(a, dtype=torch.bfloat16), {}, a, tmp_path / "c")
    assert fp32.dtype != bf16.dtype and fp32.weights != bf16.weights


def test_bf16_weights_are_another_identity_and_never_reuse_the_float32_digest(tmp_path):
    from engine.bf16_weights import use_bf16_weights

    a = save(tiny_model(), tmp_path / "a")
    fp32 = model_identity(load(a), {}, a, tmp_path / "c")  # caches the float32 digest beside the files
    mixed = load(a)
    use_bf16_weights(mixed)
    first = model_identity(mixed, {}, a, tmp_path / "c", precision="torch.float32+bf16-weights")
    assert first.dtype == "torch.float32+bf16-weights" != fp32.dtype
    assert first.weights != fp32.weights  # hashed at its own precision, not read from the cache
    (a / DIGEST_FILE).unlink()
    fresh = model_identity(mixed, {}, a, tmp_path / "other", precision="torch.float32+bf16-weights")
    assert fresh == first  # a replica that starts fresh derives the same keys


def test_config_drops_paths_and_bookkeeping_but_keeps_the_architecture(tmp_path):
    model = tiny_model()
    config = model.config.to_dict()
    config["_name_or_path"] = "/some/absolute/path"
    kept = kv_config(config)
    assert "_name_or_path" not in kept and "transformers_version" not in kept
    assert kept["num_key_value_heads"] == 2 and kept["hidden_size"] == 32


def test_tied_weights_hash_alike_whichever_name_the_file_stores(tmp_path):
    model = tiny_model()
    plain = save(model, tmp_path / "plain")
    aliased = tmp_path / "aliased"
    shutil.copytree(plain, aliased)
    # the tied embedding stored only under lm_head.weight, as the old default-model conversion did
    safetensors.torch.save_model(model, str(aliased / "model.safetensors"))
    assert parameters_digest(load(plain).named_parameters()) == parameters_digest(
        load(aliased).named_parameters()
    )


def test_the_digest_is_cached_beside_the_files_and_checked_against_them(tmp_path, monkeypatch):
    a = save(tiny_model(), tmp_path / "a")
    model = load(a)
    first = weights_digest(model, a, tmp_path / "cache")
    record = json.loads((a / DIGEST_FILE).read_text())
    assert record["digest"] == first

    calls = []
    monkeypatch.setattr(
        "engine.identity.parameters_digest", lambda params: calls.append(1) or "0" * 64
    )
    assert weights_digest(model, a, tmp_path / "cache") == first and not calls  # read from the cache
    (a / "model.safetensors").write_bytes((a / "model.safetensors").read_bytes())  # touched
    assert weights_digest(model, a, tmp_path / "cache") == "0" * 64 and calls  # hashed again


def test_an_unwritable_model_directory_caches_in_the_cache_dir(tmp_path):
    a = save(tiny_model(), tmp_path / "a")
    model = load(a)
    (a / DIGEST_FILE).mkdir()  # the file cannot be written there (a read-only mount, for root too)
    digest = weights_digest(model, a, tmp_path / "cache")
    assert digest == parameters_digest(model.named_parameters())
    (cached,) = (tmp_path / "cache" / "weight-digests").glob("*.json")
    assert json.loads(cached.read_text())["digest"] == digest


@pytest.mark.parametrize("forged", ["not json", json.dumps({"digest": "../../etc"}), json.dumps([1])])
def test_a_bad_cache_file_is_ignored(tmp_path, forged):
    a = save(tiny_model(), tmp_path / "a")
    model = load(a)
    (a / DIGEST_FILE).write_text(forged)
    assert weights_digest(model, a, None) == parameters_digest(model.named_parameters())
