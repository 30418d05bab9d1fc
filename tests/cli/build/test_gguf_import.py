"""rlpipe import-gguf on a tiny llama GGUF written here with the gguf package (no download, seconds).

The file is built the way llama.cpp's converter builds one: Q4_1 weight matrices, F32 norms,
q/k rows permuted into GGML's rotary layout, a byte-level BPE vocabulary with control tokens
and a chat template. transformers reads it back through ``from_pretrained(gguf_file=...)``.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode
from typer.testing import CliRunner

from services.cli.app import app
from services.cli.build import gguf_import
from services.cli.build.gguf_import import (
    IMPORT_MARKER,
    GGUFImportError,
    check_gguf,
    import_gguf,
    load_gguf,
    probe_ids,
)

pytestmark = pytest.mark.unit

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "Ġ a", "h e", "Ġt he"]
HEADS, KV_HEADS, HIDDEN, FFN, LAYERS = 4, 2, 64, 128, 2


def _vocab() -> list[str]:
    # Specials first (ids 0-2, as in SmolLM2), then the 256 byte symbols, then one token per merge.
    return [*SPECIALS, *bytes_to_unicode().values(), *(merge.replace(" ", "") for merge in MERGES)]


def _to_ggml_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp stores q/k rows with each head's two rotary halves interleaved; transformers undoes it on load."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_llama_gguf(path: Path, seed: int = 0, pad: bool = True) -> LlamaForCausalLM:
    """A 2-layer llama in GGUF; returns the float model its weights came from. ``pad``: the file names a pad
    token (the EOS, as SmolLM2's does)."""
    vocab = _vocab()
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    source = LlamaForCausalLM(config).eval()
    state = {name: tensor.numpy() for name, tensor in source.state_dict().items()}

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny test llama")
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_block_count(LAYERS)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(vocab))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocab)
    writer.add_token_types([gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * (len(vocab) - 3))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if pad:
        writer.add_pad_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)

    def matrix(name: str, w: np.ndarray) -> None:
        writer.add_tensor(
            name, gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1), raw_dtype=gguf.GGMLQuantizationType.Q4_1
        )

    matrix("token_embd.weight", state["model.embed_tokens.weight"])
    for i in range(LAYERS):
        hf = f"model.layers.{i}."
        writer.add_tensor(f"blk.{i}.attn_norm.weight", state[hf + "input_layernorm.weight"])
        matrix(f"blk.{i}.attn_q.weight", _to_ggml_rotary(state[hf + "self_attn.q_proj.weight"], HEADS))
        matrix(f"blk.{i}.attn_k.weight", _to_ggml_rotary(state[hf + "self_attn.k_proj.weight"], KV_HEADS))
        matrix(f"blk.{i}.attn_v.weight", state[hf + "self_attn.v_proj.weight"])
        matrix(f"blk.{i}.attn_output.weight", state[hf + "self_attn.o_proj.weight"])
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", state[hf + "post_attention_layernorm.weight"])
        matrix(f"blk.{i}.ffn_gate.weight", state[hf + "mlp.gate_proj.weight"])
        matrix(f"blk.{i}.ffn_up.weight", state[hf + "mlp.up_proj.weight"])
        matrix(f"blk.{i}.ffn_down.weight", state[hf + "mlp.down_proj.weight"])
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return source


def write_metadata_only_gguf(path: Path, architecture: str) -> None:
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("no such model")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LlamaForCausalLM]:
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.Q4_1.gguf"
    return path, write_tiny_llama_gguf(path)


@pytest.fixture(scope="module")
def imported(tiny_gguf: tuple[Path, LlamaForCausalLM], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("models") / "tiny-llama"
    import_gguf(tiny_gguf[0], out)
    return out


@pytest.mark.integration
def test_the_saved_folder_loads_with_plain_from_pretrained_and_gives_the_gguf_models_logits(
    tiny_gguf: tuple[Path, LlamaForCausalLM], imported: Path
) -> None:
    gguf_model, gguf_tokenizer = load_gguf(tiny_gguf[0])
    saved = AutoModelForCausalLM.from_pretrained(str(imported)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(imported))

    assert type(saved) is LlamaForCausalLM
    assert "quantization_config" not in json.loads((imported / "config.json").read_text())
    assert getattr(saved, "hf_quantizer", None) is None
    ids = probe_ids(tokenizer)
    assert ids == probe_ids(gguf_tokenizer)
    with torch.inference_mode():
        expected = gguf_model(input_ids=torch.tensor([ids])).logits
        got = saved(input_ids=torch.tensor([ids])).logits
    assert torch.equal(got, expected)


def test_an_import_parses_the_gguf_file_once_and_leaves_the_reader_class_as_it_was(
    tiny_gguf: tuple[Path, LlamaForCausalLM], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parsed = []
    parse = gguf.GGUFReader

    def counted(path, mode="r"):
        parsed.append(Path(path))
        return parse(path, mode)

    monkeypatch.setattr(gguf, "GGUFReader", counted)
    import_gguf(tiny_gguf[0], tmp_path / "imported")

    assert parsed == [tiny_gguf[0]]  # metadata check, config, weights and tokenizer: one parse
    assert gguf.GGUFReader is counted


@pytest.mark.integration
def test_the_gguf_weights_are_the_source_models_up_to_q4_1_rounding(
    tiny_gguf: tuple[Path, LlamaForCausalLM], imported: Path
) -> None:
    """Guards the test's own writer: the rotary permutation must round-trip, else logits would match garbage."""
    source = tiny_gguf[1].state_dict()
    saved = AutoModelForCausalLM.from_pretrained(str(imported)).state_dict()
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"):
        step = (source[name].amax(dim=1) - source[name].amin(dim=1)).max() / 15  # Q4_1: 16 levels per block
        assert (saved[name] - source[name]).abs().max() <= step
    assert torch.equal(saved["model.norm.weight"], source["model.norm.weight"])  # F32 tensors are exact


@pytest.mark.integration
def test_tokenizer_special_tokens_and_chat_template_survive(imported: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(imported))
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )
    assert tokenizer.eos_token_id == 2
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi the"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhi the<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    # Control tokens stay whole; " the" is one merged token (the vocabulary's last).
    assert ids[0] == 1 and ids.count(2) == 1 and len(_vocab()) - 1 in ids


@pytest.mark.integration
def test_a_gguf_file_without_a_pad_token_imports_with_its_eos_as_the_pad_everywhere_the_folder_names_it(tmp_path):
    source = tmp_path / "padless.gguf"
    write_tiny_llama_gguf(source, pad=False)
    assert load_gguf(source)[1].pad_token is None  # what this transformers version makes of such a file

    out = tmp_path / "imported"
    import_gguf(source, out)

    tokenizer = AutoTokenizer.from_pretrained(str(out))
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|im_end|>", 2)
    assert json.loads((out / "config.json").read_text())["pad_token_id"] == 2
    assert json.loads((out / "generation_config.json").read_text())["pad_token_id"] == 2


@pytest.mark.integration
def test_special_tokens_transformers_misreads_are_taken_from_the_file_and_named_in_the_summary(
    tiny_gguf: tuple[Path, LlamaForCausalLM], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers 5.17 (the GPU image's) reads a GPT-2-style GGUF vocabulary's BOS as its EOS too and no pad;
    planted here on the version under test, so the folder must still end sequences at the file's EOS."""
    load = gguf_import.load_gguf

    def misread(path: Path, dtype: str = "float32"):
        model, tokenizer = load(path, dtype)
        tokenizer.eos_token = tokenizer.bos_token
        tokenizer.pad_token = None
        return model, tokenizer

    monkeypatch.setattr(gguf_import, "load_gguf", misread)
    summary = import_gguf(tiny_gguf[0], tmp_path / "imported")

    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "imported"))
    assert (tokenizer.eos_token, tokenizer.eos_token_id, tokenizer.pad_token) == ("<|im_end|>", 2, "<|im_end|>")
    config = json.loads((tmp_path / "imported" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2)
    assert summary.special_tokens_corrected == {
        "eos_token": "'<|im_start|>' -> '<|im_end|>'",
        "pad_token": "None -> '<|im_end|>'",
    }


def test_the_summary_is_recorded_last_in_the_folder(tiny_gguf: tuple[Path, LlamaForCausalLM], imported: Path) -> None:
    summary = json.loads((imported / IMPORT_MARKER).read_text())
    assert summary["architecture"] == "llama"
    assert summary["model_class"] == "LlamaForCausalLM"
    assert summary["parameters"] == sum(p.numel() for p in tiny_gguf[1].parameters())
    assert summary["max_logit_diff"] == 0.0
    assert summary["source"] == "tiny-llama.Q4_1.gguf"
    assert not imported.with_name(imported.name + ".importing").exists()


def test_an_existing_folder_is_kept_unless_overwrite(tiny_gguf: tuple[Path, LlamaForCausalLM], tmp_path: Path) -> None:
    out = tmp_path / "model"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(GGUFImportError, match="already exists"):
        import_gguf(tiny_gguf[0], out)
    assert (out / "keep.txt").read_text() == "mine"
    import_gguf(tiny_gguf[0], out, overwrite=True, verify=False)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()


def test_an_unsupported_architecture_is_named_with_the_supported_ones(tmp_path: Path) -> None:
    path = tmp_path / "odd.gguf"
    write_metadata_only_gguf(path, "rwkv7")
    with pytest.raises(GGUFImportError) as caught:
        check_gguf(path)
    message = str(caught.value)
    assert "GGUF architecture 'rwkv7' is not supported" in message
    assert "supported architectures: " in message and "llama" in message and "qwen2" in message
    assert "general" not in message.split("supported architectures: ")[1].split(", ")


def test_an_encoder_decoder_architecture_is_refused_as_not_a_causal_lm(tmp_path: Path) -> None:
    path = tmp_path / "t5.gguf"
    write_metadata_only_gguf(path, "t5")
    with pytest.raises(GGUFImportError, match="'t5' loads as a 't5' model, which is not a causal LM"):
        check_gguf(path)


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(GGUFImportError, match="not a readable GGUF file"):
        check_gguf(path)


def test_the_cli_imports_and_reports_errors_with_exit_2(
    tiny_gguf: tuple[Path, LlamaForCausalLM], tmp_path: Path
) -> None:
    runner = CliRunner()
    done = runner.invoke(app, ["import-gguf", str(tiny_gguf[0]), str(tmp_path / "out")])
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout.strip().splitlines()[-1])["architecture"] == "llama"
    odd = tmp_path / "odd.gguf"
    write_metadata_only_gguf(odd, "rwkv7")
    failed = runner.invoke(app, ["import-gguf", str(odd), str(tmp_path / "odd")])
    assert failed.exit_code == 2
    assert "rlpipe import-gguf:" in failed.stderr and "'rwkv7' is not supported" in failed.stderr
    assert not (tmp_path / "odd").exists()
