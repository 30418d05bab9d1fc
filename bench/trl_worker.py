"""The TRL side of ``bench/vs_trl.py``: TRL's ``GRPOTrainer`` on the bench's task, run by ``run_trl`` inside the TRL
environment (``build/bench/trl-venv``), never ``.venv``:

    build/bench/trl-venv/bin/python bench/trl_worker.py TASK_JSON OUT_DIR THREADS

It writes one JSON line per step (``OUT_DIR/steps.jsonl``: the step's end time and mean reward) and the final
model (``OUT_DIR/final``). It imports nothing of rlpipe but ``answers.py``, which needs only the standard library.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script: bench.vs_trl's Task, and answers.py

from bench.vs_trl import Task  # noqa: E402  # after the path it is found on

_FINAL_INTEGER = re.compile(r"-?\d+")


def trl_rows(task: Task) -> list[dict]:
    """The training rows as TRL takes them: a chat row's ``messages`` become a conversational ``prompt``, which
    TRL renders with the tokenizer's chat template and ``add_generation_prompt``, as rlpipe does."""
    rows = [json.loads(line) for line in (ROOT / task.train_path).read_text().splitlines() if line.strip()]
    return [{"prompt": row.get("messages", row.get("prompt")), "answer": row["answer"]} for row in rows]


def device_args(task: Task) -> dict[str, bool]:
    """GRPOConfig's device settings: the CPU in float32, or the GPU in bf16 autocast (TRL's own mixed precision)."""
    return {"use_cpu": task.device == "cpu", "bf16": task.device == "cuda"}


def trl_generation(task: Task) -> dict[str, object]:
    """GRPOConfig's generation settings for ``task.backend``: vLLM colocated in the trainer's process (TRL's
    vLLM without a separate server) for "vllm"; transformers generate, TRL's default, otherwise."""
    return {"use_vllm": True, "vllm_mode": "colocate"} if task.backend == "vllm" else {}


def trl_worker(task: Task, out_dir: Path, threads: int) -> None:
    """Train with TRL's GRPOTrainer; write one JSON line per step and the final model under ``out_dir``."""
    import torch

    torch.set_num_threads(threads)
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer  # pyright: ignore[reportMissingImports]  (in TRL's own venv only)

    rows = trl_rows(task)
    dataset = Dataset.from_list(rows)
    chat = isinstance(rows[0]["prompt"], list)
    # answers.py needs only the standard library, so this environment can import it; the rest of rlpipe it
    # cannot (math-verify et al.).
    from services.common.model.answers import ends_on_answer

    # rlpipe's exact_match reward restated here, for the same reason.
    def exact_match(completions: list[str], answer: list[str], **_: object) -> list[float]:
        scores = []
        for text, expected in zip(completions, answer, strict=True):
            found = _FINAL_INTEGER.findall(text)
            scores.append(float(bool(found) and found[-1].lstrip("0") == expected.strip().lstrip("0")))
        return scores

    # rlpipe's final_number: a conversational completion is one assistant message.
    def final_number(completions: list[list[dict]], answer: list[str], **_: object) -> list[float]:
        return [
            float(ends_on_answer(c[0]["content"], expected)) for c, expected in zip(completions, answer, strict=True)
        ]

    started = time.perf_counter()
    steps = (out_dir / "steps.jsonl").open("w")

    class StepClock(TrainerCallback):
        """Writes each logged step's end time and mean reward (logging_steps=1: one log per step)."""

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                row = {"step": state.global_step, "time": time.perf_counter() - started, "reward": logs["reward"]}
                steps.write(json.dumps(row) + "\n")
                steps.flush()

    args = GRPOConfig(
        output_dir=str(out_dir / "trainer"),
        max_steps=task.steps,
        per_device_train_batch_size=task.completions_per_step,
        gradient_accumulation_steps=1,
        num_generations=task.group_size,
        max_completion_length=task.max_new_tokens,
        temperature=task.temperature,
        top_p=1.0,
        learning_rate=task.learning_rate,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=task.warmup_steps,
        weight_decay=0.0,
        max_grad_norm=task.max_grad_norm,
        epsilon=task.clip,
        beta=task.kl_coef,
        loss_type="dapo",  # token-mean over the step's tokens: rlpipe's loss_agg token-mean
        scale_rewards="group",
        num_iterations=1,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=task.seed,
        **device_args(task),
        dataloader_num_workers=0,
        **trl_generation(task),
    )
    tokenizer = AutoTokenizer.from_pretrained(str(ROOT / task.model))
    trainer = GRPOTrainer(
        model=str(ROOT / task.model),
        reward_funcs=final_number if chat else exact_match,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepClock()],
    )
    trainer.train()
    steps.close()
    trainer.model.save_pretrained(str(out_dir / "final"))
    tokenizer.save_pretrained(str(out_dir / "final"))


if __name__ == "__main__":
    trl_worker(Task(**json.loads(sys.argv[1])), Path(sys.argv[2]), int(sys.argv[3]))
