"""The CUDA path on a real GPU: skipped where torch sees none (CI has none; the device
machines some sessions are lent run it, see docs/cost_model.md, "On a GPU").

* executor.rng draws on CUDA the bits it draws on the CPU, eagerly and with its compiled
  kernel (executor.rng_triton on CUDA): the integer-derived values (uniform, dropout,
  bernoulli, randint, the uniform inits) bit for bit, normals to the last bit of float32
  (CUDA's and the CPU's log/cos/sin are not correctly rounded, docs/rng.md).
* a 1-device plan for a GPU profile puts the model on the GPU and trains to the CPU
  run's losses, dropout on.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import executor
import planner
from executor import rng
from planner.presets import build_model, load_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SEED = 1234
SHAPE = {"batch_size": 8, "seq_len": 64}
STEPS = 4
# draws whose values come from integers alone: equal bit for bit on every device
EXACT = ("rand f32", "rand f16", "rand bf16", "randint", "dropout", "bernoulli", "linear init")


def _draws(device: str) -> dict[str, torch.Tensor]:
    rng.manual_seed(SEED)
    with torch.device(device):
        ones = torch.ones(3000, 37)
        q = torch.ones(2, 4, 40, 16)
        out = {
            "rand f32": torch.rand(5000, 37),
            "rand f16": torch.rand(999, dtype=torch.float16),
            "rand bf16": torch.rand(999, dtype=torch.bfloat16),
            "randint": torch.randint(-5, 1000, (10001,)),
            "dropout": F.dropout(ones, 0.3),
            "bernoulli": torch.bernoulli(torch.full((4097,), 0.4)),
            "linear init": nn.Linear(256, 384).weight.detach(),  # kaiming_uniform_
            # q = k = v = ones: each output is the kept share of its row's weights (a sum:
            # its order, and so its last bit, is the device's)
            "sdpa dropout": F.scaled_dot_product_attention(q, q, q, dropout_p=0.25),
            "randn f32": torch.randn(5000, 37),
            "normal_ f32": torch.empty(777).normal_(2.0, 0.5),
        }
    return {name: t.cpu() for name, t in out.items()}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_draws_on_cuda_are_the_cpus(compiled: bool) -> None:
    cpu = _draws("cpu")
    rng.use_compiled_generator(compiled)
    try:
        cuda = _draws("cuda")
        assert rng._COMPILED["enabled"] is compiled  # a failed compile would have gone eager
        assert rng._COMPILED["triton"]  # on CUDA the compiled words come from executor.rng_triton
    finally:
        rng.use_compiled_generator(False)  # the suite's setting (tests/conftest.py)
    for name in EXACT:
        assert torch.equal(cuda[name], cpu[name]), name
    torch.testing.assert_close(cuda["sdpa dropout"], cpu["sdpa dropout"], rtol=1e-6, atol=0)
    for name in ("randn f32", "normal_ f32"):
        differ = (cuda[name] != cpu[name]).float().mean().item()
        assert differ < 1e-3, (name, differ)
        torch.testing.assert_close(cuda[name], cpu[name], rtol=2**-22, atol=2**-24, msg=name)
    assert 0.25 < (cpu["dropout"] == 0).float().mean() < 0.35  # the masks are masks


def _train(plan: planner.Plan) -> tuple[list[float], str, dict[str, torch.Tensor]]:
    """examples/train.py's loop: the model built on meta, applied, AdamW, dropout on."""
    config = load_config("llama-tiny")
    config.attention_dropout = 0.1
    rng.manual_seed(SEED)
    model = executor.apply(plan, build_model(config, device="meta"))
    device = next(model.parameters()).device
    first = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, config.vocab_size, (SHAPE["batch_size"], SHAPE["seq_len"]), generator=data)
        loss = model(input_ids=ids.to(device), labels=ids.to(device)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, device.type, first


def test_a_one_device_gpu_plan_trains_on_the_gpu_to_the_cpus_losses() -> None:
    gpu_plan = planner.hand_plan("llama-tiny", devices=1, profile="h100-sxm-80g", **SHAPE)
    cpu_plan = planner.hand_plan("llama-tiny", devices=1, profile="cpu-gloo-local", **SHAPE)
    gpu, where, gpu_init = _train(gpu_plan)
    cpu, cpu_where, cpu_init = _train(cpu_plan)
    assert (where, cpu_where) == ("cuda", "cpu")
    for n, p in gpu_init.items():  # uniform inits bit for bit, normal ones to float32's last bit
        torch.testing.assert_close(p, cpu_init[n], rtol=2**-22, atol=2**-30, msg=n)
    assert gpu == pytest.approx(cpu, rel=1e-4)
    assert len(set(cpu)) == STEPS


def test_attention_dropout_under_autocast_trains() -> None:
    """executor.rng runs SDPA with dropout as explicit ops; under CUDA's bf16 autocast the
    backward of its softmax failed ("expected input and grad types to match"), found by
    bench.gpu_step's dropout section.  The probabilities match the CPU's within bf16."""
    def attend(device: str) -> tuple[torch.Tensor, torch.Tensor]:
        rng.manual_seed(SEED)
        g = torch.Generator().manual_seed(3)
        q = torch.randn(2, 4, 64, 16, generator=g).to(device).requires_grad_()
        with torch.autocast(device, dtype=torch.bfloat16):
            out = F.scaled_dot_product_attention(q, q, q, dropout_p=0.1, is_causal=True)
        out.float().sum().backward()
        return out.float().cpu(), q.grad.cpu()

    (cpu_out, cpu_grad), (out, grad) = attend("cpu"), attend("cuda")
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(out, cpu_out, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(grad, cpu_grad, rtol=5e-2, atol=5e-2)

