"""The instance interface (`interface.py`), the embedded engine's HTTP client (`engine_client.py`)
over the transport every HTTP client of an instance holds (`transport.py`: deadlines, error
mapping), and the HTTP contract every instance serves: request and response schemas (`api.py`),
the server side's shared routes and codecs (`wire.py`), the multiplexed connection (`mux.py` the
client's, `mux_server.py` the server's) and sessions (`session.py` the client's, `session_store.py`
the instance's). The embedded engine and the emulated instances both serve it.

`InstanceClient` is the protocol every backend implements, `Capabilities` what one can do,
`InstanceHandle` one started instance, `ExportedRequest` the wire type of KV migration, and
`EngineClient` the client of the embedded engine's HTTP API (`dora.vllm.client.VllmClient`
implements the protocol itself over the same transport). Importing this package loads neither
torch nor the engine (tests/unit/test_layers.py checks it).
"""

from dora.instance.callcpu import CALL_CPU, CallCpu
from dora.instance.engine_client import EngineClient
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
