"""HTTP request/response models of the planner service.

The request model is where untrusted input stops: a model is named by preset only
(never a path: the server must not read files a client names) or sent inline as a
Hugging Face config dict; a profile is a shipped name or an inline dict.  Everything
else the planner validates itself and reports as a ``ValueError`` naming the field.
"""

from __future__ import annotations

import functools
import hashlib
import json
from importlib import metadata, resources
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StringConstraints,
    Tag,
    field_validator,
)

from planner.presets import PRESETS
from planner.search import DEFAULT_SEQ_LEN_CAP, default_shape

MAX_DEVICES = 1 << 20
MAX_BATCH_SIZE = 1 << 24
MAX_SEQ_LEN = 1 << 21
MAX_TIME_LIMIT_S = 600.0

# Config keys that make transformers look outside the config (remote code, hub
# kernels, quantisers, files).  load_config ignores most of them, but a server
# must not depend on that: they are refused before the planner sees the dict.
_FORBIDDEN_HF_KEYS = frozenset({
    "auto_map", "trust_remote_code", "quantization_config", "attn_implementation",
    "name_or_path", "_name_or_path", "_commit_hash", "custom_pipelines",
})

MeshDimName = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_]{0,15}$")]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class HFConfigModel(_Request):
    hf_config: dict[str, Any] = Field(
        description="a Hugging Face config.json as an object; model_type must be supported")

    @field_validator("hf_config")
    @classmethod
    def _no_indirection(cls, value: dict[str, Any]) -> dict[str, Any]:
        bad = sorted(k for k in value if k in _FORBIDDEN_HF_KEYS or k.startswith("_"))
        if bad:
            raise ValueError(f"keys {bad} are not accepted by the service (they load code or files)")
        return value


# Chosen by the value's type, so a bad value gets the errors of one branch, not both.
ModelSpec = Annotated[
    Annotated[str, Tag("preset")] | Annotated[HFConfigModel, Tag("hf_config")],
    Discriminator(lambda v: "preset" if isinstance(v, str) else "hf_config"),
]


class PlanRequest(_Request):
    model: ModelSpec = Field(
        description=f"a preset name ({', '.join(PRESETS)}) or {{\"hf_config\": {{...}}}}",
        examples=["llama3-8b"])
    devices: int = Field(ge=1, le=MAX_DEVICES, examples=[64])
    profile: str | dict[str, Any] = Field(
        description="a shipped profile name (GET /v1/profiles) or an inline profile object",
        examples=["h100-sxm-80g"])
    batch_size: int | None = Field(
        default=None, ge=1, le=MAX_BATCH_SIZE,
        description="global batch in sequences; default: one sequence per device")
    seq_len: int | None = Field(
        default=None, ge=1, le=MAX_SEQ_LEN,
        description=f"default: the model's maximum positions, capped at {DEFAULT_SEQ_LEN_CAP}")
    mesh: dict[MeshDimName, Annotated[int, Field(ge=1, le=MAX_DEVICES)]] | None = Field(
        default=None, max_length=8, description='force a mesh, e.g. {"dp": 8, "tp": 8}',
        examples=[{"dp": 8, "tp": 8}])
    time_limit_s: float | None = Field(
        default=None, gt=0, le=MAX_TIME_LIMIT_S, description="solver time limit in seconds")

    @field_validator("model")
    @classmethod
    def _preset_only(cls, value: str | HFConfigModel) -> str | HFConfigModel:
        if isinstance(value, str) and value not in PRESETS:
            raise ValueError(
                f"{value!r} is not a preset ({', '.join(PRESETS)}); send {{\"hf_config\": {{...}}}} "
                "for another model (file paths are not accepted over HTTP)")
        return value

    def planner_model(self) -> str | dict[str, Any]:
        """What ``planner.plan`` is given as ``model``."""
        return self.model if isinstance(self.model, str) else self.model.hf_config

    def with_defaults(self) -> PlanRequest:
        """The request with batch_size and seq_len filled in, so that requests that differ
        only by spelling a default out hash to the same plan."""
        if self.batch_size is not None and self.seq_len is not None:
            return self
        batch, seq = default_shape(self.planner_model(), self.devices, self.batch_size, self.seq_len)
        return self.model_copy(update={"batch_size": batch, "seq_len": seq})

    def key(self) -> str:
        """Content address of a (defaults-filled) request: canonical JSON and the planner's
        revision, sha256."""
        body = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(f"{planner_revision()}\n{body}".encode()).hexdigest()


@functools.cache
def planner_revision() -> str:
    """Digest of what a plan is computed from besides the request: the planner's and the
    cost model's code, the shipped profiles, and the torch and transformers versions
    (the traced graphs).  A stored plan answers an identical request only while they are
    unchanged, so an upgraded planner plans afresh instead of serving the old one's
    predictions (the old plans stay listed, under their own ids)."""
    digest = hashlib.sha256()
    for package in ("planner", "cost_model", "profiles"):
        root = Path(str(resources.files(package)))
        for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".json")):
            digest.update(path.relative_to(root).as_posix().encode())
            digest.update(path.read_bytes())
    for dist in ("torch", "transformers"):
        digest.update(f"{dist}=={metadata.version(dist)}".encode())
    return digest.hexdigest()


class StoredPlanResponse(BaseModel):
    id: str
    created: float = Field(description="Unix time the plan was stored")
    plan: dict[str, Any] = Field(description="the plan; its JSON Schema is `meshplan schema`")


class PlanResponse(StoredPlanResponse):
    cached: bool = Field(description="true when the plan came from the store without solving")


class PlanSummary(BaseModel):
    id: str
    model: str
    devices: int
    profile: str
    created: float = Field(description="Unix time")
    step_time_s: float = Field(description="predicted step time")
    mesh: dict[str, int]


class PlanList(BaseModel):
    plans: list[PlanSummary]
    total: int


class ProfileList(BaseModel):
    profiles: list[str]


class Health(BaseModel):
    status: str
    workers: int
    busy_workers: int
    solves: int = Field(description="plans solved (or attempted) since the server started")


class ErrorResponse(BaseModel):
    detail: str = Field(description="'field: problem', one line per problem")
