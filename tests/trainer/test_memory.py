"""The per-rank memory estimate: exact parameter, adapter and optimizer counts on a small
config, and the estimated total against the measured peak of real CPU training steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from transformers import LlamaConfig, Qwen2Config, Qwen3Config

from areal_agents.trainer.config_io import load_config
from areal_agents.trainer.memory import MemoryEstimate, estimate_for_config, estimate_memory

F32 = 4


def small_qwen3(**kw) -> Qwen3Config:
    """V=100, h=16, i=40, 2 layers, 4 heads of 8 (q=32), 2 kv heads (kv=16), untied."""
    base = dict(
        vocab_size=100,
        hidden_size=16,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=False,
    )
    return Qwen3Config(**(base | kw))


# By hand, for small_qwen3(): per layer q 16*32 = 512, k 16*16 = 256, v 256, o 32*16 = 512,
# gate/up/down 16*40 = 640 each, norms 2*16 + q/k norms 2*8  ->  3504; two layers 7008;
# embeddings 100*16 = 1600, lm_head 1600, final norm 16  ->  3216 outside the layers.
LAYER, ROOT = 3504, 3216
PARAMS = 2 * LAYER + ROOT  # 10224
LORA_QV = 2 * (4 * (16 + 32) + 4 * (16 + 16))  # r=4 on q_proj (16->32), v_proj (16->16): 640
LORA_ALL = 2 * (4 * 48 + 4 * 32 * 2 + 4 * 48 + 4 * 56 * 3)  # every linear of both layers: 2624


def _estimate(**kw) -> MemoryEstimate:
    args = dict(lora=None, param_dtype="float32", micro_batch_tokens=64) | kw
    return estimate_memory(small_qwen3(), **args)


def test_parameter_and_optimizer_bytes_by_hand() -> None:
    from transformers import Qwen3ForCausalLM

    assert sum(p.numel() for p in Qwen3ForCausalLM(small_qwen3()).parameters()) == PARAMS
    full = _estimate()
    assert (full.num_params, full.trainable_params) == (PARAMS, PARAMS)
    assert full.parameters == full.gradients == F32 * PARAMS
    assert full.optimizer == 2 * F32 * PARAMS  # exp_avg and exp_avg_sq
    assert full.reference == full.critic == 0
    assert full.total == 4 * F32 * PARAMS + full.activations == full.device_total

    half = _estimate(param_dtype="bfloat16")  # unsharded: torch's moments in the weights' dtype
    assert (half.parameters, half.gradients, half.optimizer) == (2 * PARAMS, 2 * PARAMS, 4 * PARAMS)

    qv = _estimate(lora={"r": 4, "target_modules": ["q_proj", "v_proj"]}, param_dtype="bfloat16")
    assert (qv.num_params, qv.trainable_params) == (PARAMS + LORA_QV, LORA_QV)
    assert qv.parameters == 2 * PARAMS + F32 * LORA_QV  # frozen bf16 base, float32 adapters
    assert (qv.gradients, qv.optimizer) == (F32 * LORA_QV, 2 * F32 * LORA_QV)
    every = _estimate(lora={"r": 4, "target_modules": "all-linear"})
    assert every.trainable_params == LORA_ALL
    by_pattern = _estimate(lora={"r": 4, "target_modules": r".*\.(q|v)_proj"})
    assert by_pattern.trainable_params == LORA_QV

    # a KL reference is a frozen copy of a full fine-tune; LoRA's reference is its base
    assert _estimate(reference=True).reference == F32 * PARAMS
    assert _estimate(reference=True, lora={"r": 4, "target_modules": ["q_proj"]}).reference == 0
    # the critic: the backbone without lm_head, a float32 head (h + 1), grads and two moments
    backbone = PARAMS - 1600
    assert _estimate(critic=True).critic == 4 * F32 * (backbone + 17)
    lora_critic = _estimate(critic=True, lora={"r": 4, "target_modules": ["q_proj", "v_proj"]})
    assert lora_critic.critic == F32 * backbone + 4 * F32 * (LORA_QV + 17)


def test_sharding_divides_by_nproc() -> None:
    sharded = _estimate(nproc=4, sharded=True)
    # the shard, plus the root (kept gathered through the step) and two gathered layers
    assert sharded.parameters == F32 * PARAMS // 4 + F32 * (ROOT + 2 * LAYER)
    assert sharded.gradients == F32 * PARAMS // 4 + F32 * (ROOT + LAYER)
    assert sharded.optimizer == 2 * F32 * PARAMS // 4
    assert _estimate(nproc=4, sharded=True, reference=True).reference == F32 * PARAMS // 4
    unsharded = _estimate(nproc=4)  # not sharded: every rank holds everything
    assert unsharded.optimizer == 2 * F32 * PARAMS
    # FSDP2 on CUDA: float32 master weights and moments, gathered in bfloat16
    mixed = _estimate(nproc=4, sharded=True, param_dtype="bfloat16", device="cuda")
    assert mixed.parameters == F32 * PARAMS // 4 + 2 * (ROOT + 2 * LAYER)
    assert mixed.optimizer == 2 * F32 * PARAMS // 4
    on_cpu = _estimate(nproc=4, sharded=True, param_dtype="bfloat16", device="cpu")
    assert on_cpu.optimizer == 2 * 2 * PARAMS // 4
    # cpu_offload: the device keeps the gathered working set and the activations
    off = _estimate(nproc=4, sharded=True, cpu_offload=True)
    assert off.total == sharded.total
    gathered = F32 * (ROOT + 2 * LAYER) + F32 * (ROOT + LAYER)
    assert off.device_total == gathered + off.activations
    assert off.host == off.total - off.device_total
    with pytest.raises(ValueError, match="sharded"):
        _estimate(cpu_offload=True)


def test_parameter_counts_of_other_architectures() -> None:
    from transformers import AutoModelForCausalLM

    small = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    configs = [
        Qwen2Config(**small),  # q, k, v biased
        LlamaConfig(**small, attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
        Qwen3Config(**small, head_dim=16),
    ]
    for cfg in configs:
        model = AutoModelForCausalLM.from_config(cfg)
        est = estimate_memory(cfg, lora=None, param_dtype="float32", micro_batch_tokens=8)
        assert est.num_params == sum(p.numel() for p in model.parameters()), cfg.model_type


def test_lora_counts_match_peft() -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3ForCausalLM

    for targets in (["q_proj", "v_proj"], "all-linear", ["down_proj", "lm_head"]):
        model = get_peft_model(
            Qwen3ForCausalLM(small_qwen3()),
            LoraConfig(task_type="CAUSAL_LM", r=4, target_modules=targets),
        )
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        est = _estimate(lora={"r": 4, "target_modules": targets})
        assert est.trainable_params == trained, targets
    with pytest.raises(ValueError, match="match no module"):
        _estimate(lora={"r": 4, "target_modules": ["qkv_proj"]})


def test_format_is_readable() -> None:
    text = _estimate(nproc=2, sharded=True, cpu_offload=True, critic=True).format()
    assert "per rank: params" in text and "total" in text and "cpu_offload" in text
    qwen3_8b = Qwen3Config(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
    )
    big = estimate_memory(qwen3_8b, lora=None, param_dtype="bfloat16", micro_batch_tokens=4096)
    assert " GiB" in big.format() and "8.2B parameters" in big.format()


def test_estimate_for_config_reads_only_the_config(tmp_path: Path) -> None:
    small_qwen3().save_pretrained(tmp_path)  # config.json, no weights
    cfg = load_config(
        None,
        [
            "env.id=areal/Math-v0",
            f"model.path={tmp_path}",
            "model.dtype=float32",
            "model.device=cpu",
            "train.micro_batch_tokens=64",
            "algorithm=ppo",
            "loss.kl_coef=0.1",
        ],
    )
    est = estimate_for_config(cfg)
    want = _estimate(reference=True, critic=True, device="cpu")
    assert est == want and est.reference and est.critic
    # grpo: no critic, and its default KL weight (0) needs no reference
    lora = load_config(
        None,
        [
            "env.id=areal/Math-v0",
            f"model.path={tmp_path}",
            "model.dtype=bfloat16",
            "model.device=cpu",
            "model.lora.enabled=true",
            "model.lora.r=4",
            "model.activation_checkpointing=true",
            "train.micro_batch_tokens=64",
        ],
    )
    want = _estimate(
        lora={"r": 4, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
        param_dtype="bfloat16",
        activation_checkpointing=True,
        device="cpu",
    )
    assert estimate_for_config(lora) == want and want.reference == want.critic == 0


# ---------------------------------------------------------------------------- measured
def live_peak(fn) -> int:
    """The most bytes of CPU memory allocated during ``fn`` and not yet freed (relative to
    its start): the profiler's memory events (+ allocation, - free) summed in time order.
    They are read from the raw kineto results: ``prof.events()`` folds the allocations
    made inside an operator into that operator's totals."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


UNTIED = dict(  # 59.9M parameters: 2 x 29.2M embeddings and lm_head, 4 small layers
    vocab_size=151936,
    hidden_size=192,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=3,
    num_key_value_heads=1,
    head_dim=64,
    tie_word_embeddings=False,
    max_position_embeddings=4096,
)
TIED = UNTIED | dict(hidden_size=352, num_attention_heads=6, tie_word_embeddings=True)  # 56.9M
LAYERS = UNTIED | dict(
    vocab_size=512, hidden_size=256, intermediate_size=768, num_attention_heads=4
)
"""A small vocabulary: the decoder layers dominate, as in large models at long micro-batches."""


class Trainee:
    """A model in training on the CPU, with its parameters, AdamW moments and gradients
    allocated as after a step, ready for the profiled step of a later micro-batch (the
    trainer zeroes gradients once per step and accumulates them over its micro-batches)."""

    def __init__(
        self, config: dict, tokens: int, lora: dict | None = None, dtype: str = "float32"
    ) -> None:
        from transformers import Qwen3ForCausalLM

        torch.manual_seed(0)
        self.config = Qwen3Config(**config)
        self.dtype = dtype
        model = Qwen3ForCausalLM(self.config).to(getattr(torch, dtype))
        if lora:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **lora))
        self.model, self.lora, self.tokens = model.train(), lora, tokens
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-5)
        for p in self.params:
            p.grad = torch.zeros_like(p)
        self.optimizer.step()  # allocates the moments
        self.ids = torch.randint(0, self.config.vocab_size, (1, tokens))
        half = tokens // 2  # two sequences packed in one row
        self.positions = torch.cat([torch.arange(half), torch.arange(tokens - half)])[None]

    def step(self, loss: str) -> None:
        """Forward, a loss over the vocabulary, backward, clipping and an AdamW step."""
        from areal_agents.trainer.loss import entropy_from_logits
        from areal_agents.trainer.policy import token_logprobs

        out = self.model(input_ids=self.ids, position_ids=self.positions, use_cache=False)
        rows, targets = out.logits[0, :-1], self.ids[0, 1:]
        if loss == "trainer":  # Policy.train_step: token logprobs and detached entropies
            logp = token_logprobs(rows, targets, 1.0)
            entropy_from_logits(rows.detach(), 1.0)
        else:  # log_softmax in float32, gathered at the targets
            logp = torch.log_softmax(rows.float(), -1).gather(-1, targets[:, None])
        (-logp.mean()).backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()

    def check(self, loss: str = "trainer", checkpointing: bool = False) -> None:
        """The step's measured peak (what is alive before it plus the most it allocates at
        once) is within 30 % of the estimate."""
        model = self.model
        before = tensor_bytes(model.parameters()) + tensor_bytes(p.grad for p in self.params)
        before += tensor_bytes(t for s in self.optimizer.state.values() for t in s.values())
        if checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
            if self.lora:
                model.enable_input_require_grads()
        try:
            measured = before + live_peak(lambda: self.step(loss))
        finally:
            model.gradient_checkpointing_disable()
        est = estimate_memory(
            self.config,
            lora=self.lora,
            param_dtype=self.dtype,
            micro_batch_tokens=self.tokens,
            activation_checkpointing=checkpointing,
            device="cpu",
        )
        mib = 1 << 20
        print(f"\nmeasured {measured / mib:.1f} MiB, estimated {est.total / mib:.1f} MiB")
        print(est.format())
        assert abs(est.total - measured) <= 0.3 * measured, (est.total / mib, measured / mib)


@pytest.fixture(scope="module")
def full_finetune() -> Trainee:
    trainee = Trainee(UNTIED, tokens=256)
    assert sum(p.numel() for p in trainee.model.parameters()) >= 50_000_000
    return trainee


@pytest.mark.slow
@pytest.mark.parametrize(
    "loss, checkpointing",
    [("trainer", False), ("log_softmax", False), ("trainer", True)],
    ids=["trainer loss", "plain log-softmax loss", "activation checkpointing"],
)
def test_full_finetune_within_30_percent_of_measured(
    full_finetune: Trainee, loss: str, checkpointing: bool
) -> None:
    full_finetune.check(loss, checkpointing)


@pytest.mark.slow
def test_lora_within_30_percent_of_measured() -> None:
    Trainee(UNTIED, tokens=256, lora={"r": 8, "target_modules": ["q_proj", "v_proj"]}).check()


@pytest.mark.slow
def test_tied_embeddings_within_30_percent_of_measured() -> None:
    """Few tokens and tied embeddings: the peak is the embeddings' gradient at the end of
    the backward (lm_head's, the embedding's and their sum)."""
    Trainee(TIED, tokens=128).check()


@pytest.mark.slow
@pytest.mark.parametrize(
    "lora, checkpointing, dtype",
    [
        (None, False, "float32"),
        (None, True, "float32"),
        ({"r": 8, "target_modules": "all-linear"}, False, "float32"),
        (None, False, "bfloat16"),
    ],
    ids=["full", "activation checkpointing", "lora all-linear", "bfloat16"],
)
def test_decoder_layers_within_30_percent_of_measured(lora, checkpointing, dtype) -> None:
    Trainee(LAYERS, tokens=512, lora=lora, dtype=dtype).check(checkpointing=checkpointing)
