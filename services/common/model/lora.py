"""LoRA adapters (``model.lora``): attaching them to a policy, the tensors of a policy version, peft's adapter
folder, merging an adapter into base weights, and the base model's identity.

Names: inside the trainer a peft model names an adapter tensor ``base_model.model.<module>.lora_A.default.weight``;
weight sync, exports and vLLM's adapter folders use peft's saved form, ``base_model.model.<module>.lora_A.weight``
(``saved_name``), which is also what ``adapter_model.safetensors`` holds.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file
from transformers import PreTrainedModel

from services.common.config import LoraConfig
from services.common.refusal import StartRefused

if TYPE_CHECKING:
    from peft import LoraConfig as PeftLoraConfig
    from peft import PeftModel

ADAPTER = "default"  # peft's name for the one adapter a policy has
PREFIX = "base_model.model."  # what peft puts before a module's path in the base model


def linear_module_names(model: torch.nn.Module) -> list[str]:
    """The distinct last parts of the paths of ``model``'s Linear modules: what ``target_modules`` may name."""
    return sorted(
        {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    )


def peft_config(lora: LoraConfig, base_path: Path | str = "") -> PeftLoraConfig:
    # peft only here and in attach_adapters: a full-weights policy's trainer and rollout never pay its import
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,  # pyright: ignore[reportArgumentType]  (peft annotates an int; it scales by any number)
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        base_model_name_or_path=str(base_path),
        task_type="CAUSAL_LM",
    )


def attach_adapters(model: PreTrainedModel, lora: LoraConfig, base_path: Path | str = "") -> PeftModel:
    """``model`` with LoRA adapters on the ``target_modules``: only the adapters require grad. Each adapter's B
    starts at zero, so the policy starts as the base model. Raises StartRefused when a target names no Linear
    module of the model, listing the names it has."""
    names = linear_module_names(model)
    unknown = [target for target in lora.target_modules if target not in names]
    if unknown:
        raise StartRefused(
            f"invalid configuration:\n  model.lora.target_modules: {unknown} match no Linear module of the model at "
            f"{str(base_path)!r}; its Linear modules are named {names}"
        )
    from peft import get_peft_model  # deferred: see peft_config

    return get_peft_model(model, peft_config(lora, base_path))


def saved_name(name: str) -> str:
    """An adapter tensor's name as peft saves it (the adapter's own name dropped)."""
    return name.replace(f".{ADAPTER}.", ".")


def adapter_tensors(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter tensors of a peft model's ``state`` (its ``state_dict()`` or a gathered copy), under the names
    peft saves them."""
    return {saved_name(name): tensor for name, tensor in state.items() if ".lora_" in name}


def write_adapter(
    folder: Path, lora: LoraConfig, tensors: Iterable[tuple[str, torch.Tensor]], base: Path | str
) -> None:
    """An adapter folder as peft writes one (adapter_config.json, adapter_model.safetensors): loadable by
    ``PeftModel.from_pretrained`` and by vLLM's ``LoRARequest``."""
    folder.mkdir(parents=True, exist_ok=True)
    peft_config(lora, base).save_pretrained(str(folder))
    save_file({name: tensor.contiguous() for name, tensor in tensors}, str(folder / "adapter_model.safetensors"))


class AdapterMerger:
    """Merges an adapter into base weights: W = W_base + alpha / r * B @ A, for each targeted Linear weight.

    Keeps a copy of the targeted base weights only (not the whole model), so each version is merged onto the base,
    never onto the previous version's merge."""

    def __init__(self, weights: Mapping[str, torch.Tensor], lora: LoraConfig):
        """``weights``: the base model's tensors by Hugging Face name (a state dict, or a model's safetensors)."""
        self.scale = lora.alpha / lora.r
        targets = set(lora.target_modules)
        self.base = {
            name: weight.detach().clone()
            for name, weight in weights.items()
            if name.endswith(".weight") and weight.dim() == 2 and name.rsplit(".", 2)[-2] in targets
        }

    def merged(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The targeted weights with the adapter ``tensors`` (peft's saved names) merged, by base-model name.
        Raises KeyError when the adapter does not fit the model (an unknown module, a missing A or B)."""
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in tensors:
            module, _, part = name.removeprefix(PREFIX).rpartition(".lora_")
            pairs.setdefault(f"{module}.weight", {})[part.split(".")[0]] = tensor
        unknown = sorted(pairs.keys() - self.base.keys())
        if unknown:
            raise KeyError(f"adapter tensors for {unknown[:3]}: no targeted Linear module of that name")
        missing = sorted(self.base.keys() - pairs.keys()) + sorted(n for n, p in pairs.items() if set(p) != {"A", "B"})
        if missing:
            raise KeyError(f"adapter tensors missing for {missing[:3]}")
        out = {}
        for name, base in self.base.items():
            delta = pairs[name]["B"].float() @ pairs[name]["A"].float()
            out[name] = (base.float() + self.scale * delta).to(base.dtype)
        return out


def base_identity(path: Path) -> tuple[str, str]:
    """The base model's path and a content hash: sha256 over its config.json and weight files, in name order.
    A checkpoint of adapters only is meaningful over exactly these weights."""
    digest = hashlib.sha256()
    files = [path / "config.json", *sorted(path.glob("*.safetensors")), *sorted(path.glob("*.bin"))]
    for file in files:
        digest.update(file.name.encode())
        with file.open("rb") as stream:
            while chunk := stream.read(1 << 24):
                digest.update(chunk)
    return str(path), digest.hexdigest()


def base_identity_in_background(path: Path) -> Callable[[], tuple[str, str]]:
    """``base_identity(path)`` on a thread of its own (hashlib lets go of the GIL, so it overlaps the model's load);
    the call returned waits for it and gives its result or raises its error. A daemon thread: a start that fails
    meanwhile exits without waiting out the hash of a large model."""
    outcome: list[tuple[str, str] | BaseException] = []

    def run() -> None:
        try:
            outcome.append(base_identity(path))
        except BaseException as error:  # handed to the caller, which raises it where the learner is built
            outcome.append(error)

    thread = threading.Thread(target=run, name="base-hash", daemon=True)
    thread.start()

    def result() -> tuple[str, str]:
        thread.join()
        if isinstance(found := outcome[0], BaseException):
            raise found
        return found

    return result
