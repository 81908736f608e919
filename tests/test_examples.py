"""examples/train.py as a user runs it: under torchrun on 2 gloo processes, and as the
1-device reference with plain python; the losses must agree, dropout on."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import planner

EXAMPLE = Path(__file__).parents[1] / "examples" / "train.py"
SHAPE = {"batch_size": 8, "seq_len": 64}


def _losses(argv: list[str], cwd: Path) -> list[float]:
    run = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return [float(x) for x in re.findall(r"^step \d+ loss (\S+)$", run.stdout, re.MULTILINE)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[float]]:
    tmp = tmp_path_factory.mktemp("example")
    for n in (1, 2):
        plan = planner.plan("llama-tiny", n, "cpu-gloo-local", mesh={"dp": 1, "tp": n} if n > 1 else None,
                            **SHAPE)
        (tmp / f"plan{n}.json").write_text(plan.to_json())
    steps = ["--steps", "3"]
    return {
        "torchrun": _losses([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc_per_node", "2", str(EXAMPLE), "plan2.json", *steps,
                             "--save", str(tmp / "ckpt")], tmp),
        "single": _losses([sys.executable, str(EXAMPLE), "plan1.json", *steps], tmp),
    }


def test_torchrun_needs_no_process_group_set_up(runs: dict[str, list[float]]) -> None:
    """The loop has no init_process_group: executor.apply initialises torchrun's group."""
    assert len(runs["torchrun"]) == 3


def test_two_processes_reproduce_the_single_device_losses(runs: dict[str, list[float]]) -> None:
    assert len(runs["single"]) == 3
    assert runs["torchrun"] == pytest.approx(runs["single"], rel=1e-5, abs=0)
    # dropout is on, so a run whose masks differed from the reference would not match;
    # and the steps do train: the losses are not one number repeated
    assert len(set(runs["single"])) == 3
