"""The instance interface (`interface.py`) and its HTTP client (`client.py`).

`InstanceClient` is the protocol every backend implements, `Capabilities` what one can do,
`InstanceHandle` one started instance, `ExportedRequest` the wire type of KV migration, and
`EngineClient` the client of the embedded engine's HTTP API (which `dora.vllm.client.VllmClient`
extends). Importing this package loads neither torch nor the engine (tests/unit/test_layers.py
checks it).
"""

from dora.instance.callcpu import CALL_CPU, CallCpu
from dora.instance.client import EngineClient
from dora.instance.interface import (
    Capabilities,
    ExportedRequest,
    InstanceClient,
    InstanceHandle,
    SetBackground,
    common_capabilities,
)

__all__ = [
    "CALL_CPU",
    "CallCpu",
    "Capabilities",
    "EngineClient",
    "ExportedRequest",
    "InstanceClient",
    "InstanceHandle",
    "SetBackground",
    "common_capabilities",
]
