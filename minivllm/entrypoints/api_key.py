"""The server's API key: `--api-key`, or else the `VLLM_API_KEY` environment variable.

vLLM reads both (`vllm/entrypoints/openai/api_server.py`: "Ensure --api-key option from CLI takes
precedence over VLLM_API_KEY"), so a deployment that sets only the variable is protected by either
server. When both are set, the flag's value is the key and the variable is ignored, as in vLLM. An
empty value counts as unset: an empty key would accept `Authorization: Bearer ` from anyone.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

API_KEY_ENV_VAR = "VLLM_API_KEY"


def resolve_api_key(flag_value: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """The key the server requires on /v1 (None: no key): the flag's, else the variable's."""
    environ = os.environ if environ is None else environ
    return flag_value or environ.get(API_KEY_ENV_VAR) or None
