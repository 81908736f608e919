"""The bounds on what a client may ask for, shared by the HTTP request model and the CLI.

One definition each, as pydantic types, so that ``meshplan plan`` refuses exactly what
``POST /v1/plans`` refuses.  This module imports only pydantic: the CLI checks its
arguments with it before importing torch.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, TypeAdapter, ValidationError

MAX_DEVICES = 1 << 20
MAX_BATCH_SIZE = 1 << 24
MAX_SEQ_LEN = 1 << 21
MAX_TIME_LIMIT_S = 600.0
# Objects and arrays inside an inline hf_config (the config itself is level 1).  Real
# configs nest 3 or 4 deep (text_config.rope_scaling); pydantic's serialiser gives up
# at about 255 levels, and the content address is computed by serialising the request.
MAX_HF_CONFIG_DEPTH = 32

# strict: JSON's true is not one device, nor 2.0 two.
Devices = Annotated[int, Field(strict=True, ge=1, le=MAX_DEVICES)]
BatchSize = Annotated[int, Field(strict=True, ge=1, le=MAX_BATCH_SIZE)]
SeqLen = Annotated[int, Field(strict=True, ge=1, le=MAX_SEQ_LEN)]
MeshDimName = Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]{0,15}$")]
MeshShape = Annotated[dict[MeshDimName, Devices], Field(max_length=8)]
# NaN compares false with every bound, so it is refused by name, not by "<= 600".
# strict: JSON's true is not 1 s, nor "5" five (strict floats still take integers).
TimeLimit = Annotated[float, Field(strict=True, gt=0, le=MAX_TIME_LIMIT_S, allow_inf_nan=False)]


def parse_text(kind: Any, text: str) -> Any:
    """``text`` (a command-line value) as ``kind``; ValueError with pydantic's message."""
    try:
        value = TypeAdapter(kind).validate_strings(text)
    except ValidationError as e:
        raise ValueError(f"{text!r}: {e.errors()[0]['msg']}") from None
    if type(value) is int and not text.strip().isdigit():  # string mode reads "2.0" as 2; JSON's 2.0 is refused
        raise ValueError(f"{text!r}: Input should be a valid integer")
    return value
