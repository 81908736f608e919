"""Pipeline plans (executor.pipeline): N-rank pipelined training equals the single-device run.

Plans come from the planner (a 4-layer tiny Llama with attention dropout, forced
``pp x dp`` meshes); the schedule, FSDP and activation checkpointing variants are the
same plan with those fields changed, as a user may.  Each world size runs all its
scenarios in one job on the shared gloo rank pool (tests/_dist.py); the reference is
the same loop in this process, with no process group.
"""

from __future__ import annotations

import math
import random
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _dist import Collectives, pipeline_variant, run_on_ranks
from torch import nn
from torch.distributed.tensor import DTensor

import executor
import planner
from cost_model.step import fsdp_step_gathers
from executor import pipeline
from executor.pipeline import PipelineError
from planner.presets import PRESETS, build_model, load_config
from planner.schema import Plan

STEPS, SAVE_AT = 5, 3
BATCH, SEQ = 8, 16
SEED = 1234
CONFIG = {**PRESETS["llama-tiny"], "num_hidden_layers": 4, "attention_dropout": 0.1}


def build(device: str = "cpu") -> nn.Module:
    return build_model(load_config(CONFIG), device=device).train()


def batches() -> list[torch.Tensor]:
    with executor.rng.suspended():
        g = torch.Generator().manual_seed(7)
        return [torch.randint(0, 128, (BATCH, SEQ), generator=g) for _ in range(STEPS)]


def _ignoring_row_tails(ids: torch.Tensor) -> torch.Tensor:
    """Labels whose row i ignores its last i tokens (-100): micro-batches and
    data-parallel slices count different numbers of tokens, and the step's loss must
    still be the global mean token loss."""
    return ids.masked_fill(torch.arange(SEQ) >= SEQ - torch.arange(BATCH)[:, None], -100)


def _full(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone() for n, t in tensors.items()}


def train(plan_json: str, save_to: str | None = None, resume_from: str | None = None,
          accumulate: bool = False, from_pretrained: bool = False) -> dict[str, Any]:
    """The user's loop, unchanged between 1 device and a pipeline: seed, apply, AdamW.

    ``save_to`` checkpoints after SAVE_AT steps; ``resume_from`` loads such a checkpoint
    and runs the remaining steps.  ``accumulate``: two batches per optimizer step, each
    loss divided by 2 (gradient accumulation as HF's Trainer writes it).
    ``from_pretrained``: the model built on the meta device and handed over in eval
    mode, as ``from_pretrained`` returns it; the loop calls ``model.train()``."""
    data = batches()
    executor.rng.manual_seed(SEED)
    plan = Plan.from_json(plan_json)
    model = executor.apply(plan, build("meta").eval() if from_pretrained else build())
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    out: dict[str, Any] = {"losses": {}}
    start = executor.load(resume_from, model=model, optimizer=opt) if resume_from else 0
    if resume_from:
        out["loaded"] = _full(dict(model.named_parameters()))
    for step in range(start, STEPS):
        with Collectives("c10d") as comm:  # FSDP2's all-gathers
            for ids in (data[step], data[(step + 1) % STEPS]) if accumulate else (data[step],):
                loss = model(input_ids=ids, labels=_ignoring_row_tails(ids)).loss
                (loss / 2 if accumulate else loss).backward()
        if step == start + 1:  # after the first step's lazy initialisation
            out["gathers"] = comm.counts["_allgather_base_"]
        opt.step()
        opt.zero_grad()
        out["losses"][step] = loss.item()
        if step + 1 == SAVE_AT and save_to is not None:
            executor.save(save_to, model=model, optimizer=opt, step=SAVE_AT)
            out["saved"] = _full(dict(model.named_parameters()))
    out["params"] = _full(dict(model.named_parameters()))
    out["dtensors"] = {n for n, p in model.named_parameters() if isinstance(p, DTensor)}
    out["counter"] = executor.rng.get_state()["counter"]
    if save_to is not None and plan.pipeline is not None:
        with pytest.raises(PipelineError) as e:
            model(input_ids=data[0])
        out["no_labels"] = str(e.value)
        step = model(input_ids=data[0], labels=data[0])  # its loss is never backpropagated: no gradient
        with pytest.raises(AttributeError) as e:
            getattr(step, "logits")  # noqa: B009 (the read is the test)
        out["logits"] = str(e.value)
        model.eval()
        with pytest.raises(PipelineError) as e:
            model(input_ids=data[0], labels=data[0])
        out["eval"] = str(e.value)
        model.train()
        model.model.layers[0].eval()  # a submodule frozen in eval mode (stage 0's, a stand-in on stage 1)
        with pytest.raises(PipelineError) as e:
            model(input_ids=data[0], labels=data[0])
        out["frozen"] = str(e.value)
        model.train()
        for name, mode in (("no_grad", torch.no_grad), ("inference_mode", torch.inference_mode)):
            with pytest.raises(PipelineError) as e, mode():
                model(input_ids=data[0], labels=data[0])
            out[name] = str(e.value)
        vocab = model.config.vocab_size
        for what, (ids, labels) in {"shape": (data[0], data[0][:, 1:]), "dtype": (data[0], data[0].int()),
                                    "id": (torch.full_like(data[0], vocab), data[0])}.items():
            with pytest.raises(executor.BatchError) as e:
                model(input_ids=ids, labels=labels)
            out[f"bad {what}"] = str(e.value)
        with pytest.raises(executor.PlanError) as e:
            model.save_pretrained(f"{save_to}-hf")
        out["save_pretrained"] = str(e.value)
    return out


def on_ranks(plans: dict[str, str], saver: str | None, root: str | None) -> dict[str, Any]:
    """Every scenario; ``saver`` also checkpoints into ``root/ckpt`` on the way, resumes
    from its own checkpoint and from the single-device run's ``root/ckpt1``, and trains
    with gradient accumulation."""
    out = {name: train(plan, save_to=f"{root}/ckpt" if name == saver else None,
                       from_pretrained=name in FROM_PRETRAINED) for name, plan in plans.items()}
    if saver is not None:
        out["resumed"] = train(plans[saver], resume_from=f"{root}/ckpt1")
        out["resumed_own"] = train(plans[saver], resume_from=f"{root}/ckpt")
        out["accumulated"] = train(plans[saver], accumulate=True)
        out["seeded_late"] = _seeded_after_apply(plans[saver])
    return out


def _seeded_after_apply(plan_json: str) -> str:
    """The error of a pipeline step whose loop seeds after apply, which counted no draws."""
    executor.rng.deactivate()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # apply's "executor.rng is not seeded"
        model = executor.apply(Plan.from_json(plan_json), build())
    executor.rng.manual_seed(SEED)
    try:
        model(input_ids=batches()[0], labels=batches()[0])
    except PipelineError as e:
        return str(e)
    return "no error"


def _planned(mesh: dict[str, int]) -> Plan:
    return planner.plan(CONFIG, devices=math.prod(mesh.values()), profile="cpu-gloo-local", batch_size=BATCH, seq_len=SEQ,
                        mesh=mesh)


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    return {"pp2": _planned({"pp": 2}), "pp2xdp2": _planned({"pp": 2, "dp": 2})}


def test_planner_cuts_contiguous_stages(plans: dict[str, Plan]) -> None:
    """What the variants below start from: two per-rank stages, each a contiguous run of
    layers (how many each is the cost model's call), embedding first and head last."""
    for plan in plans.values():
        first, last = (s.modules for s in plan.pipeline.stages)
        layers = [m for m in first + last if m.startswith("model.layers.")]
        assert layers == [f"model.layers.{i}" for i in range(4)]
        assert first[:2] == ["model.embed_tokens", "model.rotary_emb"] and "model.layers.0" in first
        assert last[-2:] == ["model.norm", "lm_head"] and "model.layers.3" in last


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("pp-ckpt"))


@pytest.fixture(scope="module")
def reference(root: str) -> dict[str, Any]:
    """One device, no process group; checkpoints into ``root/ckpt1`` on the way."""
    one = planner.plan(CONFIG, devices=1, profile="cpu-gloo-local", batch_size=BATCH, seq_len=SEQ)
    try:
        return {"plan": one.to_json(), **train(one.to_json(), save_to=f"{root}/ckpt1"),
                "accumulated": train(one.to_json(), accumulate=True)}
    finally:
        executor.rng.deactivate()  # leave other test modules with torch's own RNG


WORLD2 = {"gpipe": ("pp2", "gpipe", "replicate", "none"),
          "1f1b-full-recompute": ("pp2", "1f1b", "replicate", "full"),
          "interleaved": ("pp2", "interleaved-1f1b", "replicate", "none")}
SAVER = "1f1b-full-recompute"
# the README's path: built on the meta device, in eval mode as from_pretrained returns it
WORLD2["1f1b-from-pretrained"] = ("pp2", "1f1b", "replicate", "none")
FROM_PRETRAINED = {"1f1b-from-pretrained"}
# Replicate (HSDP through FSDP2) with interleaving: two FSDP stage roots per rank.
WORLD4 = {"fsdp-1f1b": ("pp2xdp2", "1f1b", "fully_shard", "none"),
          "replicate-interleaved-selective-recompute": ("pp2xdp2", "interleaved-1f1b", "replicate", "selective"),
          "tp-1f1b-full-recompute": ("pp2xdp2", "1f1b", "tp", "full")}


def _merged(results: list[dict[str, Any]], name: str, key: str) -> dict[str, torch.Tensor]:
    """Every stage's parameters (each rank holds its stages' only)."""
    out: dict[str, torch.Tensor] = {}
    for r in results:
        out.update(r[name][key])
    return out


@pytest.fixture(scope="module")
def world2(plans: dict[str, Plan], root: str, reference: dict[str, Any]) -> dict[str, Any]:
    jobs = {name: pipeline_variant(plans[p], s, f, c) for name, (p, s, f, c) in WORLD2.items()}
    return {"root": root, "ranks": run_on_ranks(2, on_ranks, jobs, SAVER, root)}


@pytest.fixture(scope="module")
def world4(plans: dict[str, Plan]) -> list[dict[str, Any]]:
    jobs = {name: pipeline_variant(plans[p], s, f, c) for name, (p, s, f, c) in WORLD4.items()}
    return run_on_ranks(4, on_ranks, jobs, None, None)


def _assert_matches(results: list[dict[str, Any]], name: str, ref: dict[str, Any]) -> None:
    for r in results:  # every rank reports the step's loss
        torch.testing.assert_close(torch.tensor(list(r[name]["losses"].values())),
                                   torch.tensor(list(ref["losses"].values())), rtol=1e-5, atol=0)
        assert r[name]["counter"] == ref["counter"]  # the next step draws what one device draws
    params = _merged(results, name, "params")
    assert params.keys() == ref["params"].keys()
    for n, value in params.items():
        torch.testing.assert_close(value, ref["params"][n], rtol=1e-5, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("name", list(WORLD2))
def test_two_stages_match_single_device(name: str, world2: dict, reference: dict) -> None:
    _assert_matches(world2["ranks"], name, reference)


@pytest.mark.parametrize("name", list(WORLD4))
def test_two_stages_by_two_data_parallel_match_single_device(name: str, world4: list, reference: dict) -> None:
    _assert_matches(world4, name, reference)


def test_fully_sharded_stages_gather_what_the_cost_model_charges(plans: dict[str, Plan], world4: list) -> None:
    """Each step's FSDP2 all-gathers on each rank of fully sharded pp2 x dp2, 1F1B: the
    stage's last block and root gather once, every other block m + 1 times (torch's
    schedules keep units gathered after every backward but the last), as
    ``cost_model.step.fsdp_gathers`` counts them (it counted 2m for every unit)."""
    plan = Plan.from_json(pipeline_variant(plans["pp2xdp2"], *WORLD4["fsdp-1f1b"][1:]))
    assert plan.microbatches > 1
    for rank, result in enumerate(world4):
        stage = plan.pipeline.stages[rank // 2]  # pp is the outer mesh dim
        layers = sum(m.startswith("model.layers.") for m in stage.modules)
        assert result["fsdp-1f1b"]["gathers"] == fsdp_step_gathers(plan.microbatches, True, layers, kept_layers=1)


def test_each_rank_holds_only_its_stages(world2: dict) -> None:
    first, last = (set(r["gpipe"]["params"]) for r in world2["ranks"])
    assert "model.embed_tokens.weight" in first and "lm_head.weight" in last
    assert not first & last


def test_stages_are_sharded_as_planned(world4: list) -> None:
    """The variants above really shard: FSDP and tensor parallelism make DTensor parameters."""
    assert all("model.layers.0.self_attn.q_proj.weight" in world4[r]["tp-1f1b-full-recompute"]["dtensors"]
               for r in (0, 1))
    assert all("lm_head.weight" in world4[r]["fsdp-1f1b"]["dtensors"] for r in (2, 3))


def test_pp2_checkpoint_loads_with_pp1(world2: dict, reference: dict) -> None:
    """Saved by two stages, loaded by one process with a 1-device plan: the same state, bit for
    bit, and the run goes on with the pipeline's next losses."""
    ranks = world2["ranks"]
    try:
        resumed = train(reference["plan"], resume_from=f"{world2['root']}/ckpt")
    finally:
        executor.rng.deactivate()
    saved = _merged(ranks, SAVER, "saved")
    assert resumed["loaded"].keys() == saved.keys()
    for n, value in resumed["loaded"].items():
        assert torch.equal(value, saved[n]), n
    for step in range(SAVE_AT, STEPS):
        assert resumed["losses"][step] == pytest.approx(ranks[0][SAVER]["losses"][step], rel=1e-5)


def test_save_pretrained_is_refused_and_the_export_it_names_works(world2: dict, tmp_path) -> None:
    """On a stage's rank save_pretrained wrote that stage's tensors only; the error's recipe
    (executor.save, load into a plain model, save_pretrained) gives the whole trained model."""
    ranks = world2["ranks"]
    assert ranks[0][SAVER]["save_pretrained"].startswith(
        "save_pretrained: under a 2-device plan each rank holds its shards or stages of the model only")
    plain = build()
    try:
        executor.load(f"{world2['root']}/ckpt", model=plain)
    finally:
        executor.rng.deactivate()  # the load restored the run's rng state
    plain.save_pretrained(tmp_path / "hf")
    exported = type(plain).from_pretrained(tmp_path / "hf")
    saved = _merged(ranks, SAVER, "saved")
    assert {n for n, _ in exported.named_parameters()} == saved.keys()
    for n, p in exported.named_parameters():
        assert torch.equal(p.detach(), saved[n]), n


def test_pp1_checkpoint_loads_with_pp2(world2: dict, reference: dict) -> None:
    """The other way round: two stages resume the single-device run."""
    ranks = world2["ranks"]
    loaded = _merged(ranks, "resumed", "loaded")
    assert loaded.keys() == reference["saved"].keys()
    for n, value in loaded.items():
        assert torch.equal(value, reference["saved"][n]), n
    for r in ranks:
        for step in range(SAVE_AT, STEPS):
            assert r["resumed"]["losses"][step] == pytest.approx(reference["losses"][step], rel=1e-5)


def test_pp2_checkpoint_resumes_pp2(world2: dict, reference: dict) -> None:
    """Two stages resume their own checkpoint: each rank's optimizer finds its parameters'
    hyperparameters (unflattened, DCP kept one rank's parameter group and the other rank's
    AdamW step failed on a group without betas)."""
    for r in world2["ranks"]:
        for step in range(SAVE_AT, STEPS):
            assert r["resumed_own"]["losses"][step] == pytest.approx(reference["losses"][step], rel=1e-5)


def test_gradient_accumulation_matches_single_device(world2: dict, reference: dict) -> None:
    """Two forward + backward calls per optimizer step, each loss / 2: the schedule's
    gradient scaling divided the earlier call's gradients too, and the returned loss
    was a leaf, so ``/ 2`` changed nothing."""
    for r in world2["ranks"]:
        torch.testing.assert_close(torch.tensor(list(r["accumulated"]["losses"].values())),
                                   torch.tensor(list(reference["accumulated"]["losses"].values())),
                                   rtol=1e-5, atol=0)
    params = _merged(world2["ranks"], "accumulated", "params")
    for n, value in params.items():
        torch.testing.assert_close(value, reference["accumulated"]["params"][n], rtol=1e-5, atol=1e-5)


def test_accumulation_scales_only_what_each_call_computed() -> None:
    """The arithmetic of ``loss / k`` over accumulated calls, on the step's gradient
    holder (shared by pipeline steps and micro-batches without a pipeline): a parameter
    with no gradient in a call (an expert no token reached) keeps the earlier calls'
    gradient unscaled, a large scale (GradScaler's 65536) is exact, another term of the
    loss (a penalty on the weights) adds its gradient unscaled by the step's (it was
    scaled with them when the step's gradients were added at the forward), and a call
    whose loss is never backpropagated adds nothing."""
    from executor.accumulate import StepGradients

    used, expert = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(3))
    held_grads = StepGradients([used, expert], PipelineError)

    def step(grads: list[torch.Tensor | None]) -> torch.Tensor:
        held_grads.begin()
        for p, g in zip(held_grads.params, grads, strict=True):  # what the step's backward leaves
            p.grad = g
        return held_grads.end(torch.tensor(1.0))

    def call(grads: list[torch.Tensor | None], scale: float) -> None:
        (step(grads) * scale).backward()

    call([torch.ones(3), torch.ones(3)], 0.5)
    call([torch.ones(3), None], 0.5)
    assert torch.equal(used.grad, torch.ones(3)) and torch.equal(expert.grad, torch.full((3,), 0.5))
    penalty = (step([torch.ones(3), torch.ones(3)]) + (used ** 2).sum() / 2) * 0.5  # + 0.5 x used
    used.data = torch.full((3,), 4.0)
    penalty.backward()
    assert torch.equal(used.grad, torch.full((3,), 3.5)) and torch.equal(expert.grad, torch.ones(3))
    step([torch.ones(3), torch.ones(3)])  # a forward without backward adds nothing
    assert torch.equal(used.grad, torch.full((3,), 3.5)) and torch.equal(expert.grad, torch.ones(3))
    first, second = (torch.randn(1000, generator=torch.Generator().manual_seed(seed)) for seed in (0, 1))
    held_grads.params, used.grad = [used], None
    used.data = torch.zeros(1000)
    call([first.clone()], 65536.0)
    call([second.clone()], 65536.0)
    # within float32 rounding of values of ~65536 (a sum that nearly cancels has no small
    # relative error to keep); the cancellation was off by ~65536 x the earlier gradient
    torch.testing.assert_close(used.grad, 65536.0 * first + 65536.0 * second, rtol=1e-6, atol=65536.0 * 1e-6)
    held = used.grad  # zero_grad(set_to_none=False): the same tensor through later steps
    held.zero_()
    call([first.clone()], 1.0)
    call([second.clone()], 0.5)
    assert used.grad is held
    torch.testing.assert_close(held, first + 0.5 * second, rtol=1e-6, atol=1e-6)
    before = held.clone()
    unscaled = step([first.clone()])  # a step whose loss is not backpropagated yet ...
    pending = held_grads.begin()  # ... then a step that fails: the gradients held before it stay
    used.grad = torch.ones(1000)
    held_grads.abort(pending)
    assert used.grad is held
    (unscaled * 0.5).backward()  # and the step before it still adds its gradients
    torch.testing.assert_close(held, before + 0.5 * first, rtol=1e-6, atol=1e-6)
    with pytest.raises(PipelineError, match=r"^loss\.backward\(\): the model's forward already ran"):
        unscaled.backward()  # once


def test_forward_without_labels_or_in_eval_mode_says_why(world2: dict) -> None:
    ranks = world2["ranks"]
    assert ranks[0][SAVER]["no_labels"].startswith(
        "labels: under a pipeline plan the model's forward runs a whole training step")
    assert ranks[0][SAVER]["eval"].startswith("model.eval(): under a pipeline plan the forward runs a training step")
    assert ranks[0][SAVER]["logits"].startswith("logits: a pipeline's training step keeps no logits")  # was None
    for r in ranks:  # was: the step set it training again, and its dropout drew
        assert r[SAVER]["frozen"].startswith("model.layers.0: in eval mode while the model trains")
    assert ranks[0][SAVER]["no_grad"].startswith("torch.no_grad: a pipelined forward runs backward too")
    assert ranks[0][SAVER]["inference_mode"].startswith("torch.inference_mode: a pipelined forward")  # said no_grad
    # on every rank: only the stage meeting a bad tensor raised, the other waited in its
    # send or receive until the process group's timeout (audit, session 37)
    for r in ranks:
        assert r[SAVER]["bad shape"] == f"labels: shape [{BATCH}, {SEQ - 1}] differs from input_ids' [{BATCH}, {SEQ}]"
        assert r[SAVER]["bad dtype"] == ("labels: expected int64 (torch.long) token ids, as the loss takes, "
                                         "got torch.int32")
        assert r[SAVER]["bad id"].startswith("input_ids: token id ") and "is outside the vocabulary" in r[SAVER]["bad id"]


def test_batch_rows_draw_the_global_rows_in_any_order() -> None:
    """A micro-batch's dropout mask is its rows of the full batch's mask, whatever order
    the micro-batches run in."""
    try:
        executor.rng.manual_seed(5)
        x = torch.ones(8, 3, 4)
        full = F.dropout(x, 0.5)
        order = list(range(4))
        random.Random(0).shuffle(order)
        parts = {}
        for m in order:
            executor.rng.set_state({"seed": 5, "counter": 0})
            with executor.rng.batch_rows(2 * m, 2, 8):
                parts[m] = F.dropout(torch.ones(2, 3, 4), 0.5)
                untouched = F.dropout(torch.ones(3, 4), 0.5)  # no batch dim of 2 rows: global
        assert torch.equal(torch.cat([parts[m] for m in range(4)]), full)
        executor.rng.set_state({"seed": 5, "counter": 1})
        assert torch.equal(untouched, F.dropout(torch.ones(3, 4), 0.5))
    finally:
        executor.rng.deactivate()


# -- bad pipeline plans: refused, naming the field or FQN -----------------------------------

def _refused(plan: Plan) -> str:
    with pytest.raises(executor.PlanError) as e:
        executor.apply(plan, build())
    return str(e.value)


def test_stage_module_that_does_not_exist(plans: dict[str, Plan]) -> None:
    plan = plans["pp2"].model_copy(deep=True)
    plan.pipeline.stages[1].modules.append("model.layers.9")
    assert "pipeline.stages[1].modules: model.layers.9 is not a module of the model" in _refused(plan)


def test_stages_out_of_the_forward_order(plans: dict[str, Plan]) -> None:
    """Refused by order, not only where random draws betray it: with no dropout the
    swapped plan crashed inside torch and the one with the final norm in stage 0 trained
    silently wrong."""
    plan = plans["pp2"].model_copy(deep=True)
    plan.pipeline.schedule, plan.pipeline.virtual_stages = "1f1b", 1
    first, last = plan.pipeline.stages
    last.modules.remove("model.norm")
    first.modules.append("model.norm")
    # (the check itself: in apply the plan's 2 devices against this single process come first)
    cuts, problems = pipeline.check(plan, build_model(load_config({**CONFIG, "attention_dropout": 0.0})),
                                    dry_run=True)
    msg = "\n".join(problems)
    assert cuts is None and "pipeline.stages: the model's forward runs model.layers." in msg and "before model.norm (stage 0)" in msg


def test_a_cut_where_the_forward_changes_the_activation(plans: dict[str, Plan]) -> None:
    """A non-last stage sends its last module's output and the next stage hands it to
    its first module, so whatever the forward does in between would be skipped."""
    plan = plans["pp2"].model_copy(deep=True)
    plan.pipeline.schedule, plan.pipeline.virtual_stages = "1f1b", 1
    model = build_model(load_config({**CONFIG, "attention_dropout": 0.0}))
    first = plan.pipeline.stages[1].modules[0]
    model.get_submodule(first).register_forward_pre_hook(lambda m, args: (args[0] * 2.0, *args[1:]))
    cuts, problems = pipeline.check(plan, model, dry_run=True)
    assert cuts is None and problems == [
        f"pipeline.stages: the model's forward changes the activation between {plan.pipeline.stages[0].modules[-1]} "
        f"(stage 0) and {first} (stage 1); a stage boundary must fall where one module's output is the next "
        "one's input"]


def test_parameter_in_no_stage_and_in_two(plans: dict[str, Plan]) -> None:
    plan = plans["pp2"].model_copy(deep=True)
    plan.pipeline.schedule, plan.pipeline.virtual_stages = "1f1b", 1
    plan.pipeline.stages[1].modules.remove("lm_head")
    plan.pipeline.stages[1].modules.insert(0, "model.layers.1")
    msg = _refused(plan)
    assert "lm_head.weight: in no pipeline stage" in msg
    assert "model.layers.1.mlp.up_proj.weight: in pipeline stages [0, 1]" in msg


def test_interleaving_needs_layers_that_split_evenly(plans: dict[str, Plan]) -> None:
    plan = plans["pp2"].model_copy(deep=True)
    plan.pipeline.schedule, plan.pipeline.virtual_stages = "interleaved-1f1b", 2
    plan.pipeline.stages[0].modules.remove("model.layers.1")
    plan.pipeline.stages[1].modules.insert(0, "model.layers.1")
    assert "pipeline.stages[0]: 1 layers do not split into virtual_stages=2" in _refused(plan)


def test_virtual_stages_need_the_interleaved_schedule(plans: dict[str, Plan]) -> None:
    plan = plans["pp2"].model_copy(deep=True)
    plan.pipeline.schedule, plan.pipeline.virtual_stages = "1f1b", 2
    assert "pipeline.virtual_stages: 2 with schedule '1f1b'" in _refused(plan)
    plan.pipeline.schedule, plan.pipeline.virtual_stages = "interleaved-1f1b", 1  # was accepted (review)
    assert "pipeline.virtual_stages: 1 with schedule 'interleaved-1f1b'; interleaved-1f1b runs 2" in _refused(plan)


def test_a_loop_that_seeds_after_apply_is_told_to_seed_first(world2: dict) -> None:
    """apply counts each stage's draws only when seeded: seeded after it, every step redrew
    the first step's dropout masks and matched no single-device run (review)."""
    for rank in world2["ranks"]:
        assert rank["seeded_late"].startswith("executor.rng was seeded after executor.apply"), rank


def test_1f1b_needs_a_micro_batch_per_stage(plans: dict[str, Plan]) -> None:
    """Passed apply and failed in torch's schedule at the first step (review)."""
    plan = plans["pp2"].model_copy(deep=True)
    plan.pipeline.schedule, plan.pipeline.virtual_stages, plan.microbatches = "1f1b", 1, 1
    assert "microbatches: 1 with 1f1b on pp=2; the 1F1B schedule needs at least one micro-batch per stage" in _refused(plan)


def test_interleaved_micro_batches_come_in_rounds_of_pp(plans: dict[str, Plan]) -> None:
    plan = plans["pp2"].model_copy(deep=True)
    plan.pipeline.schedule, plan.pipeline.virtual_stages, plan.microbatches = "interleaved-1f1b", 2, 3
    assert "microbatches: 3 with interleaved-1f1b on pp=2" in _refused(plan)


@pytest.mark.parametrize(
    "layers, layout, message",
    [
        (4, dict(virtual_stages=4, microbatches=2),
         "virtual_stages: pp*virtual_stages=8 exceeds the model's 4 layers"),
        (5, dict(virtual_stages=2, microbatches=2), "virtual_stages: 2 does not divide the model's 5 layers"),
        (4, dict(virtual_stages=2, microbatches=3), "microbatches: 3 is not divisible by pp=2"),
        # one stage per rank interleaves nothing (was accepted, audit)
        (4, dict(virtual_stages=1, microbatches=2), "virtual_stages: interleaved-1f1b needs at least 2 stages per rank"),
    ],
)
def test_hand_layouts_the_executor_cannot_schedule_name_the_field(layers: int, layout: dict, message: str) -> None:
    """The executor's rules (above) refused by the planner, not reported as memory."""
    config = {**CONFIG, "num_hidden_layers": layers}
    with pytest.raises(planner.PlanningError) as e:
        planner.estimate(config, 2, "cpu-gloo-local", pp=2, schedule="interleaved-1f1b",
                         batch_size=6 if layout["microbatches"] == 3 else BATCH, seq_len=SEQ, **layout)
    assert str(e.value).startswith(message)


def test_interleaving_a_hand_layout_that_splits_evenly() -> None:
    plan = planner.hand_plan(CONFIG, 2, "cpu-gloo-local", pp=2, schedule="interleaved-1f1b", virtual_stages=2,
                             microbatches=2, batch_size=BATCH, seq_len=SEQ)
    assert plan.pipeline.schedule == "interleaved-1f1b" and plan.pipeline.virtual_stages == 2
    with pytest.raises(planner.PlanningError, match="^virtual_stages: 2 needs a pipeline"):
        planner.estimate(CONFIG, 1, "cpu-gloo-local", schedule="interleaved-1f1b", virtual_stages=2,
                         batch_size=BATCH, seq_len=SEQ)


def test_sharding_on_the_pipeline_dim_is_refused(plans: dict[str, Plan]) -> None:
    plan = plans["pp2"].model_copy(deep=True)
    plan.parameters[0].placements[0] = "S(0)"
    assert f"{plan.parameters[0].fqn}: S(0) on pipeline dim 'pp'" in _refused(plan)


def test_position_embeddings_and_ties_across_stages_are_refused(plans: dict[str, Plan]) -> None:
    """GPT-2: later stages start from inputs_embeds=, which would skip its learned position
    embedding; and its head is tied to the token embedding on another stage."""
    plan = plans["pp2"].model_copy(deep=True)
    plan.pipeline.schedule, plan.pipeline.virtual_stages = "1f1b", 1
    plan.pipeline.stages[0].modules = ["transformer.wte", "transformer.wpe", "transformer.h.0"]
    plan.pipeline.stages[1].modules = ["transformer.h.1", "transformer.ln_f", "lm_head"]
    with pytest.raises(executor.PlanError) as e:
        executor.apply(plan, build_model(load_config("gpt2-tiny"), device="meta"))
    assert "pipeline.stages[0].modules: transformer.wpe holds parameters before the first layer" in str(e.value)
    assert "lm_head.weight: tied to transformer.wte.weight (stage 0) but in stage 1" in str(e.value)


def batches_per_rank(plans: dict[str, str]) -> dict[str, str]:
    """Each rank passes its own batch, as a loop written for DDP does (a DistributedSampler):
    other token ids, or fewer rows on rank 1."""
    rank = torch.distributed.get_rank()
    out = {}
    for name, plan_json in plans.items():
        for what, ids in (("values", torch.full((BATCH, SEQ), rank)),
                          ("shapes", torch.zeros(BATCH - 2 * rank, SEQ, dtype=torch.long))):
            executor.rng.manual_seed(SEED)
            model = executor.apply(Plan.from_json(plan_json), build())
            try:
                model(input_ids=ids, labels=ids).loss.backward()
                out[f"{name} {what}"] = "no error"
            except executor.BatchError as e:
                out[f"{name} {what}"] = str(e)
    executor.rng.deactivate()
    return out


def test_ranks_given_different_batches_are_told_so() -> None:
    """A loop that gives each rank its own batch trained on the wrong rows without a word
    (data-parallel ranks slicing their own batch again, tensor-parallel ranks computing
    on different inputs), and a pipeline whose ranks' shapes differed died in gloo's
    abort.  Every rank now raises the same BatchError at the first call, with micro-batches
    too, before a rank whose batch does not split into them refuses it alone (review: the
    other rank waited in the check's all-reduce)."""
    layouts = {"fsdp": {"dp": 2, "fsdp": True}, "tp": {"tp": 2}, "pp": {"pp": 2, "microbatches": 2},
               "parts": {"dp": 2, "fsdp": True, "microbatches": 2}}
    plans = {name: planner.hand_plan(CONFIG, 2, "cpu-gloo-local", batch_size=BATCH, seq_len=SEQ,
                                     **layout).to_json() for name, layout in layouts.items()}
    results = run_on_ranks(2, batches_per_rank, plans)
    assert results[0] == results[1]
    for key, message in results[0].items():
        what = key.split()[1]
        assert message.startswith(f"batch: the ranks were given batches of different {what}; every rank "
                                  "passes the same global batch"), (key, message)
