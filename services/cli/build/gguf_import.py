"""Import a GGUF checkpoint (llama.cpp's one-file format) as a Hugging Face model folder.

transformers reads a GGUF file through ``from_pretrained(folder, gguf_file=name)`` (with the
``gguf`` package installed): it dequantizes every tensor into an ordinary causal LM and builds
the tokenizer, special tokens and chat template from the file's metadata. The model it returns
is still marked GGUF-quantized, and ``save_pretrained`` refuses it, so the import rebuilds a
plain model from its config and state dict and saves that, with the tokenizer and generation
config. The special tokens are the file's own (``with_file_special_tokens``: transformers 5.17 reads a
GPT-2-style vocabulary's BOS as its EOS too), and a file that names no pad token gets one (``with_pad_token``).
The folder then loads through the same ``from_pretrained`` and vLLM paths as any other checkpoint, which is
what the trainer, reference and rollouts use.

Before anything is written the import checks that transformers can read the file's
architecture and that it is a causal LM; after writing it reloads the folder and requires the
same logits as the GGUF-loaded model on a probe text (``verify``).

CLI: ``rlpipe import-gguf FILE OUT_DIR`` (``make model-smol`` imports SmolLM2-135M-Instruct).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from services.common.model.padding import ensure_pad_token

IMPORT_MARKER = "gguf_import.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Keys of transformers' GGUF config table that name metadata groups, not model architectures.
_NOT_ARCHITECTURES = {"general", "tokenizer"}
# The special tokens a GGUF file names by id, and the tokenizer attribute each one sets.
SPECIAL_TOKEN_FIELDS = {
    "tokenizer.ggml.bos_token_id": "bos_token",
    "tokenizer.ggml.eos_token_id": "eos_token",
    "tokenizer.ggml.padding_token_id": "pad_token",
    "tokenizer.ggml.unknown_token_id": "unk_token",
}
CONFIG_TOKENS = ("bos_token", "eos_token", "pad_token")  # those the model and generation configs carry as ids too
# The probe is chat-rendered when the tokenizer has a template, so special tokens are compared too.
PROBE_TEXT = "Tom has 17 apples and buys 25 more. How many apples does he have now?"


class GGUFImportError(ValueError):
    """The file cannot be imported; the message names the file and the reason."""


@dataclass(frozen=True)
class ImportSummary:
    """What ``import_gguf`` wrote, recorded as ``gguf_import.json`` in the output folder."""

    source: str  # the GGUF file's name
    source_bytes: int
    source_sha256: str
    architecture: str  # general.architecture in the GGUF metadata, e.g. "llama"
    model_class: str  # the transformers class it was rebuilt as, e.g. "LlamaForCausalLM"
    parameters: int
    dtype: str
    max_logit_diff: float | None  # saved folder vs GGUF-loaded model on the probe; None when not verified
    seconds: float
    # special tokens this transformers version read wrongly or not at all, as the file names them:
    # {"eos_token": "'<|im_start|>' -> '<|im_end|>'"}; empty when it read them all
    special_tokens_corrected: dict[str, str]


def supported_architectures() -> list[str]:
    """GGUF ``general.architecture`` values this transformers version can read."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - _NOT_ARCHITECTURES)


def gguf_architecture(path: Path) -> str:
    """``general.architecture`` of a GGUF file, read from its metadata without touching the tensors."""
    from gguf import GGUFReader

    try:
        # GGUFReader memory-maps the file; only the metadata is read here.
        reader = GGUFReader(path)
    except (ValueError, OSError) as error:
        raise GGUFImportError(f"{path}: not a readable GGUF file ({error})") from None
    field = reader.fields.get("general.architecture")
    if field is None:
        raise GGUFImportError(f"{path}: GGUF metadata has no general.architecture")
    return field.contents()


def check_gguf(path: Path) -> str:
    """The architecture of ``path`` if transformers can import it as a causal LM; else GGUFImportError."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = Path(path)
    if not path.is_file():
        raise GGUFImportError(f"GGUF file not found: {path}")
    architecture = gguf_architecture(path)
    supported = ", ".join(supported_architectures())
    try:
        # Metadata only (return_tensors=False): applies transformers' own renames (e.g. qwen2moe) and support test.
        parsed = load_gguf_checkpoint(str(path), return_tensors=False)
    except ValueError as error:
        if "not supported" not in str(error):
            raise GGUFImportError(f"{path}: transformers cannot read its metadata: {error}") from None
        raise GGUFImportError(
            f"{path}: GGUF architecture {architecture!r} is not supported by transformers "
            f"{transformers.__version__}; supported architectures: {supported}"
        ) from None
    model_type = parsed["config"].get("model_type")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise GGUFImportError(
            f"{path}: GGUF architecture {architecture!r} loads as a {model_type!r} model, which is not a causal LM; "
            f"rlpipe trains causal LMs (supported GGUF architectures: {supported}, less the encoder-decoder ones)"
        )
    return architecture


def load_gguf(path: Path, dtype: str = "float32") -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The dequantized model and the tokenizer exactly as a user gets them from a GGUF file."""
    path = Path(path)
    folder, name = str(path.parent), path.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=DTYPES[dtype])
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model.eval(), tokenizer


def plain_copy(model: PreTrainedModel) -> PreTrainedModel:
    """The same weights in a model that is not marked GGUF-quantized, so ``save_pretrained`` accepts it."""
    config_dict = model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = AutoConfig.for_model(**config_dict)
    plain = AutoModelForCausalLM.from_config(config, dtype=model.dtype)
    # strict: every weight must come over; a missing one would silently keep its random initialization.
    plain.load_state_dict(model.state_dict(), strict=True)
    plain.generation_config = model.generation_config
    return plain.eval()


def file_special_tokens(path: Path) -> dict[str, int]:
    """The special-token ids the GGUF file's metadata names (``SPECIAL_TOKEN_FIELDS``), by tokenizer attribute."""
    from gguf import GGUFReader

    fields = GGUFReader(path).fields
    return {attribute: int(fields[key].contents()) for key, attribute in SPECIAL_TOKEN_FIELDS.items() if key in fields}


def with_file_special_tokens(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, named: dict[str, int]
) -> dict[str, str]:
    """Set the tokenizer's and the configs' special tokens to those the file names (``file_special_tokens``) where
    transformers read them otherwise; returns what changed, ``{attribute: "'old' -> 'new'"}``.

    The file is the authority: transformers 5.17's GPT-2 GGUF converter (SmolLM2's vocabulary) takes the BOS id for
    the EOS as well and drops the pad, so a folder saved as loaded would end every sequence at ``<|im_start|>``."""
    corrected = {}
    for attribute, token_id in named.items():
        token = tokenizer.convert_ids_to_tokens(token_id)
        if token is None:  # an id past the vocabulary: nothing to name, so the loader's reading stands
            continue
        before = getattr(tokenizer, attribute, None)
        if before != token:
            setattr(tokenizer, attribute, token)
            corrected[attribute] = f"{before!r} -> {token!r}"
        if attribute in CONFIG_TOKENS:
            for config in (model.config, model.generation_config):
                held = getattr(config, f"{attribute}_id", None)
                if not (isinstance(held, list) and token_id in held):  # several end tokens, the file's among them
                    setattr(config, f"{attribute}_id", token_id)
    return corrected


def with_pad_token(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Give the folder a pad token where the file names none (``with_file_special_tokens`` set the one it names):
    ``padding.pad_token_id``'s fallback (pad, else EOS, else unknown), written to the tokenizer, the model config and
    the generation config, so every reader of the folder pads alike."""
    ensure_pad_token(tokenizer)
    for config in (model.config, model.generation_config):
        if getattr(config, "pad_token_id", None) is None:
            config.pad_token_id = tokenizer.pad_token_id


def probe_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": PROBE_TEXT}], tokenize=False, add_generation_prompt=True
        )
        if not isinstance(text, str):  # tokenize=False renders text; transformers types the tokenized forms too
            raise TypeError(f"the chat template rendered {type(text).__name__}, not text")
    else:
        text = PROBE_TEXT
    return tokenizer.encode(text, add_special_tokens=False)


@torch.inference_mode()
def logits_of(model: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([ids])).logits[0].float()  # (T, vocab)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def one_reader_per_file() -> Iterator[None]:
    """Within it, every ``gguf.GGUFReader(path)`` of one file is the same reader.

    An import reads the file five times: its metadata here, then transformers anew for the config, the weights
    and the tokenizer. gguf's reader parses every metadata field in Python at construction, 10 CPU s for
    SmolLM2's 49k-token vocabulary and merges, so the import spent 50 of its 56 CPU s parsing. A reader is a
    read-only memory map with the fields parsed; nothing writes to it, so one per file serves every read.
    transformers imports the class from ``gguf`` at each call, so replacing the module's name reaches it.
    """
    import gguf

    parse = gguf.GGUFReader
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: Path | str, mode: Literal["r", "r+", "c"] = "r") -> Any:
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = parse(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = parse


@one_reader_per_file()
def import_gguf(
    gguf_path: Path,
    out_dir: Path,
    dtype: str = "float32",
    overwrite: bool = False,
    verify: bool = True,
    max_logit_diff: float = 1e-4,
) -> ImportSummary:
    """Write the model in ``gguf_path`` to ``out_dir`` as a Hugging Face folder; returns what was written.

    ``dtype`` is the saved weights' dtype: float32 (default) keeps every dequantized value exactly
    (Q4_1 values are fp16 scale times a 4-bit integer plus an fp16 offset, which bfloat16 cannot
    always hold). The folder is assembled beside ``out_dir`` and renamed into place, so an
    interrupted import never leaves a half-written model; ``gguf_import.json`` is its last file.

    Raises:
        GGUFImportError: the file is missing, not GGUF, of an architecture transformers cannot
            read or that is not a causal LM, ``out_dir`` exists without ``overwrite``, or the
            saved folder's logits differ from the GGUF-loaded model's by more than ``max_logit_diff``.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if dtype not in DTYPES:
        raise GGUFImportError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    if out_dir.exists() and not overwrite:
        raise GGUFImportError(f"{out_dir} already exists; pass overwrite (--overwrite) to replace it")
    started = time.perf_counter()
    architecture = check_gguf(gguf_path)

    gguf_model, tokenizer = load_gguf(gguf_path, dtype)
    staging = out_dir.with_name(out_dir.name + ".importing")
    shutil.rmtree(staging, ignore_errors=True)
    plain = plain_copy(gguf_model)
    corrected = with_file_special_tokens(plain, tokenizer, file_special_tokens(gguf_path))
    with_pad_token(plain, tokenizer)
    model_class, parameters = type(plain).__name__, sum(p.numel() for p in plain.parameters())
    plain.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    del plain  # one fewer copy of the weights in memory while verifying

    diff = None
    if verify:
        ids = probe_ids(tokenizer)
        saved = AutoModelForCausalLM.from_pretrained(str(staging), dtype=DTYPES[dtype]).eval()
        saved_ids = probe_ids(AutoTokenizer.from_pretrained(str(staging)))
        if saved_ids != ids:
            raise GGUFImportError(f"{gguf_path}: the saved tokenizer encodes the probe differently from the GGUF one")
        diff = (logits_of(saved, ids) - logits_of(gguf_model, ids)).abs().max().item()
        if not diff <= max_logit_diff:
            raise GGUFImportError(
                f"{gguf_path}: the saved model's logits differ from the GGUF-loaded model's by {diff:.3g} "
                f"(more than {max_logit_diff:g})"
            )

    summary = ImportSummary(
        source=gguf_path.name,
        source_bytes=gguf_path.stat().st_size,
        source_sha256=_sha256(gguf_path),
        architecture=architecture,
        model_class=model_class,
        parameters=parameters,
        dtype=dtype,
        max_logit_diff=diff,
        seconds=round(time.perf_counter() - started, 2),
        special_tokens_corrected=corrected,
    )
    (staging / IMPORT_MARKER).write_text(json.dumps(asdict(summary), indent=2) + "\n")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    staging.rename(out_dir)
    return summary
