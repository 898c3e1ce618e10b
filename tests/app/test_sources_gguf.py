"""Models given as GGUF files: found (file, folder, inside a package), turned once into a plain float32
checkpoint that Trainer accepts, with the tokenizer and chat template the file carries; a Hub id that
cannot be reached gives way to the recipe's fallback. A tiny GGUF file is written here: nothing is
downloaded."""

from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from otbrl.app import sources  # noqa: E402

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_tiny_llama(path: Path, seed: int = 0) -> Path:
    """A 2-layer Llama with a 43-token byte-pair vocabulary, float32 tensors and a chat template."""
    rng = np.random.default_rng(seed)
    tokens = ["<|endoftext|>", *"abcdefghijklmnopqrstuvwxyz0123456789 +=?", "ab", "cd"]
    vocab, hidden, layers, ffn = len(tokens), 16, 2, 32
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3] + [1] * (vocab - 1))
    w.add_token_merges(["a b", "c d"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_chat_template(TEMPLATE)

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    w.add_tensor("token_embd.weight", weight(vocab, hidden))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    w.add_tensor("output.weight", weight(vocab, hidden))
    shapes = {
        "attn_q": (hidden, hidden),
        "attn_k": (hidden, hidden),
        "attn_v": (hidden, hidden),
        "attn_output": (hidden, hidden),
        "ffn_gate": (ffn, hidden),
        "ffn_up": (ffn, hidden),
        "ffn_down": (hidden, ffn),
    }
    for i in range(layers):
        for name, shape in shapes.items():
            w.add_tensor(f"blk.{i}.{name}.weight", weight(*shape))
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def tiny_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("OTBRL_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    folder.mkdir()
    return write_tiny_llama(folder / "tiny.gguf")


def test_conversion_keeps_weights_tokenizer_and_template_and_drops_the_quantizer(tiny_gguf):
    from transformers import AutoTokenizer

    direct = _direct(tiny_gguf)
    direct_tok = AutoTokenizer.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    assert direct.hf_quantizer is not None  # what Trainer refuses: the reason for the conversion

    folder = sources.plain_checkpoint(tiny_gguf, log=lambda *_: None)
    assert folder.parent == Path(sources.cache_dir()) / "gguf"
    model, tokenizer = sources.load_model({"model": str(tiny_gguf)}, log=lambda *_: None)
    assert getattr(model, "hf_quantizer", None) is None
    assert "quantization_config" not in (folder / "config.json").read_text()
    assert model.dtype == torch.float32
    ours, theirs = model.state_dict(), direct.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    ids = torch.tensor([direct_tok("ab cd 12+3=?")["input_ids"]])
    assert tokenizer("ab cd 12+3=?")["input_ids"] == ids[0].tolist()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, direct(ids).logits, rtol=0, atol=0)
    assert tokenizer.chat_template == TEMPLATE
    assert tokenizer.pad_token is not None


def test_trainer_refuses_the_gguf_model_and_accepts_the_converted_one(tiny_gguf, tmp_path):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[])
    direct = _direct(tiny_gguf)
    with pytest.raises(ValueError, match="quantized"):
        Trainer(model=direct, args=args)
    model, _ = sources.load_model({"model": str(tiny_gguf.parent)}, log=lambda *_: None)  # the folder
    Trainer(model=model, args=args)


def test_conversion_happens_once(tiny_gguf, monkeypatch):
    said = []
    first = sources.plain_checkpoint(tiny_gguf, log=said.append)
    assert len(said) == 1 and "converting" in said[0]
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", _refuse)
    assert sources.plain_checkpoint(tiny_gguf, log=said.append) == first
    assert len(said) == 1
    assert not list(first.parent.glob("*.part*"))  # no half folder left


def _direct(path: Path):
    """The GGUF file loaded by transformers itself: dequantised weights, still flagged as quantized."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)


def _refuse(*args, **kwargs):
    raise AssertionError("converted again")


def test_gguf_specs_and_their_errors(tiny_gguf, tmp_path, monkeypatch):
    assert sources.gguf_file(str(tiny_gguf)) == tiny_gguf
    assert sources.gguf_file(str(tiny_gguf.parent)) == tiny_gguf
    with pytest.raises(ValueError, match="no such GGUF file"):
        sources.gguf_file(str(tmp_path / "missing.gguf"))
    (tiny_gguf.parent / "second.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="several GGUF files"):
        sources.gguf_file(str(tiny_gguf.parent))
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text("{}")
    (plain / "extra.gguf").write_bytes(b"")
    assert sources.gguf_file(str(plain)) is None  # a save_pretrained folder stays a folder
    assert sources.gguf_file("HuggingFaceTB/SmolLM2-135M-Instruct") is None


def test_a_gguf_inside_a_package_is_found_without_importing_it(tmp_path, monkeypatch):
    package = tmp_path / "site" / "shipsamodel"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('needs a dependency that is absent')\n")
    write_tiny_llama(package / "m.gguf")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert sources.gguf_file("package:shipsamodel/m.gguf") == package / "m.gguf"
    with pytest.raises(ValueError, match="has no file 'other.gguf'"):
        sources.gguf_file("package:shipsamodel/other.gguf")
    with pytest.raises(ValueError, match="'nosuchpackage' is not installed"):
        sources.gguf_file("package:nosuchpackage/m.gguf")


def test_unreachable_hub_gives_way_to_the_fallback(monkeypatch, tmp_path):
    import huggingface_hub

    recipe = {"model": "org/model", "model_fallback": "package:x/y.gguf", "model_revision": None}
    said = []
    monkeypatch.setattr(sources, "hub_reachable", lambda timeout=3.0: True)
    assert sources.choose_model(recipe, said.append) is recipe
    monkeypatch.setattr(sources, "hub_reachable", lambda timeout=3.0: False)
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *a, **k: None)
    assert sources.choose_model(recipe, said.append)["model"] == "package:x/y.gguf"
    assert "not cached" in said[-1]
    snapshot = tmp_path / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    cached = str(snapshot / "config.json")
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *a, **k: cached)
    assert sources.choose_model(recipe, said.append)["model"] == str(snapshot)
    # no fallback, or not a Hub id: nothing changes
    assert sources.choose_model({**recipe, "model_fallback": None}, said.append)["model"] == "org/model"
    assert sources.choose_model({**recipe, "model": "warm:small"}, said.append)["model"] == "warm:small"


def test_offline_means_unreachable_without_a_connection(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("socket.create_connection", _refuse)
    assert sources.hub_reachable() is False
