"""The trainer's side of a served rollout: is the server running our execution contract?

An RL framework that samples through ``unified-models serve`` compares the server's contract
fingerprint with its trainer's before it trusts the returned logprobs::

    from unified_models.serving.client import check_server_contract
    check_server_contract("http://127.0.0.1:8000", trainer.contract_fingerprint())

The request goes through the standard library's ``urllib`` (the server is vLLM's own).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from ..consistency.fingerprint import Fingerprint, compare
from ..dsl import UnifiedModelsError

__all__ = ["server_fingerprint", "check_server_contract"]


def server_fingerprint(base_url: str, *, timeout_s: float = 120.0) -> Fingerprint:
    """The contract fingerprint of the engine behind ``base_url`` (``GET /unified_models/fingerprint``).

    Args:
        base_url: the server's root, e.g. ``http://127.0.0.1:8000`` (no ``/v1``).
        timeout_s: seconds to wait for the answer.

    Raises:
        UnifiedModelsError: the server is unreachable, is not ``unified-models serve`` (no such
            route), or its worker could not compute the fingerprint (its error text).
    """
    from .serve import FINGERPRINT_ROUTE

    url = base_url.rstrip("/") + FINGERPRINT_ROUTE
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            body = json.loads(r.read())
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:500]
        hint = " (not a `unified-models serve` server?)" if e.code == 404 else ""
        raise UnifiedModelsError(f"{url}: HTTP {e.code}{hint}: {detail}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise UnifiedModelsError(f"{url}: {e}") from None
    if "component_values" not in body or "engine" not in body:
        raise UnifiedModelsError(f"{url}: the answer has no fingerprint: {str(body)[:300]}")
    return Fingerprint(body["engine"], body["component_values"])


def check_server_contract(base_url: str, trainer_fingerprint: Fingerprint) -> Fingerprint:
    """Refuse a server whose execution contract differs from the trainer's; returns the server's.

    Raises:
        FingerprintMismatchError: names the differing component, entry and both values.
        UnifiedModelsError: as :func:`server_fingerprint`.
    """
    fp = server_fingerprint(base_url)
    compare(fp, trainer_fingerprint)
    return fp
