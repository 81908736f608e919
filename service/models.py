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
import math
from importlib import metadata, resources
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
)
from pydantic_core import PydanticCustomError

from cost_model.profile import shown
from planner.presets import DEFAULT_SEQ_LEN_CAP, PRESETS
from planner.search import default_shape
from service.limits import MAX_HF_CONFIG_DEPTH, BatchSize, Devices, MeshShape, SeqLen, TimeLimit

# The error type of a problem inside an inline JSON value.  Its ctx names the path below
# the field (``rms_norm_eps``), which service.app appends to the field's own path, so
# the client reads ``model.hf_config.rms_norm_eps: must be a finite number``.
JSON_VALUE_ERROR = "json_value"

# Config keys that make transformers look outside the config (remote code, hub
# kernels, quantisers), each with why it is refused.  load_config ignores most of them,
# but a server must not depend on that: they are refused before the planner sees the dict.
_REFUSED_HF_KEYS = {
    "auto_map": "it points at the model's own code, which the service never runs; remove it to plan "
                "transformers' built-in implementation of the model_type",
    "custom_pipelines": "it points at code, which the service never runs",
    "trust_remote_code": "the service never runs a model's own code",
    "quantization_config": "it loads a quantiser; remove it to plan the unquantised model",
    "attn_implementation": "it can load attention kernels from the Hub; the planner always uses SDPA",
}
# What save_pretrained and the Hub write beside the model's settings, which nothing reads
# when a model is built from the dict: dropped, so a config.json pastes as downloaded.
_METADATA_HF_KEYS = frozenset({"_name_or_path", "name_or_path", "_commit_hash", "_attn_implementation_autoset"})


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


_JSON_TYPE_NAMES = {type(None): "null", bool: "boolean", int: "integer", float: "number", str: "string",
                    list: "array", dict: "object"}


def json_type_name(value: Any) -> str:
    """``value``'s JSON type as a client wrote it (``integer``, ``array``, ...)."""
    return _JSON_TYPE_NAMES.get(type(value), type(value).__name__)


def _is_text(s: str) -> bool:
    """Whether ``s`` is Unicode text.  JSON's escapes can spell a lone UTF-16 surrogate
    (``"\\ud800"``), which Python's parser accepts but no UTF-8 encoder (pydantic's
    serialiser, SQLite) does."""
    try:
        s.encode()
    except UnicodeEncodeError:
        return False
    return True


def check_json_value(value: Any, max_depth: int) -> None:
    """Refuse what would make a parsed JSON value unusable as part of a request's content
    address or its stored copy: nesting deeper than ``max_depth`` (pydantic's serialiser
    fails on deep values with 'Circular reference detected'), NaN or infinities
    (serialised as null, so ``NaN`` and ``Infinity`` would be one request), and strings or
    keys that are not Unicode text (``_is_text``; a 500 from the store before).
    Iterative: a deep value must not exhaust the Python stack here either.  Raises
    PydanticCustomError JSON_VALUE_ERROR."""
    def refuse(path: tuple[str, ...], problem: str) -> PydanticCustomError:
        return PydanticCustomError(JSON_VALUE_ERROR, "{path}: {problem}",
                                   {"path": ".".join(map(shown, path)), "problem": problem})

    not_text = "not Unicode text (a lone UTF-16 surrogate escape, \\ud800-\\udfff)"
    stack: list[tuple[Any, tuple[str, ...], int]] = [(value, (), 1)]
    while stack:
        node, path, depth = stack.pop()
        if isinstance(node, float) and not math.isfinite(node):
            raise refuse(path, "must be a finite number")
        if isinstance(node, str) and not _is_text(node):
            raise refuse(path, not_text)
        children: list[tuple[str, Any]]
        if isinstance(node, dict):
            children = [(str(k), v) for k, v in node.items()]
            if not all(_is_text(k) for k, _ in children):  # named by its object: the key cannot be printed
                raise refuse(path, f"a key is {not_text}")
        elif isinstance(node, list):
            children = [(str(i), v) for i, v in enumerate(node)]
        else:
            continue
        if depth > max_depth:
            raise refuse((), f"nested too deeply (more than {max_depth} levels of objects and arrays)")
        # Reversed, so that the first problem in document order is the one reported.
        stack.extend((child, (*path, key), depth + 1) for key, child in reversed(children))


class HFConfigModel(_Request):
    hf_config: dict[str, Any] = Field(
        description="a Hugging Face config.json as an object; model_type must be supported")

    @field_validator("hf_config")
    @classmethod
    def _no_indirection(cls, value: dict[str, Any]) -> dict[str, Any]:
        value = {k: v for k, v in value.items() if k not in _METADATA_HF_KEYS}
        refused = [k for k in value if k in _REFUSED_HF_KEYS or k.startswith("_")]
        if refused:
            why = _REFUSED_HF_KEYS.get(refused[0], "keys starting with '_' set transformers' internal state")
            also = f" (also refused: {', '.join(map(shown, refused[1:]))})" if len(refused) > 1 else ""
            raise PydanticCustomError(JSON_VALUE_ERROR, "{path}: {problem}",
                                      {"path": shown(refused[0]), "problem": f"not accepted by the service: {why}{also}"})
        check_json_value(value, MAX_HF_CONFIG_DEPTH)
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
    devices: Devices = Field(examples=[64])
    profile: str | dict[str, Any] = Field(
        description="a shipped profile name (GET /v1/profiles) or an inline profile object",
        examples=["h100-sxm-80g"])
    batch_size: BatchSize | None = Field(
        default=None,
        description="global batch in sequences; default: one sequence per device")
    seq_len: SeqLen | None = Field(
        default=None,
        description=f"default: the model's maximum positions, capped at {DEFAULT_SEQ_LEN_CAP}")
    mesh: MeshShape | None = Field(
        default=None, description='force a mesh, e.g. {"dp": 8, "tp": 8}',
        examples=[{"dp": 8, "tp": 8}])
    time_limit_s: TimeLimit | None = Field(
        default=None, description="solver time limit in seconds; default: the server's --time-limit")

    # A value of neither branch's type is named here: the unions would answer with one
    # branch's complaint (or both, tagged 'str' and 'dict[str,any]'), which hides the other.
    @field_validator("model", mode="before")
    @classmethod
    def _model_shape(cls, value: Any) -> Any:
        if not isinstance(value, str | dict):
            raise ValueError(f'expected a preset name or {{"hf_config": {{...}}}}, got {json_type_name(value)}')
        return value

    @field_validator("profile", mode="before")
    @classmethod
    def _profile_shape(cls, value: Any) -> Any:
        if not isinstance(value, str | dict):
            raise ValueError(f"expected a shipped profile name or an inline profile object, "
                             f"got {json_type_name(value)}")
        if isinstance(value, dict):  # its JSON is hashed for the plan list's label
            check_json_value(value, MAX_HF_CONFIG_DEPTH)
        return value

    @field_validator("model")
    @classmethod
    def _preset_only(cls, value: str | HFConfigModel) -> str | HFConfigModel:
        if isinstance(value, str) and value not in PRESETS:
            raise ValueError(
                f"{shown(value, quote=True)} is not a preset ({', '.join(PRESETS)}); send {{\"hf_config\": {{...}}}} "
                "for another model (file paths are not accepted over HTTP)")
        return value

    def planner_model(self) -> str | dict[str, Any]:
        """What ``planner.plan`` is given as ``model``."""
        return self.model if isinstance(self.model, str) else self.model.hf_config

    def with_defaults(self, time_limit_s: float) -> PlanRequest:
        """The request with every default filled in (``time_limit_s``: the server's), so
        that requests that differ only by spelling a default out hash to the same plan.
        Filling batch_size or seq_len builds the model's config: call off the event loop."""
        update: dict[str, Any] = {"time_limit_s": self.time_limit_s or time_limit_s}
        if self.batch_size is None or self.seq_len is None:
            update["batch_size"], update["seq_len"] = default_shape(
                self.planner_model(), self.devices, self.batch_size, self.seq_len)
        return self.model_copy(update=update)

    def config_error(self, message: str) -> str:
        """A planner ConfigError's message at the request's path.  The planner names the
        keys of the config it was given (``model_type: ...``); a client sent them under
        ``model.hf_config``.  Lines naming a request field (``seq_len: ...``) stay."""
        if isinstance(self.model, str):
            return message
        lines = []
        for line in message.splitlines():
            field = line.partition(":")[0]
            if field == "model":
                line = "model.hf_config" + line.removeprefix("model")
            elif field not in type(self).model_fields:
                line = f"model.hf_config.{line}"
            lines.append(line)
        return "\n".join(lines)

    def key(self) -> str:
        """Content address of a (defaults-filled) request: canonical JSON and the planner's
        revision, sha256.  Validation keeps the request serialisable (check_json_value);
        should anything still fail to serialise, that is a ValueError naming the body,
        which the service answers with a 422, never a 500."""
        try:
            body = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        except (ValueError, TypeError, RecursionError) as e:  # pydantic_core's errors are ValueErrors
            raise ValueError(f"body: the request cannot be serialised as canonical JSON ({e})") from None
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
