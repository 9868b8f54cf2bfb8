"""The TRL side of ``trl_grpo.py``: GRPO with TRL's ``GRPOTrainer`` from a JSON spec.

Runs in the TRL environment (``requirements/make_trl_venv.sh``), not in ours, and imports
nothing from areal-agents::

    .venv-trl/bin/python benchmarks/trl_grpo_runner.py SPEC.json RESULT.json

The spec gives the model directory, the prompts (chat messages and gold answers, in the order
the steps use them), the token ids our chat template gives each prompt (to check that both
sides train on the same prompt tokens), the batch shape and the optimizer settings. The
result has the wall-clock time at the end of every step, the reward and completion length
TRL logged for each step, and the library versions.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_PHRASE = re.compile(r"answer is\s*:?\s*\$?(-?\d[\d,]*(?:\.\d+)?)", re.IGNORECASE)


def final_number(text: str) -> str | None:
    """The number after the last "answer is", else the last number in ``text``."""
    phrase = _PHRASE.findall(text)
    if phrase:
        return str(phrase[-1])
    numbers = _NUMBER.findall(text)
    return str(numbers[-1]) if numbers else None


def same_number(predicted: str | None, gold: str) -> bool:
    if predicted is None:
        return False
    try:
        return abs(float(predicted.replace(",", "")) - float(gold.replace(",", ""))) < 1e-6
    except ValueError:
        return predicted.strip() == gold.strip()


def answer_reward(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
    """1.0 when the completion's final number equals the gold answer, else 0.0."""
    out = []
    for completion, gold in zip(completions, answer, strict=True):
        text = completion[-1]["content"] if isinstance(completion, list) else str(completion)
        out.append(1.0 if same_number(final_number(text or ""), gold) else 0.0)
    return out


def main() -> None:
    spec_path, result_path = Path(sys.argv[1]), Path(sys.argv[2])
    spec = json.loads(spec_path.read_text())

    import peft
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    torch.set_num_threads(int(spec["threads"]))
    torch.manual_seed(int(spec["seed"]))

    class StepClock(TrainerCallback):  # type: ignore[misc]
        """Wall-clock time at the end of each step, and what TRL logs for it."""

        def __init__(self, quiet: bool, generate_s: list[float]) -> None:
            self.quiet = quiet
            self.generate_s = generate_s  # seconds inside model.generate so far (one cell)
            self.generate_ends: list[float] = []
            self.step_ends: list[float] = []
            self.logs: list[dict[str, float]] = []
            self.t_start = time.perf_counter()

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.t_start = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.step_ends.append(time.perf_counter())
            self.generate_ends.append(self.generate_s[0])
            if not self.quiet:
                took = self.step_ends[-1] - ([self.t_start, *self.step_ends][-2])
                print(f"TRL step {state.global_step}/{state.max_steps}: {took:.1f} s", flush=True)

        def on_log(
            self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any
        ) -> None:
            if logs and "reward" in logs:
                self.logs.append({k: float(v) for k, v in logs.items() if _is_number(v)})

    path = spec["model"]
    tokenizer = AutoTokenizer.from_pretrained(path)
    rows = spec["rows"]
    ours = spec.get("prompt_ids") or []

    def prompt_ids(messages: list[dict[str, Any]]) -> list[int]:
        encoded: Any = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )
        return list(encoded["input_ids"])

    same_prompts = all(
        prompt_ids(row["prompt"]) == ids for row, ids in zip(rows, ours, strict=False)
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    # Time TRL's generation: its calls reach this model's generate through peft's wrapper.
    generate_s, plain_generate = [0.0], model.generate

    def timed_generate(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return plain_generate(*args, **kwargs)
        finally:
            generate_s[0] += time.perf_counter() - t

    model.generate = timed_generate
    lora = spec["lora"]
    peft_config = peft.LoraConfig(
        task_type="CAUSAL_LM",
        r=lora["r"],
        lora_alpha=lora["alpha"],
        lora_dropout=lora["dropout"],
        target_modules=list(lora["target_modules"]),
    )
    prompts, gens = int(spec["prompts_per_step"]), int(spec["num_generations"])
    steps = int(spec["warmup_steps"]) + int(spec["steps"])
    out_dir = tempfile.mkdtemp(prefix="trl-grpo-")
    config = trl.GRPOConfig(
        output_dir=out_dir,
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=prompts * gens,
        gradient_accumulation_steps=1,
        num_generations=gens,
        max_completion_length=int(spec["max_completion_length"]),
        max_steps=steps,
        learning_rate=float(spec["lr"]),
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=float(spec["grad_clip"]),
        temperature=float(spec["temperature"]),
        top_p=1.0,
        top_k=0,
        beta=0.0,
        num_iterations=1,
        epsilon=0.2,
        loss_type="grpo",
        scale_rewards="group",
        shuffle_dataset=False,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=int(spec["seed"]),
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    clock = StepClock(bool(spec.get("quiet", False)), generate_s)
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=answer_reward,
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[clock],
    )
    for printer in (PrinterCallback, ProgressCallback):  # per-step dicts on stdout
        trainer.remove_callback(printer)
    trainer.train()
    result = {
        "t_start": clock.t_start,
        "step_ends": clock.step_ends,
        "generate_ends": clock.generate_ends,
        "logs": clock.logs,
        "same_prompt_ids": same_prompts,
        "threads": torch.get_num_threads(),
        "versions": {
            "trl": trl.__version__,
            "transformers": transformers.__version__,
            "peft": peft.__version__,
            "torch": torch.__version__,
        },
    }
    result_path.write_text(json.dumps(result))


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


if __name__ == "__main__":
    main()
